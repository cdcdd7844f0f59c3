"""The DeepEP facade (issue 33, 3): fp8 scales in DeepEP's layout, calls of other sizes within the Buffer's
bounds, and `Buffer.warm_up`, between real processes.

DeepEP's layout is from its source (commit dd758caf451848bd150e1046af3d0a73e5fff38d, DeepEP 2.1.0):
`csrc/legacy/buffer.hpp`, `low_latency_dispatch`, allocates the scales as `torch::empty({L, S, C})` (fp32,
S = hidden / 128; int32 with UE8M0, S = hidden / 512) and returns `torch::transpose(scales, 1, 2)`, asserting
C % 4 == 0 ("TMA requires the number of tokens to be multiple of 4"); its receive kernel
(`csrc/kernels/legacy/internode_ll.cu`) writes scale s of token t of local expert l at `l * C * S + s * C + t`.
"""
from __future__ import annotations

import pytest
import torch

from moe_a2a import A2AConfig, LocalCluster, reference
from moe_a2a.oracle import combine_problems, default_max_ulps

from ..conftest import TEST_DEVICE
from ..triton_kernels.test_quant import torch_quantize, torch_ue8m0
from .test_deep_ep import E, K, MODES, T_MAX, _check_call, _dequantize, _inputs, _routes

pytestmark = [pytest.mark.slow]

W, H = 2, 640  # 5 fp32 scales a row, 2 int32 words of UE8M0 codes


def _layout(scales: torch.Tensor) -> dict:
    """What DeepGEMM and DeepEP's callers rely on of the scales tensor."""
    return {"shape": tuple(scales.shape), "stride": scales.stride(), "dtype": scales.dtype,
            "aligned": scales.data_ptr() % 16 == 0}


def _record(recv_x, count, handle, combined) -> dict:
    """One call's results on the CPU (`_check_call`'s keys) and, for fp8, the scales' layout."""
    got = {"count": count.cpu().clone(), "src_info": handle[0].cpu().clone(),
           "layout_range": handle[1].cpu().clone(), "handle": tuple(handle[2:5]), "combined": combined.cpu().clone()}
    if isinstance(recv_x, torch.Tensor):
        got["recv"] = recv_x.cpu().clone()
    else:
        got["recv"] = (recv_x[0].view(torch.uint8).cpu().clone(), recv_x[1].cpu().clone())
        got["layout"] = _layout(recv_x[1])
    return got


def _call(buf, x, idx, w, num_max, num_experts, **mode):
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, num_max, num_experts, **mode)
    y = (2 * _dequantize(recv_x, x.shape[1])).to(torch.bfloat16)
    combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
    buf.check()
    return _record(recv_x, count, handle, combined)


def _sizes_rank(a2a, rank):
    """warm_up (refused when the ranks' arguments differ, then built), the four modes with no build left
    (a build would raise), fewer top-k, a smaller num_max_dispatch_tokens_per_rank (C % 4 != 0) and a
    smaller hidden (sets of their own), refusals (more top-k, a set over num_rdma_bytes), clean."""
    from moe_a2a.all_to_all import CallAborted
    from moe_a2a.compat import Buffer
    from moe_a2a.compat import _low_latency_sets as m  # the builds look up all_gather and AllToAll there

    dev, seen = a2a.device, {}

    def attempt(name, fn):
        try:
            seen[name] = fn()
        except (ValueError, CallAborted) as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"

    hint = Buffer.get_low_latency_rdma_size_hint(T_MAX, H, W, E)
    with Buffer(None, num_rdma_bytes=hint, explicitly_destroy=True, transport="shm", timeout_s=20.0,
                node_group=a2a.layout.node_size, device=dev) as buf:
        attempt("warm_up_differs", lambda: buf.warm_up(T_MAX, H, E, top_k=8 if rank == 0 else 4))
        attempt("warm_up_bad", lambda: buf.warm_up(T_MAX, H if rank == 0 else H + 1, E))
        seen["built_after_refusals"] = len(buf._slots)
        buf.warm_up(T_MAX, H, E, use_fp8=True, zero_copy=True)
        buf.warm_up(T_MAX, H, E, use_fp8=True, zero_copy=True)  # idempotent
        seen["built"] = [(s.key, sorted(s.instances), s.fp8_outputs, s.combine_buf is not None) for s in buf._slots]
        # Every call of the warmed-up sizes now builds nothing: a host collective or a new instance would raise.
        real = (m.all_gather, m.AllToAll)

        def refuse(*args, **kwargs):
            raise AssertionError("a call after warm_up built something")
        m.all_gather, m.AllToAll = refuse, refuse
        try:
            for call, mode in enumerate(MODES):
                x, idx, w = (t.to(dev) for t in _inputs(rank, 10 + call, T_MAX, "random", H))
                seen[f"mode{call}"] = _call(buf, x, idx, w, T_MAX, E, **mode)
            # Fewer routes per token than built for (top-k 2 < 8), fewer tokens: padded, no build.
            x, idx, w = (t.to(dev) for t in _inputs(rank, 20, T_MAX - 1, "random", H))
            seen["topk2"] = _call(buf, x, idx[:, :2].contiguous(), w[:, :2].contiguous(), T_MAX, E, use_fp8=False)
            seen["slots_after_calls"] = len(buf._slots)
        finally:
            m.all_gather, m.AllToAll = real
        # A smaller num_max_dispatch_tokens_per_rank (C = 3 * 2 = 6, not a multiple of 4): a set of its own.
        x, idx, w = (t.to(dev) for t in _inputs(rank, 30, 3, "random", H))
        seen["num_max3"] = _call(buf, x, idx, w, 3, E, use_fp8=True, round_scale=True, use_ue8m0=True)
        seen["num_max3_fp32"] = _call(buf, x, idx, w, 3, E, use_fp8=True)
        # A smaller hidden: a set of its own.
        x, idx, w = (t.to(dev) for t in _inputs(rank, 31, T_MAX, "random", H // 2))
        seen["hidden_half"] = _call(buf, x, idx, w, T_MAX, E, use_fp8=False)
        seen["slots_after_new_sizes"] = len(buf._slots)
        # Refused on every rank: more top-k than built for (one rank), a set over num_rdma_bytes (every rank).
        x, idx, w = (t.to(dev) for t in _inputs(rank, 32, T_MAX, "random", H))
        wide = torch.cat([idx, torch.full((T_MAX, 9 - K), -1, dtype=idx.dtype, device=dev)], dim=1)
        attempt("topk9", lambda: _call(buf, x, wide if rank == 1 else idx, torch.ones(T_MAX, wide.shape[1] if rank == 1
                                                                                     else K, device=dev), T_MAX, E,
                                       use_fp8=False))
        big = torch.cat([x, x, x, x], dim=1)  # hidden 4H: its set would take more than num_rdma_bytes
        attempt("over_budget", lambda: _call(buf, big, idx, w, T_MAX, E, use_fp8=False))
        seen["after_refusals"] = _call(buf, x, idx, w, T_MAX, E, use_fp8=False)
        seen["slots_at_end"] = len(buf._slots)
        buf.clean_low_latency_buffer(T_MAX, H, E)
        seen["clean_zeroed"] = all(not s.recv_x[True, False][1].any() and not s.num.any()
                                   for s in buf._slots[:2])
        attempt("clean_unknown", lambda: buf.clean_low_latency_buffer(5, H, E))
        seen["after_clean"] = _call(buf, x, idx, w, T_MAX, E, use_fp8=True)
    return seen


def _check_scales(got, ins, mode, num_max: int, hidden: int):
    """fp8 bytes and scales of one call against the torch formula, for any num_max (rows below the counts)."""
    L = E // W
    for r in range(W):
        routes = _routes(ins, r, L)
        assert got[r]["handle"] == (num_max, hidden, E)
        assert got[r]["count"].tolist() == [len(rows) for rows in routes]
        quant = [torch_quantize(x, 128, round_scale=mode.get("round_scale", False)) for x, _, _ in ins]
        for l, rows in enumerate(routes):
            for i, (s, t) in enumerate(rows):
                q, scale = quant[s]
                assert torch.equal(got[r]["recv"][0][l, i], q[t].view(torch.uint8)), (r, l, i)
                want = torch_ue8m0(scale[t:t + 1])[0] if mode.get("use_ue8m0") else scale[t]
                assert torch.equal(got[r]["recv"][1][l, i], want), (r, l, i)


def _deep_ep_layout(num_max: int, hidden: int, ue8m0: bool) -> dict:
    """DeepEP's scales: `torch::empty({L, S, C})` transposed (C padded to a multiple of 4 where DeepEP asserts
    it is one), from 16-byte aligned memory."""
    L, C = E // W, num_max * W
    S = -(-hidden // 512) if ue8m0 else -(-hidden // 128)
    C4 = -(-C // 4) * 4
    return {"shape": (L, C, S), "stride": (S * C4, 1, C4), "dtype": torch.int32 if ue8m0 else torch.float32,
            "aligned": True}


@pytest.mark.timeout(900)
def test_scales_in_deep_ep_layout_other_sizes_and_warm_up():
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=64, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=W, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        got = cl.run(_sizes_rank)
    for r in range(W):
        g = got[r]
        # warm_up: arguments that differ, or are bad on one rank, refused on every rank before anything is built.
        assert g["warm_up_differs"].startswith(f"ValueError: rank {r}: warm_up must get the same arguments") \
            and "top_k: 8 on rank 0; 4 on rank 1" in g["warm_up_differs"], g["warm_up_differs"]
        assert g["warm_up_bad"].startswith("ValueError: warm_up: use_fp8=True needs an even hidden") \
            and "rank 1's arguments" in g["warm_up_bad"], g["warm_up_bad"]
        assert g["built_after_refusals"] == 0
        # Both slots: bf16 and fp8 instances, built for top-k 8 (the hint's), scale outputs, zero-copy buffers.
        assert g["built"] == [((T_MAX, E, 8, H), [False, True], True, True)] * 2, g["built"]
        assert g["slots_after_calls"] == 2
        assert g["slots_after_new_sizes"] == 2 + 2 + 2 and g["slots_at_end"] == 6
    # Every mode exact against torch (bf16 rows, fp8 bytes, scales, handles, combined), the scales in DeepEP's
    # layout: C = 8, a multiple of 4: DeepEP's strides exactly.
    for call, mode in enumerate(MODES):
        ins = [_inputs(r, 10 + call, T_MAX, "random", H) for r in range(W)]
        _check_call([got[r][f"mode{call}"] for r in range(W)], ins, mode, W, H)
        if mode.get("use_fp8"):
            for r in range(W):
                assert got[r][f"mode{call}"]["layout"] == _deep_ep_layout(T_MAX, H, mode.get("use_ue8m0", False))
    assert _deep_ep_layout(T_MAX, H, False)["stride"] == torch.empty(E // W, 5, T_MAX * W).transpose(1, 2).stride()
    # num_max 3: C = 6, padded to 8 in the scale stride (16-byte aligned columns); values exact below the counts.
    ins = [_inputs(r, 30, 3, "random", H) for r in range(W)]
    for name, mode in (("num_max3", MODES[3]), ("num_max3_fp32", MODES[1])):
        _check_scales([got[r][name] for r in range(W)], ins, mode, 3, H)
        for r in range(W):
            assert got[r][name]["layout"] == _deep_ep_layout(3, H, mode.get("use_ue8m0", False)), got[r][name]
            assert tuple(got[r][name]["recv"][0].shape) == (E // W, 6, H)
    # Fewer top-k and another hidden: exact against the reference.
    for name, T, hidden, k in (("topk2", T_MAX - 1, H, 2), ("hidden_half", T_MAX, H // 2, K),
                               ("after_refusals", T_MAX, H, K)):
        seed = {"topk2": 20, "hidden_half": 31, "after_refusals": 32}[name]
        ins = [_inputs(r, seed, T, "random", hidden) for r in range(W)]
        ins = [(x, idx[:, :k].contiguous(), w[:, :k].contiguous()) for x, idx, w in ins]
        cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=k, hidden_dim=hidden,
                        in_dtype=torch.bfloat16, expert_capacity=T_MAX * W)
        want = reference.dispatch(cfg, [x for x, _, _ in ins], None, [i for _, i, _ in ins])
        outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins],
                                 [(2 * x_ref.float()).to(torch.bfloat16) for _, x_ref, _ in want])
        for r in range(W):
            assert torch.equal(got[r][name]["count"], want[r][0]), (name, r)
            assert got[r][name]["handle"] == (T_MAX, hidden, E)
            assert combine_problems(got[r][name]["combined"], outs[r], default_max_ulps(TEST_DEVICE)) == [], (name, r)
    # Refusals: rank 1's top-k 9 aborts the call on every rank; a set over num_rdma_bytes, ValueError everywhere.
    assert got[1]["topk9"].startswith("ValueError: topk_idx: top-k 9 > 8") and "warm_up(..., top_k=)" in \
        got[1]["topk9"], got[1]["topk9"]
    assert got[0]["topk9"].startswith("CallAborted") and "rank 1" in got[0]["topk9"], got[0]["topk9"]
    for r in range(W):
        assert got[r]["over_budget"].startswith(f"ValueError: rank {r}: a low_latency_dispatch of "
                                                f"(num_max_dispatch_tokens_per_rank, hidden, num_experts, top-k) = "
                                                f"({T_MAX}, {4 * H}, {E}, {K})") and "> num_rdma_bytes" in \
            got[r]["over_budget"], got[r]["over_budget"]
        assert got[r]["clean_zeroed"]
        assert got[r]["clean_unknown"].startswith("ValueError: clean_low_latency_buffer: this Buffer has buffers for")
    ins = [_inputs(r, 32, T_MAX, "random", H) for r in range(W)]
    _check_call([dict(got[r]["after_clean"], handle=(T_MAX, H, E)) for r in range(W)], ins, MODES[1], W, H)


def _expert(recv_x, H: int) -> torch.Tensor:
    """2 x what arrived, dequantised as `_dequantize` does, with ops a CUDA graph captures (no host sync)."""
    if isinstance(recv_x, torch.Tensor):
        return (2 * recv_x.float()).to(torch.bfloat16)
    q, s = recv_x
    if s.dtype == torch.int32:
        s = (s.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    L, C, _ = q.shape
    S = -(-H // 128)
    scale = s[..., :S].unsqueeze(-1).expand(L, C, S, 128).reshape(L, C, S * 128)[..., :H]
    return (2 * q.float() * scale).to(torch.bfloat16)


def _capture_rank(a2a, rank, seeds):
    """warm_up, then one CUDA graph holding the first fp8 (UE8M0) and the first bf16 call of the Buffer,
    replayed with new inputs."""
    from moe_a2a.compat import Buffer

    dev = a2a.device
    with Buffer(transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size, device=dev) as buf:
        buf.warm_up(T_MAX, H, E, top_k=K)
        x, idx, w = (t.to(dev) for t in _inputs(rank, 1, T_MAX, "random", H))
        # The kernels compile at their first launch (outside the capture); no buffer is built by these calls.
        for mode in (MODES[3], MODES[0]):
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, **mode)
            buf.low_latency_combine(_expert(recv_x, H), idx, w, handle)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            results = []
            for mode in (MODES[3], MODES[0]):
                recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, **mode)
                combined, _, _ = buf.low_latency_combine(_expert(recv_x, H), idx, w, handle)
                results.append((recv_x, count, handle, combined))
        out = []
        for seed in seeds:
            for t, new in zip((x, idx, w), _inputs(rank, seed, T_MAX, "random", H)):
                t.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            out.append([_record(*res) for res in results])
        buf.check()
    return out


@pytest.mark.timeout(300)
@pytest.mark.gpu(reason="a CUDA graph of the facade: one GPU per rank, or ranks sharing one under MPS")
def test_warm_up_then_capture_fp8_and_bf16_calls():
    from moe_a2a.runtime.wiring import mps_enabled

    if torch.cuda.device_count() < W and not mps_enabled(torch.device("cuda", 0)):
        pytest.skip(f"needs {W} GPUs, or MPS on this one (benchmarks/gpu/run.sh mps): ranks sharing a GPU without "
                    f"MPS wait on the host, which a CUDA graph cannot capture")
    seeds = [3, 4]
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=64, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=W, node_size=2, transport="shm", device="cuda", timeout_s=60,
                      gpu_wait="kernel") as cl:
        got = cl.run(_capture_rank, seeds)
    for i, seed in enumerate(seeds):
        ins = [_inputs(r, seed, T_MAX, "random", H) for r in range(W)]
        for j, mode in enumerate((MODES[3], MODES[0])):
            _check_call([got[r][i][j] for r in range(W)], ins, mode, W, H)
            if mode.get("use_fp8"):
                assert all(got[r][i][j]["layout"] == _deep_ep_layout(T_MAX, H, True) for r in range(W))
