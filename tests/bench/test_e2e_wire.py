"""`moe-a2a bench e2e --wire` (issue 32's levers): the names are reference.WIRE_VARIANTS', the oracle holds a
sender-reduced combine to `reference.combine_reduced_at_sender`, and a run over one node (CPU, interpreter)
checks a call against the reference and writes the variant and the bytes of its rows."""
import dataclasses
import json

import pytest
import torch

from moe_a2a import reference
from moe_a2a.bench import main as bench_main
from moe_a2a.bench.main import WIRE_NAMES
from moe_a2a.cli import main as cli_main
from ..conftest import interpreter_only


def test_wire_names_are_the_references():
    assert WIRE_NAMES == tuple(reference.WIRE_VARIANTS)


def test_the_configs_wires_are_the_references_and_the_relays():
    """`config.WIRES` (what `wire_config` and the DeepEP facade's `wire=` take) spells the reference's variants and
    the relay's over the sender-reduced rows; --wire offers the same names; another name is a ValueError naming them."""
    from moe_a2a.bench.main import WIRE_CHOICES
    from moe_a2a.config import A2AConfig, WIRES, wire_config

    assert tuple(WIRES) == WIRE_CHOICES
    for name, w in reference.WIRE_VARIANTS.items():
        assert WIRES[name] == (w.dispatch_rows, w.combine_rows, w.combine_fp8, False), name
    with pytest.raises(ValueError, match="unknown wire 'per_token': expected one of per_route, .*relay_fp8"):
        wire_config(A2AConfig(max_num_tokens=4, num_experts=4, experts_per_token=2, hidden_dim=32), "per_token")


def test_an_unknown_wire_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "e2e", "--wire", "per_token"])
    assert e.value.code == 2 and "--wire" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("name", WIRE_NAMES)
def test_wire_config_sets_the_three_fields(name):
    from moe_a2a.config import A2AConfig, wire_config

    cfg = wire_config(A2AConfig(max_num_tokens=4, num_experts=4, experts_per_token=2, hidden_dim=32), name)
    w = reference.WIRE_VARIANTS[name]
    assert (cfg.dispatch_rows, cfg.combine_rows, cfg.combine_fp8) == (w.dispatch_rows, w.combine_rows, w.combine_fp8)
    assert cfg.max_num_tokens == 4 and cfg.hidden_dim == 32


@pytest.mark.parametrize("name,rows", [("relay", "sender_reduced"), ("relay_fp8", "sender_reduced_fp8")])
def test_the_relay_wires_are_the_sender_reduced_rows_through_the_relay(name, rows):
    from moe_a2a.bench.main import WIRE_CHOICES
    from moe_a2a.config import A2AConfig, wire_config

    base = A2AConfig(max_num_tokens=4, num_experts=4, experts_per_token=2, hidden_dim=32)
    cfg = wire_config(base, name)
    assert name in WIRE_CHOICES and cfg.relay
    assert cfg == dataclasses.replace(wire_config(base, rows), relay=True)
    assert not wire_config(base, rows).relay


def _recorded(cfg, xs, xss, idx, ws, outs) -> dict:
    """Per rank the `oracle.record_call` of a call whose dispatch is the reference's and whose combine is `outs`."""
    from moe_a2a.oracle import fill_sentinel, record_call

    got = {}
    for r, (num, ex, exs) in enumerate(reference.dispatch(cfg, xs, xss, idx)):
        buf = torch.empty(ex.shape[0] + 2, cfg.hidden_dim, dtype=cfg.in_dtype)
        sbuf = None if exs is None else torch.empty(ex.shape[0] + 2, exs.shape[1])
        fill_sentinel(buf, sbuf)
        buf[: ex.shape[0]] = ex
        if sbuf is not None:
            sbuf[: ex.shape[0]] = exs
        got[r] = record_call(cfg, xs[r], None if xss is None else xss[r], idx[r], ws[r], num, buf, sbuf, outs[r])
    return got


def _sender_reduced(cfg, xs, xss, idx, ws):
    from moe_a2a.oracle import toy_expert

    ys = [toy_expert(ex, exs, cfg) for _, ex, exs in reference.dispatch(cfg, xs, xss, idx)]
    return reference.combine_reduced_at_sender(cfg, idx, ws, ys, fp8=cfg.combine_fp8), ys


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-rows", "fp8-rows"])
def test_oracle_holds_a_sender_reduced_combine_to_its_reference(fp8):
    # the reference's own results pass; today's per-route sum (which rounds once, not per rank) is reported
    from moe_a2a.config import A2AConfig
    from moe_a2a.oracle import check_call

    cfg = A2AConfig(max_num_tokens=8, num_experts=4, experts_per_token=3, hidden_dim=256, dispatch_rows="rank",
                    combine_rows="rank", combine_fp8=fp8)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 256, generator=g).to(cfg.in_dtype) for _ in range(2)]
    idx = [torch.randint(0, 4, (8, 3), generator=g, dtype=torch.int32) for _ in range(2)]
    ws = [torch.rand(8, 3, generator=g) for _ in range(2)]
    inputs = [(xs[s], None, idx[s], ws[s], None) for s in range(2)]
    outs, ys = _sender_reduced(cfg, xs, None, idx, ws)
    assert check_call(cfg, inputs, _recorded(cfg, xs, None, idx, ws, outs)) == []
    per_route = (reference.combine_fp8 if fp8 else reference.combine)(cfg, idx, ws, ys)
    assert any("differs from the reference" in p for p in check_call(cfg, inputs, _recorded(cfg, xs, None, idx, ws,
                                                                                            per_route)))


@pytest.mark.parametrize("wrong", [False, True], ids=["right-sum", "wrong-sum"])
def test_graph_run_records_the_wire_the_bytes_and_the_decode_check(monkeypatch, wrong):
    # graph.run's bookkeeping with a stand-in cluster (its rank function needs CUDA graphs): the wire variant
    # reaches the config, decode is checked and prefill not, the traced call's bytes become bytes_per_rank
    import moe_a2a.local
    from moe_a2a.bench import graph, kernels
    from moe_a2a.bench.demo import make_inputs

    small = dict(max_num_tokens=6, num_experts=4, experts_per_token=2, hidden_dim=256)
    monkeypatch.setitem(kernels.PRESETS, "decode", small)
    monkeypatch.setitem(kernels.PRESETS, "prefill", small)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "stand-in")
    seen = []

    class Cluster:
        def __init__(self, cfg, world_size, **kw):
            self.cfg, self.world = cfg, world_size

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, fn, iters, warmup, seed, sets, check):
            assert fn is graph._graph_rank and sets == 4
            seen.append((self.cfg.dispatch_rows, self.cfg.combine_rows, self.cfg.combine_fp8, check))
            x, xs, idx, ws = zip(*(make_inputs(self.cfg, r, self.cfg.max_num_tokens, seed) for r in range(self.world)))
            outs, _ = _sender_reduced(self.cfg, list(x), list(xs), list(idx), list(ws))
            if wrong:
                outs[1] = outs[1] + 1
            calls = _recorded(self.cfg, list(x), list(xs), list(idx), list(ws), outs)
            stats = {"median": 10.0, "p10": 9.0, "p90": 11.0, "min": 8.0, "n": iters}
            return [{"dispatch": stats, "combine": stats, "total": stats, "eager": {"total": stats}, "node_local": True,
                     "trace": {"rank": r, "bytes": {"dispatch": {"node_sent": 100 + r}}},
                     **({"checked": {"calls": [calls[r]]}} if check else {})} for r in range(self.world)]

    monkeypatch.setattr(moe_a2a.local, "LocalCluster", Cluster)
    res = graph.run(2, 2, ["decode", "prefill"], 10, 1, 30.0, nccl=False, wire="sender_reduced_fp8")
    assert res["wire"] == "sender_reduced_fp8"
    assert seen == [("rank", "rank", True, True), ("rank", "rank", True, False)]
    decode, prefill = res["presets"]["decode"], res["presets"]["prefill"]
    assert decode["bytes_per_rank"] == [{"dispatch": {"node_sent": 100}}, {"dispatch": {"node_sent": 101}}]
    assert "check" not in prefill and all("checked" not in g for g in decode["graph"])
    assert decode["seconds"] >= 0 and "combine_rows='rank'" in decode["config"]
    problems = graph.check_problems(res)
    assert (problems != []) == wrong and decode["check"]["problems"] == [p.split(": ", 1)[1] for p in problems]
    if wrong:
        assert all(p.startswith("decode: call 0 rank 1: combined token") for p in problems)


@interpreter_only("its ranks run on the CPU (--device cpu / device='cpu')")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_e2e_bench_sender_reduced_on_one_node(tmp_path, capsys):
    out_json = tmp_path / "e2e.json"
    assert bench_main(["e2e", "--wire", "sender_reduced", "--world", "2", "--node", "2", "--iters", "2",
                       "--warmup", "1", "--device", "cpu", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["wire"] == "sender_reduced" and "combine_rows='rank'" in data["config"]
    assert data["check"] == {"calls": 1, "problems": []}
    assert "against reference.py: matches" in capsys.readouterr().out
    # one node: every byte to the node peer, none remote; what one rank sends the other receives
    nbytes = data["bytes_per_rank"]
    assert len(nbytes) == 2
    for b in nbytes:
        assert all(b[ph]["remote_sent"] == b[ph]["remote_received"] == 0 for ph in ("dispatch", "combine"))
        assert b["dispatch"]["node_sent"] > 0 and b["combine"]["node_sent"] > 0
    for ph in ("dispatch", "combine"):
        assert nbytes[0][ph]["node_sent"] == nbytes[1][ph]["node_received"]
        assert nbytes[1][ph]["node_sent"] == nbytes[0][ph]["node_received"]
