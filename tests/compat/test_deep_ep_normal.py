"""DeepEP's normal mode in the facade (issue 32, item 6): `get_dispatch_layout`, `dispatch` (bf16 and fp8,
top-k, `expert_alignment`, `num_worst_tokens`, the cached form with a handle) and `combine` (bias, top-k
weights), between real processes on CPU, against a torch reference written here from DeepEP's semantics
(commit dd758ca: `deep_ep/buffers/legacy.py`, `csrc/legacy/buffer.hpp`, `csrc/kernels/legacy/intranode.cu`,
`tests/legacy/test_intranode.py`):

- received tokens are grouped by source rank, in token order; `rank_prefix_matrix[s][r]` counts the rows
  rank r receives from ranks <= s;
- `recv_topk_idx` is local (`id - r * L`), -1 for another rank's expert; `recv_topk_weights` 0 there;
- `num_recv_tokens_per_expert_list`: the callers' `num_tokens_per_expert` summed over sources, rounded up to
  `expert_alignment`; empty with `num_worst_tokens`, which pads the outputs (`recv_topk_idx` -1 past the count);
- combine: `bias_0 + bias_1` (fp32) then the rows of the ranks that received the token, in rank order, in
  fp32, one cast to bf16; the top-k weights summed the same way.
"""
from __future__ import annotations

import pytest
import torch

from moe_a2a import A2AConfig, LocalCluster

from ..conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow]

H, L, K = 64, 3, 4  # hidden; local experts a rank; top-k (L < K: a token often hits several experts of a rank)
H8, S8 = 256, 2     # fp8 calls: hidden and scale columns


def _inputs(rank: int, seed: int, T: int, W: int, hidden: int = H):
    """One rank's tokens and routing (any rank can make any rank's): -1 routes, repeated ranks."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    E = L * W
    x = torch.randn(T, hidden, generator=g, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K,
                                                                                                    dtype=torch.int64)
    idx[torch.rand(T, K, generator=g) < 0.25] = -1
    if T:
        idx[0] = -1  # a token routed nowhere
    w = torch.rand(T, K, generator=g, dtype=torch.float32)
    return x, idx, w


def _fp8(x: torch.Tensor, rank: int, seed: int):
    """An fp8 payload and its scales: arbitrary bits (passed through untouched), column-major scales."""
    g = torch.Generator().manual_seed(7000 + 1000 * seed + rank)
    q = torch.randint(0, 256, tuple(x.shape), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(x.shape[0], S8, generator=g, dtype=torch.float32)
    return q, s.T.contiguous().T  # DeepEP's test passes column-major scales


def _layout_ref(idx: torch.Tensor, W: int, node_size: int):
    E = L * W
    T = idx.shape[0]
    in_rank = torch.zeros(T, W, dtype=torch.bool)
    for t in range(T):
        for e in idx[t].tolist():
            if e >= 0:
                in_rank[t, e // L] = True
    per_expert = torch.tensor([(idx == e).sum().item() for e in range(E)], dtype=torch.int32)
    per_node = None
    if node_size < W:
        per_node = in_rank.view(T, W // node_size, node_size).any(2).sum(0).to(torch.int32)
    return in_rank.sum(0).to(torch.int32), per_node, per_expert, in_rank


def _recv_ref(ins, rank: int, W: int, align: int):
    """What `rank` receives: rows of x (or a tuple's parts), local top-k ids and weights, the list."""
    rows, ids, ws, prefix, counts = [], [], [], [], torch.zeros(L, dtype=torch.int64)
    total = 0
    for s, (x, idx, w) in enumerate(ins):
        in_rank = _layout_ref(idx, W, W)[3][:, rank]
        sel = in_rank.nonzero().flatten()
        rows.append(sel)
        local = (idx >= rank * L) & (idx < rank * L + L)
        ids.append(torch.where(local, idx - rank * L, torch.full_like(idx, -1))[sel])
        ws.append(torch.where(local, w, torch.zeros_like(w))[sel])
        for l in range(L):
            counts[l] += (idx == rank * L + l).sum()
        total += len(sel)
        prefix.append(total)
    lst = [-(-int(c) // align) * align for c in counts]
    return rows, torch.cat(ids), torch.cat(ws), prefix, lst


def _combined_ref(ins, ys, wys, rank: int, W: int, biases=()):
    """`rank`'s combined tokens: biases then each receiving rank's row, in rank order, fp32, one cast."""
    x, idx, _ = ins[rank]
    T = x.shape[0]
    acc = torch.zeros(T, x.shape[1], dtype=torch.float32)
    accw = torch.zeros(T, K, dtype=torch.float32)
    for b in biases:
        acc += b.float()
    for r in range(W):
        # rank r's rows from `rank` are its rows [start, start + count), in token order
        start = sum(int(_layout_ref(ins[s][1], W, W)[3][:, r].sum()) for s in range(rank))
        sel = _layout_ref(idx, W, W)[3][:, r].nonzero().flatten()
        acc[sel] += ys[r][start:start + len(sel)].float()
        if wys is not None:
            accw[sel] += wys[r][start:start + len(sel)]
    return acc.to(torch.bfloat16), accw


def _normal_rank(a2a, rank, Ts):
    """Every normal-mode case on one Buffer; asserts here, returns what the main process compares."""
    from moe_a2a.all_to_all import CallAborted
    from moe_a2a.compat import deep_ep as m

    W, node_size, dev = a2a.world_size, a2a.layout.node_size, a2a.device
    E = L * W
    report = {}
    ins = [_inputs(s, 1, Ts[s], W) for s in range(W)]
    x, idx, w = (t.to(dev) for t in ins[rank])
    T = x.shape[0]

    with m.Buffer(None, int(1e9), 0, low_latency_mode=False, explicitly_destroy=True, transport="shm",
                  timeout_s=30.0, node_group=node_size) as buf:
        # get_dispatch_layout against torch (num_tokens_per_rdma_rank: None on one node, per node on several)
        per_rank, per_node, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, E)
        ref = _layout_ref(ins[rank][1], W, node_size)
        assert torch.equal(per_rank.cpu(), ref[0]) and per_rank.dtype == torch.int32
        assert (per_node is None) == (ref[1] is None) and (per_node is None or torch.equal(per_node.cpu(), ref[1]))
        assert torch.equal(per_expert.cpu(), ref[2]) and torch.equal(in_rank.cpu(), ref[3])
        assert isinstance(ev, m.EventOverlap)
        assert m.Buffer.is_sm90_compiled()
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        rows, ref_idx, ref_w, prefix, lst = _recv_ref(ins, rank, W, 1)
        ref_x = torch.cat([ins[s][0][rows[s]] for s in range(W)])
        n = ref_x.shape[0]

        # 0. the first call routes each token to one expert (instances built for one rank a token), then
        # calls with more ranks a token build larger ones
        idx1 = idx[:, :1].contiguous()
        p1, _, e1, r1, _ = buf.get_dispatch_layout(idx1, E)
        recv1, ridx1, rw1, _, h1, _ = buf.dispatch(x, num_tokens_per_rank=p1, is_token_in_rank=r1,
                                                   num_tokens_per_expert=e1, topk_idx=idx1,
                                                   topk_weights=w[:, :1].contiguous())
        ins1 = [(a, b[:, :1], c[:, :1]) for a, b, c in ins]
        rows1, ref_idx1, ref_w1, _, _ = _recv_ref(ins1, rank, W, 1)
        assert torch.equal(recv1.cpu(), torch.cat([ins[s][0][rows1[s]] for s in range(W)]))
        assert torch.equal(ridx1.cpu(), ref_idx1) and torch.equal(rw1.cpu(), ref_w1)
        y1 = (recv1.float() * (rank + 1)).to(torch.bfloat16)
        c1, _, _ = buf.combine(y1, h1)
        report["top1"] = (y1.cpu(), c1.cpu())
        assert [st.R for st in buf._normal.sets] == [1]  # instances for one rank a token

        # 1. bf16 with top-k, async_finish and previous_event (EventOverlap-like, as the low-latency path)
        recv_x, r_idx, r_w, r_list, handle, ev = buf.dispatch(
            x, **layout, num_tokens_per_rdma_rank=per_node, topk_idx=idx, topk_weights=w,
            config=m.Buffer.get_dispatch_config(W),
            previous_event=m.Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
        ev.current_stream_wait()
        with ev:
            pass
        assert torch.equal(recv_x.cpu(), ref_x) and recv_x.is_contiguous()
        assert [st.R for st in buf._normal.sets][-1] > 1  # a larger set for more ranks a token
        assert torch.equal(r_idx.cpu(), ref_idx) and r_idx.dtype == torch.int64
        assert torch.equal(r_w.cpu(), ref_w) and r_list == lst
        assert torch.equal(handle[0][:, rank].cpu(), torch.tensor(prefix, dtype=torch.int32))
        assert torch.equal(handle[3].cpu(), torch.cat(rows).to(torch.int32))  # the source token indices
        assert torch.equal(handle[4].cpu(), ref[3])
        # the combine input: a function of the received rows and of this rank; weights changed too
        y = (recv_x.float() * (rank + 1) + 0.5).to(torch.bfloat16)
        wy = r_w * (rank + 2)
        combined, combined_w, ev = buf.combine(y, handle, topk_weights=wy, previous_event=m.Buffer.capture(),
                                               async_finish=True)
        report["combine1"] = (y.cpu(), wy.cpu(), combined.cpu(), combined_w.cpu())
        # the same handle combined again, with a bias this time
        bias = torch.randn(T, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float32).to(torch.bfloat16)
        combined2, none_w, _ = buf.combine(y, handle, bias=bias.to(dev), config=m.Buffer.get_combine_config(W))
        assert none_w is None
        report["combine_bias"] = (bias, combined2.cpu())

        # 2. without top-k: the layout alone, then the cached dispatch (handle) and its combine (two biases)
        recv_x, r_idx, r_w, r_list, handle2, _ = buf.dispatch(x, **layout)
        assert r_idx is None and r_w is None and r_list == lst and torch.equal(recv_x.cpu(), ref_x)
        x2 = (x.float() * 3).to(torch.bfloat16)
        recv2, a, b, c, d, ev = buf.dispatch(x2, handle=handle2, async_finish=True)
        assert (a, b, c, d) == (None, None, None, None) and isinstance(ev, m.EventOverlap)
        assert torch.equal(recv2.cpu(), torch.cat([(ins[s][0].float() * 3).to(torch.bfloat16)[rows[s]]
                                                   for s in range(W)]))
        b0 = torch.full((T, H), 0.25, dtype=torch.bfloat16)
        b1 = torch.full((T, H), 1e-3, dtype=torch.bfloat16)
        combined3, _, _ = buf.combine(recv2, handle2, bias=(b0.to(dev), b1.to(dev)))
        report["combine_two_biases"] = (recv2.cpu(), b0, b1, combined3.cpu())
        # DeepEP's internode_* names: the same calls
        recv3 = buf.internode_dispatch(x2, handle=handle2)[0]
        assert torch.equal(recv3, recv2)
        combined3b, _, _ = buf.internode_combine(recv2, handle2, bias=(b0.to(dev), b1.to(dev)))
        assert torch.equal(combined3b, combined3)

        # 3. fp8 (x, scales) with top-k, expert_alignment 4, num_worst_tokens: bits passed through
        q, s = _fp8(ins[rank][0].new_zeros(T, H8), rank, 1)
        worst = sum(Ts) + 5
        recv_x, r_idx, r_w, r_list, handle3, _ = buf.dispatch(
            (q.to(dev), s.to(dev)), **layout, topk_idx=idx, topk_weights=w, expert_alignment=4,
            num_worst_tokens=worst)
        rq, rs = recv_x
        fp8s = [_fp8(ins[r][0].new_zeros(Ts[r], H8), r, 1) for r in range(W)]
        assert rq.dtype == torch.float8_e4m3fn and rq.shape == (worst, H8) and rs.shape == (worst, S8)
        assert torch.equal(rq[:n].cpu().view(torch.uint8),
                           torch.cat([fp8s[r][0].view(torch.uint8)[rows[r]] for r in range(W)]))
        assert torch.equal(rs[:n].cpu(), torch.cat([fp8s[r][1][rows[r]] for r in range(W)]))
        assert r_list == [] and r_idx.shape == (worst, K) and r_w.shape == (worst, K)
        assert torch.equal(r_idx[:n].cpu(), ref_idx) and bool((r_idx[n:] == -1).all())
        assert torch.equal(r_w[:n].cpu(), ref_w)
        # expert_alignment without num_worst_tokens: the list rounded up
        _, _, _, r_list4, handle4, _ = buf.dispatch((q.to(dev), s.to(dev)), **layout, topk_idx=idx,
                                                    topk_weights=w, expert_alignment=4)
        assert r_list4 == _recv_ref(ins, rank, W, 4)[4]
        # two handles in flight, combined in the other order (handle3's slot was reused by handle4's dispatch
        # of the same set, and handle4 combined first)
        y4 = torch.ones(n, H8, dtype=torch.bfloat16, device=dev) * (rank + 1)
        c4, _, _ = buf.combine(y4, handle4)
        y3 = torch.ones(worst, H8, dtype=torch.bfloat16, device=dev)[:n] * (rank + 10)
        c3, _, _ = buf.combine(y3.contiguous(), handle3)
        report["fp8_combines"] = (c4.cpu(), c3.cpu())
        # a bf16 call of the fp8 calls' hidden size runs on their instances (one set of buffers for both kinds)
        xbs = [torch.cat([ins[r][0]] * (H8 // H), dim=1) for r in range(W)]
        recv_b, _, _, _, handle_b, _ = buf.dispatch(xbs[rank].to(dev), **layout, topk_idx=idx, topk_weights=w)
        assert recv_b.dtype == torch.bfloat16
        assert torch.equal(recv_b.cpu(), torch.cat([xbs[r][rows[r]] for r in range(W)]))
        assert [st.H for st in buf._normal.sets].count(H8) == 1
        buf.combine(recv_b, handle_b)

        # 4. bad input on one rank: ValueError there, CallAborted on the others, nothing sent; the next works
        seen = []
        for bad in ("dispatch", "combine"):
            try:
                if bad == "dispatch":
                    wrong = per_rank + (1 if rank == W - 1 else 0)
                    buf.dispatch(x, num_tokens_per_rank=wrong, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert)
                else:
                    y_bad = y if rank != 0 else y[:, :H - 1].contiguous()
                    buf.combine(y_bad, handle)
                seen.append("ok")
            except (ValueError, CallAborted) as exc:
                seen.append(f"{type(exc).__name__}: {exc}")
        report["refusals"] = seen
        combined5, _, _ = buf.combine(y, handle, topk_weights=wy)  # the handle of call 1 still works
        assert torch.equal(combined5.cpu(), combined.cpu())
        # and the low-latency path on the same Buffer
        recv, count, h, _, _ = buf.low_latency_dispatch(x, idx, max(Ts), E, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv, idx, w, h)
        report["low_latency_ok"] = out.shape == (T, H)
    return report


def _check(got, Ts, W):
    ins = [_inputs(s, 1, Ts[s], W) for s in range(W)]
    ins1 = [(a, b[:, :1], c[:, :1]) for a, b, c in ins]
    for rank in range(W):
        ref1, _ = _combined_ref(ins1, [got[r]["top1"][0] for r in range(W)], None, rank, W)
        assert torch.equal(got[rank]["top1"][1], ref1), rank
        # combine 1: unweighted sum of the rows over ranks (fp32, rank order, one cast), weights summed alike
        ys = [got[r]["combine1"][0] for r in range(W)]
        wys = [got[r]["combine1"][1] for r in range(W)]
        ref_x, ref_w = _combined_ref(ins, ys, wys, rank, W)
        assert torch.equal(got[rank]["combine1"][2], ref_x), rank
        assert torch.equal(got[rank]["combine1"][3], ref_w), rank
        # DeepEP's own check: with y = x everywhere, combined / (ranks reached) is x within bf16 rounding
        bias, combined2 = got[rank]["combine_bias"]
        ref_b, _ = _combined_ref(ins, ys, None, rank, W, biases=(bias,))
        assert torch.equal(combined2, ref_b), rank
        recv2 = [got[r]["combine_two_biases"][0] for r in range(W)]
        _, b0, b1, combined3 = got[rank]["combine_two_biases"]
        ref3, _ = _combined_ref(ins, recv2, None, rank, W, biases=(b0, b1))
        assert torch.equal(combined3, ref3), rank
        in_rank = _layout_ref(ins[rank][1], W, W)[3]
        reached = in_rank.float() @ torch.arange(1, W + 1, dtype=torch.float32)
        c4, c3 = got[rank]["fp8_combines"]
        assert torch.equal(c4.float(), reached[:, None].expand(-1, H8)), rank
        reached10 = in_rank.float() @ torch.arange(10, W + 10, dtype=torch.float32)
        assert torch.equal(c3.float(), reached10[:, None].expand(-1, H8)), rank
        assert got[rank]["low_latency_ok"]
    for i, bad_rank, what in ((0, W - 1, "num_tokens_per_rank"), (1, 0, "x: expected a contiguous bfloat16")):
        for r in range(W):
            seen = got[r]["refusals"][i]
            if r == bad_rank:
                assert seen.startswith(f"ValueError: {what}") and "on every rank" in seen, seen
            else:
                assert seen.startswith("CallAborted") and f"rank(s) {bad_rank}" in seen, seen


@pytest.mark.timeout(600)
@pytest.mark.parametrize("W,node_size", [(2, 2), (2, 1), (4, 2)], ids=["2-one-node", "2-two-nodes", "4-two-nodes"])
def test_normal_mode_layout_dispatch_cached_dispatch_combine_fp8_and_refusals(W, node_size):
    Ts = [24, 17, 0, 9][:W] if W == 4 else [24, 17]  # different T a rank; an empty rank at W = 4
    cfg0 = A2AConfig(max_num_tokens=8, num_experts=W, experts_per_token=1, hidden_dim=16, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=W, node_size=node_size, transport="shm", device=TEST_DEVICE,
                      timeout_s=120) as cl:
        got = cl.run(_normal_rank, Ts)
    _check(got, Ts, W)
