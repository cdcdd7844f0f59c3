"""`python -m benchmarks.proxy` (benchmarks/proxy.py): the real proxy process against synthetic peers, on a few
calls at small sizes. The JSON has its keys and sane numbers; the proxy posted exactly the writes its
tables describe; those bytes landed where the tables said at the peers, and the peers' where plan said at
the rank; a dead peer process ends the bench with a TimeoutError instead of a hang."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks import proxy as bp
from moe_a2a.protocol.words import TRACE_EVENTS

SMALL = dict(tokens=8, hidden=64, experts=16, topk=2)


def _assert_row(row: dict, world: int) -> None:
    assert row["world"] == world and row["remote_peers"] == world - 1
    for phase in ("dispatch_host_us", "combine_host_us"):
        for q in ("median", "p90"):
            v = row[phase][q]
            assert math.isfinite(v) and v > 0, (phase, q, v)
        assert row[phase]["p90"] >= row[phase]["median"]
    assert row["goal_us"] == pytest.approx(10 + 0.9 * (world - 1))
    assert set(row["parts"]) == set(bp.PHASES)
    # Writes per call as the tables say: one private per remote peer + the remainders; one combine each.
    assert row["dispatch_writes_per_call"] == pytest.approx(world - 1 + row["remainder_writes_per_call"])
    assert row["combine_writes_per_call"] == world - 1
    assert row["calls_without_full_trace"] == 0
    checks = {k: v for k, v in row["checks"].items() if isinstance(v, bool)}
    assert checks and all(checks.values()), row["checks"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_cli_writes_json_with_the_keys_and_checks_the_bytes(tmp_path, capsys):
    path = tmp_path / "proxy.json"
    rc = bp.main(["--worlds", "4", "--epochs", "6", "--warmup", "2", "--tokens", "8", "--hidden", "64",
                  "--experts", "16", "--topk", "2", "--timeout", "20", "--gap-ms", "0.5", "--verify",
                  "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "dispatch med / p90" in out and "10 + 0.9 * remote_peers" in out
    data = json.loads(path.read_text())
    assert data["bench"] == "proxy" and data["provider"] == "tcp"
    [row] = data["results"]
    _assert_row(row, 4)
    assert row["epochs"] == 6 and row["parts"]["dispatch_host_us"]["n"] == 6
    assert row["checks"]["rank_bytes_checked"] > 0 and row["checks"]["peer_bytes_checked"] > 0
    assert row["checks"]["peers_checked"] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_w8_with_remainders_posts_and_lands_what_the_tables_say():
    """P = 1 row: most peers get a remainder write (DISPATCH_MORE, then DISPATCH_REMAINDER) both ways."""
    row = bp.bench_world(8, "tcp", epochs=6, warmup=2, private_rows=1, timeout_s=20, gap_s=5e-4, check=True,
                         show_progress=False, **SMALL)
    _assert_row(row, 8)
    assert row["remainder_writes_per_call"] > 0
    assert row["parts"]["remainder_us"]["median"] > 0
    assert row["checks"]["peers_checked"] == list(range(1, 8))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_shm_smoke():
    row = bp.bench_world(4, "shm", epochs=5, warmup=1, private_rows=2, timeout_s=20, gap_s=5e-4, check=True,
                         show_progress=False, **SMALL)
    _assert_row(row, 4)
    assert row["provider"] == "shm"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_dead_peer_process_fails_with_a_timeout_not_a_hang():
    with pytest.raises(TimeoutError) as info:
        bp.bench_world(4, "tcp", epochs=20, warmup=0, timeout_s=4, gap_s=0, show_progress=False,
                       _kill_peers_at=3, **SMALL)
    msg = str(info.value)
    assert "epoch 3" in msg or "missing peers" in msg or "exited" in msg, msg


@pytest.mark.timeout(10)
def test_phase_spans_from_a_live_trace_and_the_in_run_factor():
    """`proxy_phase_us` reads an `AllToAll.trace()` dict or the raw trace array alike."""
    import numpy as np

    stamps = {name: 1_000_000 + 1000 * i for i, name in enumerate(TRACE_EVENTS)}  # 1 µs between events
    trace = {"rank": 0, "epoch": 7, "node_local": False, "model": {}, "proxy": stamps}
    spans = bp.proxy_phase_us(trace)
    assert spans["dispatch_host_us"] == pytest.approx(4.0)  # send_ready_seen (2) -> dispatch_received (6)
    assert spans["combine_host_us"] == pytest.approx(2.0)   # combine_send_seen (8) -> combine_received (10)
    assert spans["dispatch_post_us"] == pytest.approx(1.0)
    raw = np.array([(7, stamps[n]) for n in TRACE_EVENTS], dtype=np.int64)
    assert bp.proxy_phase_us(raw) == spans
    raw[0, 0] = 6  # an event of another call is left out, not mixed in
    assert "dispatch_host_us" in bp.proxy_phase_us(raw)
    partial = dict(trace, proxy={k: v for k, v in stamps.items() if not k.startswith("combine")})
    assert "combine_host_us" not in bp.proxy_phase_us(partial)
    in_run = bp.summarize([spans, spans])
    row = {"dispatch_host_us": {"median": 2.0, "p90": 3.0}, "combine_host_us": {"median": 1.0, "p90": 1.0},
           "parts": {"dispatch_post_us": {"median": 0.5}, "combine_post_us": {"median": 1.0}}}
    assert bp.in_run_factor(in_run, row) == pytest.approx(
        {"dispatch_host_us": 2.0, "combine_host_us": 2.0, "dispatch_post_us": 2.0, "combine_post_us": 1.0})
    # `bench e2e --trace-proxy` keeps the same spans per rank under its own names
    from moe_a2a.bench.main import PROXY_SPANS

    e2e_rank = {"proxy." + name: {"median": 6.0} for name in PROXY_SPANS}
    assert {bp.E2E_SPAN_NAMES["proxy." + n] for n in PROXY_SPANS} <= set(bp.PHASES)
    for name, (a, b) in PROXY_SPANS.items():
        assert bp.PHASES[bp.E2E_SPAN_NAMES["proxy." + name]] == (a, b)
    assert bp.in_run_factor(e2e_rank, row)["dispatch_host_us"] == pytest.approx(3.0)
