"""The DeepEP facade over other wires (`Buffer(wire=)`, `MOE_A2A_WIRE`; issue 46, item 3): both modes through
the relay (`A2AConfig.relay`, docs/protocol.md 3.8) at W = 4 as 2 simulated nodes of 2, between real processes,
kernels in the interpreter, checked as tests/compat/test_deep_ep.py and test_deep_ep_normal.py check the per-route
wire; and the refusals at construction.

Low latency: the bf16, fp8, rounded-scale and UE8M0 calls as two micro-batches in flight with late hooks and
cumulative statistics, the weights given to the dispatch (`dispatch_weights=True`); DeepEP's test patterns (a
dispatch never combined, a handle combined twice, zero-copy into `out=`, clean) with torch's defaults moved and
DeepEP's API (the weights at the combine: each call dispatched again with them); a Buffer whose wire comes from
MOE_A2A_WIRE, and the refusals of `dispatch_weights=True`, each aborting the call on every rank. Normal mode: layout, dispatch (bf16 with top-k, fp8 bytes
passed through), the cached dispatch, combine with top-k weights and a bias, exact against torch summed in the
relay's order."""
from __future__ import annotations

import pytest
import torch

from moe_a2a import A2AConfig, LocalCluster

from ..conftest import TEST_DEVICE
from . import test_deep_ep_normal as normal
from .test_deep_ep import E, K, MODES, T_MAX, _attempt, _check_call, _check_combined, _check_patterns, _dequantize
from .test_deep_ep import _deep_ep_patterns_rank, _inputs, _modes_rank

pytestmark = [pytest.mark.slow]

W, NODE, H = 4, 2, 256  # 2 nodes of 2; 2 fp32 scales a row, one int32 word of UE8M0 codes


def _cluster() -> LocalCluster:
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=64, in_dtype=torch.bfloat16)
    return LocalCluster(cfg0, world_size=W, node_size=NODE, transport="shm", device=TEST_DEVICE, timeout_s=120)


# ---- refusals at construction (no processes: checked before the group) -----------------------------
def test_a_wire_is_checked_at_construction(monkeypatch):
    from moe_a2a.compat import Buffer

    monkeypatch.delenv("MOE_A2A_WIRE", raising=False)
    with pytest.raises(ValueError, match=r"wire='per_token' is not a wire: expected one of per_route, "
                                         r"per_rank_dispatch, .*, relay, relay_fp8"):
        Buffer(None, wire="per_token")
    monkeypatch.setenv("MOE_A2A_WIRE", "relay8")
    with pytest.raises(ValueError, match="MOE_A2A_WIRE='relay8' is not a wire"):
        Buffer(None)
    with pytest.raises(ValueError, match="MOE_A2A_WIRE='relay8'"):
        Buffer(None, enable_shrink=True)
    for wire in ("relay", "relay_fp8", "per_rank_dispatch", "fp8_combine"):
        with pytest.raises(ValueError, match=f"enable_shrink=True takes wire 'per_route' only, got wire='{wire}'"):
            Buffer(None, enable_shrink=True, wire=wire)
    monkeypatch.setenv("MOE_A2A_WIRE", "relay")
    with pytest.raises(ValueError, match="got MOE_A2A_WIRE='relay'"):
        Buffer(None, enable_shrink=True)
    with pytest.raises(ValueError, match="dispatch_weights: expected a bool"):
        Buffer(None, wire="relay", dispatch_weights=1)
    # A good wire goes on to the group (none here): the Buffer is not refused for its wire.
    with pytest.raises(ValueError, match="torch.distributed"):
        Buffer(None, wire="per_route", enable_shrink=True)


# ---- low-latency mode through the relay -------------------------------------------------------------
def _weights_at_dispatch_rank(a2a, rank):
    """A Buffer whose wire comes from MOE_A2A_WIRE ("relay"), with `dispatch_weights=True`: a good call, the
    refusals (a dispatch without weights on rank 1, a combine with other weights on rank 0: each aborts the call on
    every rank), then a good call whose handle is combined twice (dispatched again with the dispatch's weights)."""
    import os

    from moe_a2a.compat import Buffer

    dev, seen = a2a.device, []
    os.environ["MOE_A2A_WIRE"] = "relay"
    try:
        buf = Buffer(None, transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size, dispatch_weights=True)
    finally:
        del os.environ["MOE_A2A_WIRE"]
    x, idx, w = (t.to(dev) for t in _inputs(rank, 90, T_MAX, "random", H))

    def good(twice=False):
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False, topk_weights=w)
        y = (2 * recv_x.float()).to(torch.bfloat16)
        combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
        if twice:  # DeepEP's test combines a handle twice
            again, _, _ = buf.low_latency_combine(y, idx, w.clone(), handle)  # equal values: taken
            assert torch.equal(again, combined)
        buf.check()
        seen.append(combined.clone())

    def other_weights():
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False, topk_weights=w)
        buf.low_latency_combine(torch.zeros(E // W, W * T_MAX, H, dtype=torch.bfloat16, device=dev), idx,
                                w * 2 if rank == 0 else w, handle)

    with buf:
        good()
        cfg, lay = buf._slots[0].a2a.cfg, buf._slots[0].a2a.layout
        seen.append((buf.wire, cfg.relay, cfg.dispatch_rows, cfg.combine_rows, lay.node_size))
        _attempt(lambda: buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False,
                                                  topk_weights=None if rank == 1 else w), buf, dev, seen)
        _attempt(other_weights, buf, dev, seen)
        good(twice=True)
    return seen


@pytest.mark.timeout(600)
def test_low_latency_mode_through_the_relay():
    """W = 4 as 2 x 2, wire "relay": the four modes as two micro-batches in flight (rows, fp8 bytes, scales and codes
    in DeepEP's layout, handles, statistics, combined tokens as `reference.combine_relay`) with the weights given to
    the dispatch; DeepEP's test patterns with DeepEP's API (the weights at the combine: each call dispatched again);
    the wire from MOE_A2A_WIRE and the refusals of a Buffer that takes the weights at the dispatch."""
    token_counts = [[T_MAX, 0], [T_MAX, T_MAX - 1], [T_MAX - 2, T_MAX], [1, T_MAX]]  # an empty rank in one batch
    with _cluster() as cl:
        modes = cl.run(_modes_rank, token_counts, H, {"wire": "relay", "dispatch_weights": True})
        patterns = cl.run(_deep_ep_patterns_rank, H, {"wire": "relay"})
        weights = cl.run(_weights_at_dispatch_rank)
    stats = torch.zeros(E // W, W, dtype=torch.int32)
    for call, mode in enumerate(MODES):
        ins = [_inputs(r, call, token_counts[r][call % 2], "random", H) for r in range(W)]
        _check_call([modes[r][0][call] for r in range(W)], ins, mode, W, H, NODE)
        for r in range(W):
            stats[:, r] += modes[r][0][call]["count"]
    for r in range(W):
        assert torch.equal(modes[r][1], stats[:, r]), (modes[r][1], stats[:, r])
    _check_patterns(patterns, W, H, NODE)
    ins = [_inputs(r, 90, T_MAX, "random", H) for r in range(W)]
    for r in range(W):
        seen = weights[r]
        assert len(seen) == 5, seen
        assert seen[1] == ("relay", True, "rank", "rank", NODE), seen[1]
        for i, bad_rank, what in ((2, 1, "topk_weights: this Buffer was built with dispatch_weights=True"),
                                  (3, 0, "topk_weights: over wire 'relay' the combine applies the weights the "
                                         "dispatch was given")):
            if r == bad_rank:
                assert seen[i].startswith(f"ValueError: {what}") and "aborted this call" in seen[i], seen[i]
            else:  # (a rank off the bad rank's rail learns of an abort at its combine from its node's relay)
                assert seen[i].startswith("CallAborted") and (f"rank {bad_rank}" in seen[i] or i == 3), seen[i]
    for i in (0, 4):
        _check_combined([weights[r][i] for r in range(W)], ins, {}, NODE)


# ---- normal mode through the relay -------------------------------------------------------------------
def _normal_relay_rank(a2a, rank, Ts):
    """Normal mode over wire "relay" on one Buffer: layout, a bf16 dispatch with top-k, its combine with top-k
    weights and with a bias, a cached dispatch, an fp8 dispatch (bytes passed through) and its combine."""
    from moe_a2a.compat import deep_ep as m

    W_, node_size, dev = a2a.world_size, a2a.layout.node_size, a2a.device
    E_ = normal.L * W_
    report = {}
    ins = [normal._inputs(s, 1, Ts[s], W_) for s in range(W_)]
    x, idx, w = (t.to(dev) for t in ins[rank])
    T = x.shape[0]
    with m.Buffer(None, int(1e9), 0, low_latency_mode=False, explicitly_destroy=True, transport="shm",
                  timeout_s=30.0, node_group=node_size, wire="relay") as buf:
        per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E_)
        ref = normal._layout_ref(ins[rank][1], W_, node_size)
        assert torch.equal(per_node.cpu(), ref[1]) and torch.equal(in_rank.cpu(), ref[3])
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        rows, ref_idx, ref_w, prefix, lst = normal._recv_ref(ins, rank, W_, 1)
        ref_x = torch.cat([ins[s][0][rows[s]] for s in range(W_)])
        recv_x, r_idx, r_w, r_list, handle, _ = buf.dispatch(x, **layout, topk_idx=idx, topk_weights=w)
        cfg = buf._normal.sets[-1].slots[0].a2a.cfg
        report["wire"] = (cfg.relay, cfg.dispatch_rows, cfg.combine_rows, cfg.combine_fp8)
        assert torch.equal(recv_x.cpu(), ref_x) and torch.equal(r_idx.cpu(), ref_idx)
        assert torch.equal(r_w.cpu(), ref_w) and r_list == lst
        assert torch.equal(handle[0][:, rank].cpu(), torch.tensor(prefix, dtype=torch.int32))
        assert torch.equal(handle[3].cpu(), torch.cat(rows).to(torch.int32))
        y = (recv_x.float() * (rank + 1) + 0.5).to(torch.bfloat16)
        wy = r_w * (rank + 2)
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=wy)
        bias = torch.randn(T, normal.H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        combined2, _, _ = buf.combine(y, handle, bias=bias.to(dev))  # the handle combined again
        report["combine"] = (y.cpu(), wy.cpu(), combined.cpu(), combined_w.cpu(), bias, combined2.cpu())
        x2 = (x.float() * 3).to(torch.bfloat16)
        recv2 = buf.dispatch(x2, handle=handle)[0]  # cached
        assert torch.equal(recv2.cpu(), torch.cat([(ins[s][0].float() * 3).to(torch.bfloat16)[rows[s]]
                                                   for s in range(W_)]))
        q, s = normal._fp8(ins[rank][0].new_zeros(T, normal.H8), rank, 1)
        (rq, rs), _, _, _, handle8, _ = buf.dispatch((q.to(dev), s.to(dev)), **layout, topk_idx=idx, topk_weights=w)
        fp8s = [normal._fp8(ins[r][0].new_zeros(Ts[r], normal.H8), r, 1) for r in range(W_)]
        assert torch.equal(rq.cpu().view(torch.uint8), torch.cat([fp8s[r][0].view(torch.uint8)[rows[r]]
                                                                  for r in range(W_)]))
        assert torch.equal(rs.cpu(), torch.cat([fp8s[r][1][rows[r]] for r in range(W_)]))
        c8, _, _ = buf.combine(torch.ones(rq.shape[0], normal.H8, dtype=torch.bfloat16, device=dev) * (rank + 1),
                               handle8)
        report["fp8_combine"] = c8.cpu()
    return report


def _combined_relay_ref(ins, ys, wys, rank: int, biases=()):
    """`normal._combined_ref` summed as the relay sums: the biases, then per node in ascending order the rows of
    `rank`'s own node one by one, another node's as one row (its ranks' rows summed from +0 in rank order), all
    fp32, one cast (`reference.combine_relay`'s order, with weight 1 a route and fp32 rows)."""
    x, idx, _ = ins[rank]
    T = x.shape[0]
    acc, accw = torch.zeros(T, x.shape[1]), torch.zeros(T, normal.K)
    for b in biases:
        acc += b.float()
    in_ranks = [normal._layout_ref(i, W, W)[3] for _, i, _ in ins]
    for node in range(W // NODE):
        part, partw = torch.zeros_like(acc), torch.zeros_like(accw)
        for r in range(node * NODE, (node + 1) * NODE):
            start = sum(int(in_ranks[s][:, r].sum()) for s in range(rank))
            sel = in_ranks[rank][:, r].nonzero().flatten()
            if node == rank // NODE:
                acc[sel] += ys[r][start:start + len(sel)].float()
                if wys is not None:
                    accw[sel] += wys[r][start:start + len(sel)]
            else:
                part[sel] += ys[r][start:start + len(sel)].float()
                if wys is not None:
                    partw[sel] += wys[r][start:start + len(sel)]
        if node != rank // NODE:
            acc += part
            accw += partw
    return acc.to(torch.bfloat16), accw


@pytest.mark.timeout(600)
def test_normal_mode_through_the_relay():
    """W = 4 as 2 x 2, wire "relay" (its combine in fp32 rows): received tokens, ids, weights, handle and the list
    exact; combines exact against torch in the relay's order (and DeepEP's: the same sums here)."""
    Ts = [9, 0, 7, 5]  # an empty rank
    with _cluster() as cl:
        got = cl.run(_normal_relay_rank, Ts)
    ins = [normal._inputs(s, 1, Ts[s], W) for s in range(W)]
    ys = [got[r]["combine"][0] for r in range(W)]
    wys = [got[r]["combine"][1] for r in range(W)]
    for rank in range(W):
        assert got[rank]["wire"] == (True, "rank", "rank", False)
        want, want_w = _combined_relay_ref(ins, ys, wys, rank)
        assert torch.equal(got[rank]["combine"][2], want) and torch.equal(got[rank]["combine"][3], want_w), rank
        assert torch.equal(want, normal._combined_ref(ins, ys, wys, rank, W)[0]), rank  # DeepEP's order: equal here
        bias = got[rank]["combine"][4]
        assert torch.equal(got[rank]["combine"][5], _combined_relay_ref(ins, ys, None, rank, (bias,))[0]), rank
        in_rank = normal._layout_ref(ins[rank][1], W, W)[3]
        reached = in_rank.float() @ torch.arange(1, W + 1, dtype=torch.float32)
        assert torch.equal(got[rank]["fp8_combine"].float(), reached[:, None].expand(-1, normal.H8)), rank
