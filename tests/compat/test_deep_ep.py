"""`moe_a2a.compat.Buffer` (DeepEP's low-latency shape) against `reference.py`, between real processes."""
from __future__ import annotations

import pytest
import torch

from moe_a2a import A2AConfig, LocalCluster, reference
from moe_a2a.oracle import combine_problems, default_max_ulps
from moe_a2a.triton_kernels.quant import dequantize_fp8

from ..conftest import TEST_DEVICE
from ..triton_kernels.test_quant import torch_quantize, torch_ue8m0

pytestmark = [pytest.mark.slow]

T_MAX, E, K, H = 4, 8, 3, 64


def _inputs(rank: int, seed: int, T: int, routing: str, hidden: int = H):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T, hidden, generator=g, dtype=torch.float32).to(torch.bfloat16)
    if routing == "skew":  # every token to the same K experts: each gets exactly the capacity (W * T_MAX rows)
        idx = torch.arange(K, dtype=torch.int64).repeat(T, 1)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
        idx[torch.rand(T, K, generator=g, dtype=torch.float32) < 0.2] = -1
    w = torch.rand(T, K, generator=g, dtype=torch.float32)
    return x, idx, w


MODES = [{"use_fp8": False}, {"use_fp8": True}, {"use_fp8": True, "round_scale": True},
         {"use_fp8": True, "round_scale": True, "use_ue8m0": True}]
H_FP8 = 640  # 5 scale blocks: UE8M0 codes fill one int32 and part of a second


def _dequantize(recv_x, H: int) -> torch.Tensor:
    """recv_x (bf16, or fp8 with fp32 / UE8M0 scales) as float32 [L, C, H], as DeepEP's test reads it."""
    if isinstance(recv_x, torch.Tensor):
        return recv_x.float()
    q, s = recv_x
    if s.dtype == torch.int32:  # UE8M0: each code byte shifted into an fp32 exponent field
        # (a copy with unit last stride: `contiguous()` keeps the stride of a last dimension of size 1)
        s = torch.empty_like(s, memory_format=torch.contiguous_format).copy_(s)
        s = (s.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    S = -(-H // 128)
    return q.float() * s[..., :S].repeat_interleave(128, dim=-1)[..., :H]


def _modes_rank(a2a, rank, token_counts, H, buffer_kw=None):
    """One Buffer, four calls: bf16, fp8, fp8 with rounded scales, fp8 with UE8M0 scales, as two pairs of
    micro-batches in flight with their hooks called late, one cumulative statistics tensor. `buffer_kw`: more of
    the Buffer's keywords (`wire=`, `dispatch_weights=`: then the weights go to every dispatch;
    tests/compat/test_deep_ep_wire.py)."""
    from moe_a2a.compat import Buffer

    dev, W = a2a.device, a2a.world_size
    out = []
    stats = torch.zeros(E // W, dtype=torch.int32, device=dev)
    # DeepEP's own construction keywords are taken (and its size hint given back as num_rdma_bytes).
    hint = Buffer.get_low_latency_rdma_size_hint(T_MAX, H, W, E)
    with Buffer(None, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=E // W,
                allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
                enable_shrink=False, transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size,
                **(buffer_kw or {})) as buf:
        for pair in range(2):  # dispatch A, dispatch B, combine A, combine B
            pending = []
            for mb in range(2):
                call = 2 * pair + mb
                T = token_counts[rank][mb]
                x, idx, w = (t.to(dev) for t in _inputs(rank, call, T, "random", H))
                weights = {"topk_weights": w} if (buffer_kw or {}).get("dispatch_weights") else {}
                recv_x, count, handle, event, hook = buf.low_latency_dispatch(
                    x, idx, T_MAX, E, cumulative_local_expert_recv_stats=stats, return_recv_hook=True,
                    **MODES[call], **weights)
                pending.append((idx, w, recv_x, count, handle, hook))
            results = []
            for idx, w, recv_x, count, handle, hook in pending:
                hook()  # the receive half, after other work
                y = (2 * _dequantize(recv_x, H)).to(torch.bfloat16)
                got = {"count": count.clone(), "src_info": handle[0].clone(), "layout_range": handle[1].clone(),
                       "recv": recv_x.clone() if isinstance(recv_x, torch.Tensor) else
                       (recv_x[0].view(torch.uint8).clone(), recv_x[1].clone()),
                       "handle": tuple(handle[2:5])}
                combined, _, chook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
                results.append((got, combined, chook))
            for got, combined, chook in results:
                chook()
                got["combined"] = combined.clone()
                out.append(got)
    return out, stats.clone()


def _routes(ins, rank: int, L: int):
    """Per local expert of `rank`: its rows as (source rank, token), ordered by (source, token, k)."""
    return [[(s, t) for s, (_, idx, _) in enumerate(ins) for t in range(idx.shape[0]) for k in range(idx.shape[1])
             if int(idx[t, k]) == rank * L + l] for l in range(L)]


def _expert_outputs(ins, mode):
    """Per source rank: each token's expert output as every rank computes it, 2 * what arrived
    (dequantised from the torch formula's fp8 bytes and scales)."""
    ys = []
    for x, _, _ in ins:
        if mode.get("use_fp8"):
            xf = dequantize_fp8(*torch_quantize(x, 128, round_scale=mode.get("round_scale", False)), 128)
        else:
            xf = x.float()
        ys.append((2 * xf).to(torch.bfloat16))
    return ys


def _check_combined(combined, ins, mode, node_size=None):
    """Every rank's combined tokens against torch: sum_k w[t, k] * y(t) over the routed k. `node_size`: through
    the relay (`Buffer(wire="relay")`): against `reference.combine_relay`, which sums as the relay does (reduced per
    rank, then per node, rounded on the way)."""
    ys = _expert_outputs(ins, mode)
    if node_size is not None:
        W, H = len(ins), ys[0].shape[1]
        cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H,
                        in_dtype=torch.bfloat16, out_dtype=torch.bfloat16, expert_capacity=T_MAX * W,
                        dispatch_rows="rank", combine_rows="rank", relay=True)
        idxs, ws = [idx for _, idx, _ in ins], [w for _, _, w in ins]
        rows = [ex for _, ex, _ in reference.dispatch(cfg, ys, None, idxs)]  # each expert row: y of its token
        want = reference.combine_relay(cfg, idxs, ws, rows, node_size)
        for r in range(W):
            assert combine_problems(combined[r].cpu(), want[r], default_max_ulps(TEST_DEVICE)) == [], r
        return
    for r, (_, idx, w) in enumerate(ins):
        want = torch.zeros(idx.shape[0], ys[r].shape[1])
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                if int(idx[t, k]) >= 0:
                    want[t] += w[t, k] * ys[r][t].float()
        assert combine_problems(combined[r].cpu(), want.to(torch.bfloat16), default_max_ulps(TEST_DEVICE)) == [], r


def _check_call(got, ins, mode, W: int, H: int, node_size=None):
    """One call of every rank against torch: counts, rows (bf16, or fp8 bytes and scales from the torch
    formula of tests/triton_kernels/test_quant.py), handle[0] and handle[1], the combined tokens (`node_size`:
    through the relay, `_check_combined`)."""
    L = E // W
    use_fp8 = mode.get("use_fp8")
    quant = [torch_quantize(x, 128, round_scale=mode.get("round_scale", False)) for x, _, _ in ins] if use_fp8 else None
    for r in range(W):
        g = got[r]
        routes = _routes(ins, r, L)
        assert g["handle"] == (T_MAX, H, E)
        assert g["count"].tolist() == [len(rows) for rows in routes], (mode, r)
        for l, rows in enumerate(routes):
            n = len(rows)
            assert g["src_info"][l, :n].tolist() == [t for _, t in rows], (mode, r, l)
            begin = 0
            for s in range(W):
                cnt = sum(1 for src, _ in rows if src == s)
                assert int(g["layout_range"][l, s]) == (begin << 32) | cnt, (mode, r, l, s)
                assert all(src == s for src, _ in rows[begin:begin + cnt])  # each source's rows contiguous
                begin += cnt
            for i, (s, t) in enumerate(rows):
                if not use_fp8:
                    assert torch.equal(g["recv"][l, i], ins[s][0][t]), (mode, r, l, i)
                    continue
                q, scale = quant[s]
                assert torch.equal(g["recv"][0][l, i], q[t].view(torch.uint8)), (mode, r, l, i)
                if mode.get("use_ue8m0"):
                    assert torch.equal(g["recv"][1][l, i], torch_ue8m0(scale[t:t + 1])[0]), (mode, r, l, i)
                else:
                    assert torch.equal(g["recv"][1][l, i], scale[t]), (mode, r, l, i)
    _check_combined([g["combined"] for g in got], ins, mode, node_size)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("node_size", [2, 1], ids=["node-local", "remote"])
def test_one_buffer_serves_bf16_fp8_rounded_and_ue8m0_calls_with_deep_ep_handles_and_stats(node_size):
    """Per-call fp8 on one Buffer (no rebuild, no abort), DeepEP's handle layout, cumulative statistics,
    two micro-batches in flight, an empty rank: against torch, node-local and across simulated nodes."""
    W, H = 2, H_FP8
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=64, in_dtype=torch.bfloat16)
    token_counts = [[T_MAX, 0], [T_MAX, T_MAX - 1]]  # an empty rank in one micro-batch
    with LocalCluster(cfg0, world_size=W, node_size=node_size, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        got = cl.run(_modes_rank, token_counts, H)
    stats = torch.zeros(E // W, W, dtype=torch.int32)
    for call, mode in enumerate(MODES):
        pair, mb = divmod(call, 2)
        ins = [_inputs(r, call, token_counts[r][mb], "random", H) for r in range(W)]
        _check_call([got[r][0][call] for r in range(W)], ins, mode, W, H)
        for r in range(W):
            stats[:, r] += got[r][0][call]["count"]
    for r in range(W):
        assert torch.equal(got[r][1], stats[:, r]), (got[r][1], stats[:, r])


def _deep_ep_patterns_rank(a2a, rank, H, buffer_kw=None):
    """What DeepEP's test does beyond the core, with torch's default dtype set to float64 and its default
    device to "meta" (DeepEP's test sets bfloat16 and cuda: nothing of ours may follow them; a tensor made
    on "meta" fails at its first use): a dispatch never combined, one handle combined twice (the second
    time zero-copy, into `out=`), events, the slot of the abandoned dispatch reused,
    clean_low_latency_buffer, then a call after it."""
    from moe_a2a.compat import Buffer, EventOverlap

    def inputs(seed):
        with torch.device("cpu"):
            return (t.to(dev) for t in _inputs(rank, seed, T_MAX, "random", H))

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    try:
        dev, seen = a2a.device, {}
        buf = Buffer(None, transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size,
                     explicitly_destroy=True, **(buffer_kw or {}))
        x0, idx0, _ = inputs(70)
        _, _, _, event, _ = buf.low_latency_dispatch(x0, idx0, T_MAX, E, use_fp8=True, async_finish=True)
        assert isinstance(event, EventOverlap)
        event.current_stream_wait()  # that dispatch is never combined
        for call, mode in ((71, {"use_fp8": False}), (72, {"use_fp8": True, "round_scale": True, "use_ue8m0": True}),
                           (73, {"use_fp8": True})):
            x, idx, w = inputs(call)
            recv_x, count, handle, event, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, async_finish=True, **mode)
            event.current_stream_wait()
            before = recv_x.clone() if not mode["use_fp8"] else recv_x[0].view(torch.uint8).clone()
            y = (2 * _dequantize(recv_x, H)).to(torch.bfloat16)
            out = torch.full((T_MAX, H), 7.0, dtype=torch.bfloat16, device=dev)
            combined, event, _ = buf.low_latency_combine(y, idx, w, handle, async_finish=True, out=out)
            event.current_stream_wait()
            assert combined is out
            results = {"count": count.clone(), "combined": combined.clone()}
            if call == 71:  # DeepEP's test combines its handle twice, the second time from the next buffer
                buffer = buf.get_next_low_latency_combine_buffer(handle)
                assert tuple(buffer.shape) == tuple(y.shape) and buffer.dtype == torch.bfloat16
                buffer[:, :, :] = y
                out2 = torch.empty(T_MAX, H, dtype=torch.bfloat16, device=dev)
                combined2, _, hook = buf.low_latency_combine(torch.empty(0, dtype=torch.bfloat16, device=dev), idx, w,
                                                             handle, zero_copy=True, out=out2, return_recv_hook=True)
                hook()
                results["zero_copy"] = combined2.clone()
                results["recv_kept"] = torch.equal(recv_x, before)
            if call == 72:  # the slot of the abandoned first dispatch: finished with a combine of nothing
                results["recv_kept"] = torch.equal(recv_x[0].view(torch.uint8), before)
                buf.clean_low_latency_buffer(T_MAX, H, E)
                results["cleaned"] = not bool(count.any()) and not bool(recv_x[0].view(torch.uint8).any()) \
                    and not bool(handle[1].any())
            seen[call] = results
        buf.destroy()
        return seen
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(default)


@pytest.mark.timeout(300)
def test_deep_ep_test_patterns_abandoned_dispatch_double_combine_zero_copy_clean_and_torch_defaults():
    W, H = 2, H_FP8
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=64, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=W, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        got = cl.run(_deep_ep_patterns_rank, H)
    _check_patterns(got, W, H)


def _check_patterns(got, W: int, H: int, node_size=None) -> None:
    """`_deep_ep_patterns_rank`'s results of every rank against torch (`node_size`: through the relay)."""
    for call, mode in ((71, {"use_fp8": False}), (72, {"use_fp8": True, "round_scale": True, "use_ue8m0": True}),
                       (73, {"use_fp8": True})):
        ins = [_inputs(r, call, T_MAX, "random", H) for r in range(W)]
        for r in range(W):
            assert got[r][call]["count"].tolist() == [len(rows) for rows in _routes(ins, r, E // W)], (call, r)
        _check_combined([got[r][call]["combined"] for r in range(W)], ins, mode, node_size)
        for r in range(W):
            if call == 71:
                assert got[r][call]["recv_kept"]
                assert torch.equal(got[r][call]["zero_copy"], got[r][call]["combined"]), r
            if call == 72:
                assert got[r][call]["recv_kept"] and got[r][call]["cleaned"], r


def _graph_rank(a2a, rank, seeds):
    """The facade captured in one CUDA graph (dispatch, a toy expert, combine), replayed with new inputs."""
    from moe_a2a.compat import Buffer

    dev = a2a.device
    with Buffer(transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size, device=dev) as buf:
        x, idx, w = (t.to(dev) for t in _inputs(rank, 1, T_MAX, "random"))

        def step():
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
            combined, _, _ = buf.low_latency_combine((2 * recv_x.float()).to(torch.bfloat16), idx, w, handle)
            return recv_x, count, combined

        step(), step()  # eager warm-up: both alternating instances built, every kernel compiled
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv_x, count, combined = step()
        out = []
        for seed in seeds:
            for t, new in zip((x, idx, w), _inputs(rank, seed, T_MAX, "random")):
                t.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            out.append({"count": count.cpu(), "recv": recv_x.cpu(), "combined": combined.cpu()})
        buf.check()
    return out


@pytest.mark.timeout(300)
@pytest.mark.gpu(devices=2, reason="a CUDA graph of the facade needs one GPU per rank")
def test_facade_in_a_cuda_graph_matches_reference_on_every_replay():
    W, seeds = 2, [3, 4, 5]
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=W, node_size=2, transport="shm", device="cuda", timeout_s=60,
                      gpu_wait="kernel") as cl:
        got = cl.run(_graph_rank, seeds)
    cap = T_MAX * W
    cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                    expert_capacity=cap)
    for call, seed in enumerate(seeds):
        ins = [_inputs(r, seed, T_MAX, "random") for r in range(W)]
        want = reference.dispatch(cfg, [x for x, _, _ in ins], None, [i for _, i, _ in ins])
        for r in range(W):
            n_ref, x_ref, _ = want[r]
            assert torch.equal(got[r][call]["count"], n_ref), (call, r)
            for l, n in enumerate(n_ref.tolist()):
                assert torch.equal(got[r][call]["recv"][l, :n], x_ref[l * cap: l * cap + n]), (call, r, l)
        outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins],
                                 [(2 * x_ref.float()).to(torch.bfloat16) for _, x_ref, _ in want])
        for r in range(W):
            assert combine_problems(got[r][call]["combined"].cpu(), outs[r], default_max_ulps("cuda")) == [], (call, r)


def _bad_input_in_a_later_call(a2a, rank):
    """Call 0 good, call 1 bad on rank 1 (x in float32), call 2 good: what each rank saw."""
    from moe_a2a.all_to_all import CallAborted
    from moe_a2a.compat import Buffer

    dev, seen = a2a.device, []
    with Buffer(transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size) as buf:
        for call in range(3):
            x, idx, w = (t.to(dev) for t in _inputs(rank, 40 + call, T_MAX, "random"))
            if call == 1 and rank == 1:
                x = x.float()
            try:
                recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
                combined, _, _ = buf.low_latency_combine((2 * recv_x.float()).to(torch.bfloat16), idx, w, handle)
                buf.check()
                seen.append({"count": count.cpu().clone(), "recv": recv_x.cpu().clone(), "combined": combined.cpu().clone()})
            except (ValueError, CallAborted) as exc:
                seen.append(f"{type(exc).__name__}: {exc}")
    return seen


@pytest.mark.timeout(300)
def test_bad_input_to_the_facade_aborts_that_call_everywhere_and_the_next_works():
    got = _on_two_ranks(_bad_input_in_a_later_call)
    assert got[1][1].startswith("ValueError: x: expected a [T, H] bfloat16") and "aborted this call" in got[1][1]
    assert got[0][1].startswith("CallAborted") and "aborted by rank 1" in got[0][1], got[0][1]
    cap = T_MAX * 2
    cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                    expert_capacity=cap)
    for call in (0, 2):
        ins = [_inputs(r, 40 + call, T_MAX, "random") for r in range(2)]
        want = reference.dispatch(cfg, [x for x, _, _ in ins], None, [i for _, i, _ in ins])
        outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins],
                                 [(2 * x_ref.float()).to(torch.bfloat16) for _, x_ref, _ in want])
        for r in range(2):
            assert torch.equal(got[r][call]["count"], want[r][0]), (call, r)
            assert combine_problems(got[r][call]["combined"].cpu(), outs[r], default_max_ulps("cuda")) == [], (call, r)


def _on_two_ranks(fn) -> list:
    """`fn(a2a, rank)`'s results on two ranks of one node (the instances' config: the facade builds its own)."""
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=2, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        return cl.run(fn)


def _attempt(fn, buf, dev: torch.device, seen: list, also=()) -> None:
    """Run one call that may be refused: "ok", or the error's type and message, into `seen` (ValueError,
    CallAborted and the types in `also`). On a GPU a peer's abort is recorded in its kernels and reported at
    check()."""
    from moe_a2a.all_to_all import CallAborted

    try:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            buf.check()
        seen.append("ok")
    except (ValueError, CallAborted, *also) as exc:
        seen.append(f"{type(exc).__name__}: {exc}")


def _bad_calls(a2a, rank):
    """Refusals: the first call's on every rank (nothing built), then one rank's bad statistics tensor
    and one rank's x on another device (dispatch), use_logfmt, zero_copy with nothing written (combine),
    a stale handle, None and DeepEP's plain tuple as the handle on one rank, and None with two calls in
    flight (the older one aborted, the newer one combined); a good call after each."""
    from moe_a2a.compat import Buffer

    dev, seen = a2a.device, []
    x, idx, w = (t.to(dev) for t in _inputs(rank, 80, T_MAX, "random"))

    def zeros():  # expert outputs of a call whose result is not checked
        return torch.zeros(E // 2, 2 * T_MAX, H, dtype=torch.bfloat16, device=dev)

    def attempt(fn):
        _attempt(fn, buf, dev, seen)

    def good():
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
        combined, _, _ = buf.low_latency_combine((2 * recv_x.float()).to(torch.bfloat16), idx, w, handle)
        buf.check()
        seen.append(combined.clone())

    with Buffer(transport="shm", timeout_s=10.0, node_group=a2a.layout.node_size) as buf:
        attempt(lambda: buf.low_latency_dispatch(x, idx, T_MAX, E, bogus=1))
        attempt(lambda: buf.low_latency_dispatch(x, idx, T_MAX, E, dispatch_wait_recv_cost_stats=torch.zeros(
            2, 2, dtype=torch.int64, device=dev)))
        attempt(lambda: buf.low_latency_dispatch(x.float(), idx, T_MAX, E))
        good()  # builds
        stats = torch.zeros(E // 2, dtype=torch.float32 if rank == 1 else torch.int32, device=dev)
        attempt(lambda: buf.low_latency_dispatch(x, idx, T_MAX, E, cumulative_local_expert_recv_stats=stats))
        good()
        attempt(lambda: buf.low_latency_dispatch(x.to("meta") if rank == 0 else x, idx, T_MAX, E))
        good()
        for bad in ({"use_logfmt": rank == 1}, {"zero_copy": rank == 0}):
            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
            attempt(lambda: buf.low_latency_combine(zeros(), idx, w, handle, **bad))
            good()
        _, _, stale, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
        buf.low_latency_combine(zeros(), idx, w, stale)
        good()
        # A bad handle on one rank (stale, None, DeepEP's plain tuple) aborts its peers' combine (issue 31).
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)  # stale's slot, reused
        attempt(lambda: buf.low_latency_combine(zeros(), idx, w, stale if rank == 1 else handle))
        good()
        for bad in (None, "tuple"):
            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
            given = handle if rank == 1 else None if bad is None else tuple(handle)[:5]
            attempt(lambda: buf.low_latency_combine(zeros(), idx, w, given))
            good()
        # Two calls in flight: a bad handle aborts the older one (combined first); the newer one still combines.
        _, _, first, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
        recv_x, _, second, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
        attempt(lambda: buf.low_latency_combine(zeros(), idx, w, None if rank == 1 else first))
        combined, _, _ = buf.low_latency_combine((2 * recv_x.float()).to(torch.bfloat16), idx, w, second)
        seen.append(combined.clone())
        good()
    return seen


@pytest.mark.timeout(300)
def test_facade_refusals_abort_the_call_on_every_rank_and_the_next_works():
    got = _on_two_ranks(_bad_calls)
    for r in range(2):
        seen = got[r]
        assert len(seen) == 22, seen
        assert seen[0].startswith("ValueError: unexpected arguments ['bogus']"), seen[0]
        assert seen[1].startswith("ValueError: dispatch_wait_recv_cost_stats: expected an int64 [2]"), seen[1]
        assert seen[2].startswith("ValueError: x: expected a [T, H] bfloat16"), seen[2]
        assert all("the Buffer's first, on every rank" in e for e in seen[:3]), seen[:3]
    assert "is over" in got[1][13], got[1][13]
    # One rank's refusal aborts the call on every rank: it raises ValueError, its peer CallAborted.
    for i, bad_rank, what in ((4, 1, "cumulative_local_expert_recv_stats: expected an int32"),
                              (6, 0, "x: expected device"), (8, 1, "use_logfmt=True"),
                              (10, 0, "zero_copy=True: nothing was written"), (13, 1, "handle: call"),
                              (15, 0, "handle: expected the handle returned by low_latency_dispatch, got None"),
                              (17, 0, "handle: expected the handle returned by low_latency_dispatch, got a tuple of 5"),
                              (19, 1, "handle: expected the handle returned by low_latency_dispatch, got None")):
        assert got[bad_rank][i].startswith(f"ValueError: {what}") and "aborted this call" in got[bad_rank][i], \
            got[bad_rank][i]
        assert got[1 - bad_rank][i].startswith("CallAborted") and f"rank {bad_rank}" in got[1 - bad_rank][i], \
            got[1 - bad_rank][i]
    cap = T_MAX * 2
    cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                    expert_capacity=cap)
    ins = [_inputs(r, 80, T_MAX, "random") for r in range(2)]
    want = reference.dispatch(cfg, [x for x, _, _ in ins], None, [i for _, i, _ in ins])
    outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins],
                             [(2 * x_ref.float()).to(torch.bfloat16) for _, x_ref, _ in want])
    for r in range(2):
        for i in (3, 5, 7, 9, 11, 12, 14, 16, 18, 20, 21):
            assert combine_problems(got[r][i].cpu(), outs[r], default_max_ulps(TEST_DEVICE)) == [], (i, r)


def _steady_state_calls(a2a, rank):
    """Good calls, then calls whose arguments differ from the last good call's only in what its plan was derived
    from (`LowLatencyMode.dispatch` keeps the plan of the last accepted call's arguments for the next call like
    it): on rank 1, x of the same shape with strides (1, T), top-k beyond the built one, and
    num_max_dispatch_tokens_per_rank a float, each refused and aborting the call on every rank, a good call
    after each; then fewer routes (padded) twice against their -1 padding, and use_fp8 given as 1 between two
    use_fp8=True calls."""
    from moe_a2a.compat import Buffer

    dev, seen = a2a.device, []
    x, idx, w = (t.to(dev) for t in _inputs(rank, 90, T_MAX, "random"))

    def attempt(fn):
        _attempt(fn, buf, dev, seen)

    def good(idx=idx, w=w, use_fp8=False):
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=use_fp8)
        y = _dequantize(recv_x, H) if use_fp8 else recv_x.float()
        combined, _, _ = buf.low_latency_combine((2 * y).to(torch.bfloat16), idx, w, handle)
        buf.check()
        seen.append(combined.clone())

    with Buffer(transport="shm", timeout_s=10.0, node_group=a2a.layout.node_size) as buf:
        good()
        good()
        strided = x.t().contiguous().t() if rank == 1 else x  # x's shape, strides (1, T)
        attempt(lambda: buf.low_latency_dispatch(strided, idx, T_MAX, E, use_fp8=False))
        good()
        wide = torch.cat([idx, idx[:, :1]], dim=1) if rank == 1 else idx
        attempt(lambda: buf.low_latency_dispatch(x, wide, T_MAX, E, use_fp8=False))
        good()
        attempt(lambda: buf.low_latency_dispatch(x, idx, float(T_MAX) if rank == 1 else T_MAX, E, use_fp8=False))
        good()
        fewer, fewer_w = idx[:, : K - 1].contiguous(), w[:, : K - 1].contiguous()
        good(fewer, fewer_w)
        good(fewer, fewer_w)
        good(torch.cat([fewer, torch.full_like(idx[:, :1], -1)], dim=1), torch.cat([fewer_w, w[:, :1]], dim=1))
        good(use_fp8=True)
        good(use_fp8=1)
        good(use_fp8=True)
    return seen


@pytest.mark.timeout(300)
def test_calls_differing_from_the_last_good_ones_are_checked_again():
    got = _on_two_ranks(_steady_state_calls)
    for i, what in ((2, "x: expected last stride 1, got strides (1, 4)"), (4, f"topk_idx: top-k {K + 1} > {K}"),
                    (6, f"num_max_dispatch_tokens_per_rank: expected an int, got {float(T_MAX)}")):
        assert got[1][i].startswith(f"ValueError: {what}") and "aborted this call" in got[1][i], got[1][i]
        assert got[0][i].startswith("CallAborted") and "rank 1" in got[0][i], got[0][i]
    for r in range(2):
        seen = got[r]
        assert len(seen) == 14, seen
        assert all(torch.equal(seen[0], seen[i]) for i in (1, 3, 5, 7)), r
        assert torch.equal(seen[8], seen[10]) and torch.equal(seen[9], seen[10]), r  # padded as with -1
        assert torch.equal(seen[11], seen[12]) and torch.equal(seen[11], seen[13]), r
    _check_combined([got[r][0] for r in range(2)], [_inputs(r, 90, T_MAX, "random") for r in range(2)], {})


# ---- the first call is collective; a closed Buffer says so ---------------------------------------
def _first_calls_rejected_then_good(a2a, rank):
    """Calls 0-3 are refused (call 0: float32 x on rank 1 only; call 1: different
    num_max_dispatch_tokens_per_rank; call 2: different hidden; call 3: use_fp8 on rank 0 only), then three
    good calls; then the Buffer is closed and used again."""
    import time

    from moe_a2a.all_to_all import CallAborted
    from moe_a2a.compat import Buffer

    dev, seen = a2a.device, []
    buf = Buffer(transport=a2a.transport, timeout_s=20.0, node_group=a2a.layout.node_size)
    try:
        for call in range(7):
            x, idx, w = (t.to(dev) for t in _inputs(rank, 60 + call, T_MAX, "random"))
            num_max = T_MAX
            if call == 0 and rank == 1:
                x = x.float()
            if call == 1 and rank == 0:
                num_max = 2 * T_MAX
            if call == 2 and rank == 1:
                x = torch.cat([x, x], dim=1)
            t0 = time.monotonic()
            try:
                recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, num_max, E,
                                                                       use_fp8=call == 3 and rank == 0)
                combined, _, _ = buf.low_latency_combine((2 * recv_x.float()).to(torch.bfloat16), idx, w, handle)
                buf.check()
                seen.append({"count": count.cpu().clone(), "combined": combined.cpu().clone()})
            except (ValueError, CallAborted) as exc:
                seen.append({"error": f"{type(exc).__name__}: {exc}", "built": bool(buf._slots),
                             "seconds": time.monotonic() - t0})
    finally:
        buf.destroy()
    after = []
    x, idx, w = (t.to(dev) for t in _inputs(rank, 60, T_MAX, "random"))
    for call in (lambda: buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False),
                 lambda: buf.low_latency_combine(torch.zeros(E // 2, 2 * T_MAX, H, dtype=torch.bfloat16), idx, w,
                                                 None)):
        try:
            call()
            after.append("no error")
        except Exception as exc:  # noqa: BLE001 - the type is checked
            after.append(f"{type(exc).__name__}: {exc}")
    buf.close()  # idempotent
    return seen, after


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport,node_size", [("shm", 2), ("tcp", 1)], ids=["node-local-shm", "remote-tcp"])
def test_a_rejected_first_call_aborts_on_every_rank_and_call_numbering_never_drifts(transport, node_size):
    W = 2
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=W, node_size=node_size, transport=transport, device=TEST_DEVICE,
                      timeout_s=60) as cl:
        got = cl.run(_first_calls_rejected_then_good)
    seen = [g[0] for g in got]
    # Call 0: rank 1 rejects its input; every rank raises at once, nothing is built.
    assert seen[1][0]["error"].startswith("ValueError: x: expected a [T, H] bfloat16") and \
        "aborted this call, the Buffer's first, on every rank" in seen[1][0]["error"], seen[1][0]
    assert seen[0][0]["error"].startswith("CallAborted: rank 0: call 0 of this Buffer") and \
        "aborted by rank 1" in seen[0][0]["error"] and "x: expected" in seen[0][0]["error"], seen[0][0]
    # Calls 1 and 2: the ranks' sizes differ: ValueError naming them on every rank.
    for r in range(W):
        assert seen[r][1]["error"].startswith(f"ValueError: rank {r}: the first low_latency_dispatch sizes"), seen[r][1]
        assert f"num_max_dispatch_tokens_per_rank: {2 * T_MAX} on rank 0; {T_MAX} on rank 1" in seen[r][1]["error"]
        assert f"hidden (x.shape[1]): {H} on rank 0; {2 * H} on rank 1" in seen[r][2]["error"], seen[r][2]
        # Call 3: use_fp8 differs (an fp8 first call builds the fp8 buffers too): ValueError naming it everywhere.
        assert seen[r][3]["error"].startswith(f"ValueError: rank {r}: the first low_latency_dispatch must get the "
                                              f"same use_fp8") and "use_fp8: True on rank 0; False on rank 1" \
            in seen[r][3]["error"], seen[r][3]
        assert all(not seen[r][c]["built"] and seen[r][c]["seconds"] < 5 for c in range(4)), seen[r][:4]
    # Calls 4-6: exact on every rank (a drift would pair rank 0's call with rank 1's next one).
    cap = T_MAX * W
    cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                    expert_capacity=cap)
    for call in (4, 5, 6):
        ins = [_inputs(r, 60 + call, T_MAX, "random") for r in range(W)]
        want = reference.dispatch(cfg, [x for x, _, _ in ins], None, [i for _, i, _ in ins])
        outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins],
                                 [(2 * x_ref.float()).to(torch.bfloat16) for _, x_ref, _ in want])
        for r in range(W):
            assert "error" not in seen[r][call], seen[r][call]
            assert torch.equal(seen[r][call]["count"], want[r][0]), (call, r)
            assert combine_problems(seen[r][call]["combined"].cpu(), outs[r],
                                    default_max_ulps(TEST_DEVICE)) == [], (call, r)
    # A closed Buffer: a clear error, not an IndexError.
    for r in range(W):
        assert len(got[r][1]) == 2 and all(a.startswith("ValueError: this Buffer is closed") for a in got[r][1]), got[r][1]


def test_deep_ep_module_as_deep_ep_names_size_hint_handle_and_event():
    """`import deep_ep` resolves to the facade after the documented line, with what DeepEP's low-latency
    test and engines touch at module level; the handle indexes as DeepEP's; events wait or do nothing."""
    import importlib
    import sys

    import moe_a2a.compat.deep_ep as m
    from moe_a2a.compat.deep_ep import Handle, _config

    saved = sys.modules.get("deep_ep")
    sys.modules["deep_ep"] = m  # docs/compat.md, the one-line alias
    try:
        deep_ep = importlib.import_module("deep_ep")
        assert deep_ep is m
        for name in ("Buffer", "EventOverlap", "Config", "topk_idx_t"):
            assert hasattr(deep_ep, name), name
        assert deep_ep.topk_idx_t is torch.int64
        for method in ("low_latency_dispatch", "low_latency_combine", "get_next_low_latency_combine_buffer",
                       "clean_low_latency_buffer", "destroy", "get_low_latency_rdma_size_hint"):
            assert callable(getattr(deep_ep.Buffer, method)), method
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 256)
    finally:
        if saved is None:
            sys.modules.pop("deep_ep", None)
        else:
            sys.modules["deep_ep"] = saved
    # The size hint: the two bf16 instances and the two fp8 ones (rows of fp8 bytes and scales), top-k 8.
    lay = _config(128, 256, 8, 7168, 2).layout(2)
    lay8 = _config(128, 256, 8, 7168, 2, fp8=True).layout(2)
    assert hint == sum(2 * (y.send_bytes + y.recv_bytes + y.segment_bytes(False)) for y in (lay, lay8)) > 0
    assert lay.dispatch_stride_bytes == 2 * 7168 + 16  # a bf16 row and the token-index column
    assert lay8.dispatch_stride_bytes == 7168 + 224 + 16  # fp8 bytes, fp32 scales, the token-index column
    src, ranges = torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int64)
    h = Handle(src, ranges, 4, 64, 8, 0, 1, 3)
    assert h[0] is src and h[1] is ranges and tuple(h[2:5]) == (4, 64, 8) and h.src_info is src
    assert "slot=0" in repr(h)
    event = m.EventOverlap()
    event.current_stream_wait()  # no event (CPU, or async_finish=False): nothing to wait for
    with event:
        pass
    with pytest.raises(ValueError, match="torch.distributed"):  # refused before anything is built
        m.Buffer(None, enable_shrink=True)


def test_profiler_names_one_dispatch_and_one_combine_symbol():
    """DeepEP's `bench_kineto(kernel_names=("dispatch", "combine"))` allows at most one profiler row per name
    and, with receive hooks, splits the trace events holding "::dispatch" into send and receive: of all our
    kernels' compiled names, the pack and unpack share the one holding "dispatch" (`moe_a2a::dispatch()`
    demangled), the combine pack and reduce the one holding "combine"."""
    import importlib
    import pkgutil

    import moe_a2a.triton_kernels as tk
    from moe_a2a.triton_kernels import _launch

    compiled: dict[str, set] = {}
    for mod in pkgutil.iter_modules(tk.__path__):
        m = importlib.import_module(f"moe_a2a.triton_kernels.{mod.name}")
        for obj in vars(m).values():
            fn = getattr(obj, "fn", None)
            if callable(fn) and getattr(fn, "__name__", "").endswith("_kernel"):
                symbol = obj.repr if hasattr(obj, "repr") else obj.kwargs.get("repr")  # JIT / interpreter
                name = symbol(None) if symbol else fn.__name__
                # Triton compiles a kernel under the last dotted part of that name (no module path).
                compiled.setdefault(name.rsplit(".", 1)[-1], set()).add(fn.__name__)
    names = sorted(compiled)
    assert [n for n in names if "dispatch" in n] == [_launch.DISPATCH_SYMBOL], names
    assert [n for n in names if "combine" in n] == [_launch.COMBINE_SYMBOL], names
    # (Other kernels of the same halves share them: per-rank rows' expand and reduces, `rank_rows.py`.)
    assert {"_pack_tokens_by_expert_kernel", "_unpack_tokens_by_expert_kernel"} <= compiled[_launch.DISPATCH_SYMBOL]
    assert {"_pack_combine_by_source_kernel", "_reduce_combined_tokens_kernel"} <= compiled[_launch.COMBINE_SYMBOL]
    # What the profiler shows: the symbols demangle to C++ names holding "::dispatch" / "::combine".
    import shutil
    import subprocess

    assert shutil.which("c++filt"), "binutils' c++filt (installed with gcc) is missing: the demangling is unchecked"
    out = subprocess.run(["c++filt", _launch.DISPATCH_SYMBOL, _launch.COMBINE_SYMBOL], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["moe_a2a::dispatch()", "moe_a2a::combine()"], out
