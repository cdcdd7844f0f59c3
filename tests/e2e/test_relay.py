"""The relay (`A2AConfig(relay=True)`, docs/protocol.md 3.8) end to end: LocalCluster ranks as 2-4 simulated nodes
(real processes, real libfabric shm/tcp or the emulated NIC between the proxies), kernels in the interpreter, against reference.py:
every rank's dispatch output is `reference.dispatch`'s bit for bit, the combined tokens
`reference.combine_relay`'s (bf16 and fp8 rows), for random routings with -1 routes, duplicated experts,
skew, bound_m and accumulate; and the proxies write only along their rail (nodes - 1 writes a phase), with
several proxies a rank each write in pieces, one per proxy."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_a2a import LocalCluster, reference
from moe_a2a.config import A2AConfig

from ..conftest import TEST_DEVICE
from .test_rank_rows import K, T, H, _call, _inputs, check_dispatch, open_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _cfg(world: int, **kw) -> A2AConfig:
    kw = {"hidden_dim": H, "relay": True, **kw}
    return A2AConfig(max_num_tokens=T, num_experts=2 * world, experts_per_token=K, dispatch_rows="rank",
                     combine_rows="rank", **kw)


def _check(cfg, world, node, results, xs, scales, idxs, ws, bound, accumulate):
    live = check_dispatch(cfg, world, results, xs, scales, idxs, bound)
    ys = [res[3] for res in results]
    olds = [res[4] for res in results] if accumulate else None
    want = reference.combine_relay(cfg, live, ws, ys, node, out_tokens=olds, fp8=cfg.combine_fp8)
    for r in range(world):
        out = results[r][5]
        n_live = xs[r].shape[0] if bound is None else bound[r]
        assert torch.equal(out[:n_live], want[r][:n_live]), (r, (out[:n_live].float() - want[r][:n_live].float()).abs().max())
        assert torch.equal(out[n_live:], results[r][4][n_live:]), r  # tokens past bound_m untouched


# name: (world, node size, transport, buffers, config fields[, proxies a rank: each write in that many pieces])
CONFIGS = {
    "W4-N2-SHM-P1": (4, 2, "shm", "auto", dict(max_private_tokens=1)),
    "W6-N3-TCP-fp8-staged": (6, 3, "tcp", "staged", dict(combine_fp8=True, in_dtype=torch.float8_e4m3fn)),
    "W4-N1-TCP-memfd-P0": (4, 1, "tcp", "memfd", dict(max_private_tokens=0)),
    "W4-N2-emulated-P2-pieces2": (4, 2, "emulated", "auto", dict(max_private_tokens=2), 2),  # the emulated NIC's carrier
    "W2-one-node": (2, 2, "shm", "auto", {}),  # nothing to relay: the sender-reduced rows' call
    # Each write in 2 / 3 pieces, one per proxy (P small: remainders in pieces too, some of them empty)
    "W4-N2-SHM-P1-pieces2": (4, 2, "shm", "auto", dict(max_private_tokens=1), 2),
    "W6-N3-TCP-fp8-P0-pieces3": (6, 3, "tcp", "auto", dict(combine_fp8=True, max_private_tokens=0), 3),
}
CONFIGS = {k: v for k, v in CONFIGS.items() if TEST_DEVICE == "cpu" or v[3] != "memfd"}  # (CPU's stand-in)


@pytest.fixture(scope="module", params=list(CONFIGS))
def cluster(request):
    cl, cfg, world, node = open_cluster(CONFIGS, request.param, _cfg)
    with cl:
        yield cl, cfg, world, node


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), skew=st.booleans(), accumulate=st.booleans(), data=st.data())
def test_relay_matches_reference(cluster, seed, skew, accumulate, data):
    cl, cfg, world, node = cluster
    tokens = data.draw(st.lists(st.integers(0, T), min_size=world, max_size=world))
    bound = data.draw(st.one_of(st.none(), st.just([data.draw(st.integers(0, n)) for n in tokens])))
    xs, scales, idxs, ws = _inputs(cfg, world, seed, skew, tokens)
    results = cl.run(_call, cfg, xs, scales, idxs, ws, bound, accumulate)
    _check(cfg, world, node, results, xs, scales, idxs, ws, bound, accumulate)


def _one_call_report(a2a, rank, cfg, xs, idxs, ws):
    dev = a2a.device
    num, ex, exs = a2a.empty_dispatch_outputs()
    before = a2a.writes_posted(per_proxy=True)
    a2a.dispatch(num, ex, exs, xs[rank].to(dev), None, idxs[rank].to(dev), weights=ws[rank].to(dev))
    y = torch.ones(ex.shape[0], cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
    a2a.combine(torch.zeros(xs[rank].shape[0], cfg.hidden_dim, dtype=cfg.out_dtype, device=dev), idxs[rank].to(dev),
                ws[rank].to(dev), y)
    after = a2a.writes_posted(per_proxy=True)
    return [{ph: a[ph] - b[ph] for ph in a} for a, b in zip(after, before)], a2a.bytes_last_call()


@pytest.mark.parametrize("relay,proxies", [(True, 1), (True, 2), (False, 1)])
def test_a_rank_writes_once_per_remote_node_and_its_network_bytes_are_the_references(relay, proxies):
    """W = 6 as 3 nodes of 2, P large (no remainders): with the relay a rank posts nodes - 1 = 2 writes a phase
    (to its rail); with 2 proxies each write goes in 2 pieces, one by each proxy (`Layout.wire_pieces`), so each
    proxy posts its piece of both; without the relay W - node = 4 from one proxy. The network bytes a rank sends
    are the hop-1 rows (one per (token, remote node)) and one count row per relay, as
    `reference.relay_bytes_per_phase` counts them, whatever the pieces."""
    world, node = 6, 2
    cfg = _cfg(world, relay=relay, max_private_tokens=T * K)
    xs, _, idxs, ws = _inputs(cfg, world, 5, False, [T] * world)
    with LocalCluster(cfg, world_size=world, node_size=node, transport="shm", device=TEST_DEVICE, timeout_s=60,
                      proxies=proxies) as cl:
        got = cl.run(_one_call_report, cfg, xs, idxs, ws)
    per_proxy = [{"dispatch": 2, "combine": 2}] * proxies if relay else [{"dispatch": 4, "combine": 4}]
    assert [w for w, _ in got] == [per_proxy] * world
    writes = world // node - 1 if relay else world - node
    if relay:
        spec = reference.relay_bytes_per_phase(cfg, idxs, node)
        head = 4 * cfg.layout(world, node).count_row_ints
        for r, (_, sent) in enumerate(got):
            assert sent["dispatch"]["remote_sent"] == spec[r]["dispatch"]["remote"] + writes * head, r
            assert sent["combine"]["remote_sent"] == spec[r]["combine"]["remote"], r


def _good_bad_good_good(a2a, rank, cfg, bad_rank, kind):
    """Four calls; call 1 is rejected on `bad_rank` ("weights": its dispatch, before anything is sent;
    "combine": its combine input, after the dispatch) or overflows an expert ("capacity": every route of every
    rank to expert 0). Returns what each call raised (None: ok) and the good calls' records for the oracle."""
    from moe_a2a.all_to_all import CallAborted, CapacityExceeded
    from moe_a2a.bench.demo import make_inputs
    from moe_a2a.oracle import fill_sentinel, record_call, toy_expert

    dev, out = a2a.device, []
    num, ex, exs = a2a.empty_dispatch_outputs()
    for it in range(4):
        x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, cfg.max_num_tokens, 70 + it))
        if it == 1 and kind == "capacity":
            idx = torch.zeros_like(idx)
        bad = it == 1 and rank == bad_rank
        res = torch.zeros(cfg.max_num_tokens, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
        fill_sentinel(ex, exs)
        try:
            a2a.dispatch(num, ex, exs, x, xs, idx, weights=None if bad and kind == "weights" else w)
            y = toy_expert(ex, exs, cfg)
            a2a.combine(res, idx, w.to(torch.bfloat16) if bad and kind == "combine" else w, y)
            a2a.check()
        except (ValueError, CallAborted, CapacityExceeded) as exc:
            out.append((type(exc).__name__, str(exc), None))
            continue
        out.append((None, "", record_call(cfg, x, xs, idx, w, num, ex, exs, res)))
    return out


# (kind, bad rank): a rank that aborts at its dispatch (its count row of -1 reaches the other node through its
# relay), at its combine (rank 0: home 3 is off its rail and learns it from relay 1, which passes on its node
# peer's abort), or over an expert's capacity (rank 0's expert 0, from every rank's routes)
ABORTS = [("weights", 3), ("combine", 0), ("capacity", None)]


@pytest.mark.parametrize("proxies", [1, 2])
def test_an_abort_reaches_every_rank_through_the_relays_and_never_a_later_call(proxies):
    """W = 4 as 2 nodes of 2, through the relay, one instance: for each of `ABORTS`, good -> bad -> good -> good:
    every rank's call 1 fails (the bad rank's with its own error, an overflowed expert's rank with
    CapacityExceeded, every other with CallAborted), and calls 0, 2, 3 match the reference. With 2 proxies a
    rank each write goes in 2 pieces, and an aborted combine's immediate rides every piece."""
    from moe_a2a.oracle import check_against_reference

    world, node = 4, 2
    cfg = _cfg(world, in_dtype=torch.bfloat16, expert_capacity=T * world)  # room for every call but "capacity"
    with LocalCluster(cfg, world_size=world, node_size=node, transport="shm", device=TEST_DEVICE, timeout_s=60,
                      proxies=proxies) as cl:
        runs = [(kind, bad_rank, cl.run(_good_bad_good_good, cfg, bad_rank, kind)) for kind, bad_rank in ABORTS]
    for kind, bad_rank, got in runs:
        for r, calls in enumerate(got):
            err, msg, _ = calls[1]
            want = ("ValueError" if r == bad_rank else "CapacityExceeded" if kind == "capacity" and r == 0
                    else "CallAborted")
            assert err == want, (kind, r, msg)
            assert [c[0] for i, c in enumerate(calls) if i != 1] == [None] * 3, (kind, r, [c[:2] for c in calls])
        good = [{"calls": [c[2] for i, c in enumerate(calls) if i != 1]} for calls in got]
        assert check_against_reference(cfg, good, node_size=node) == [], kind
