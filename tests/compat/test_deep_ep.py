"""`moe_a2a.compat.Buffer` (DeepEP's low-latency shape) against `reference.py`, between real processes."""
from __future__ import annotations

import pytest
import torch

from moe_a2a import A2AConfig, LocalCluster, reference
from moe_a2a.triton_kernels.quant import quantize_fp8

from ..conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow]

T_MAX, E, K, H = 4, 8, 3, 64


def _inputs(rank: int, seed: int, T: int, routing: str):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    if routing == "skew":  # every token to the same K experts: each gets exactly the capacity (W * T_MAX rows)
        idx = torch.arange(K, dtype=torch.int64).repeat(T, 1)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _facade_rank(a2a, rank, use_fp8: bool, token_counts, routing: str):
    from moe_a2a.compat import Buffer

    dev = a2a.device
    out = []
    # DeepEP's own construction keywords are taken (and its size hint given back as num_rdma_bytes).
    hint = Buffer.get_low_latency_rdma_size_hint(T_MAX, H, a2a.world_size, E)
    with Buffer(None, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=1,
                allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
                transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size) as buf:
        for seed in (1, 2):  # two micro-batches in flight at once: dispatch A, dispatch B, combine A, B
            pending = []
            for mb in range(2):
                T = token_counts[rank][mb]
                x, idx, w = (t.to(dev) for t in _inputs(rank, 10 * seed + mb, T, routing))
                recv_x, count, handle, event, hook = buf.low_latency_dispatch(
                    x, idx, T_MAX, E, use_fp8=use_fp8, return_recv_hook=True)
                pending.append((x, idx, w, recv_x, count, handle, hook))
            results = []
            for x, idx, w, recv_x, count, handle, hook in pending:
                hook()  # the receive half, after other work
                xs = recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=2)[..., :H] if use_fp8 else recv_x.float()
                y = (2 * xs).to(torch.bfloat16)
                got = {"count": count.clone(), "recv": (recv_x[0].view(torch.uint8).clone(), recv_x[1].clone())
                       if use_fp8 else recv_x.clone()}
                combined, _, chook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
                results.append((got, combined, chook))
            for got, combined, chook in results:
                chook()
                got["combined"] = combined.clone()
                out.append(got)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("node_size", [2, 1], ids=["node-local", "remote"])
def test_facade_matches_reference_with_two_micro_batches_and_late_hooks(use_fp8, node_size):
    W = 2
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16)
    token_counts = [[T_MAX, 0], [T_MAX, T_MAX]]  # an empty rank in one micro-batch
    with LocalCluster(cfg0, world_size=W, node_size=node_size, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        for routing in ("random", "skew"):
            got = cl.run(_facade_rank, use_fp8, token_counts, routing)
            cap = T_MAX * W
            cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H,
                            in_dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16,
                            scale_block=128 if use_fp8 else None, expert_capacity=cap)
            L = E // W
            for call, (seed, mb) in enumerate([(1, 0), (1, 1), (2, 0), (2, 1)]):
                ins = [_inputs(r, 10 * seed + mb, token_counts[r][mb], routing) for r in range(W)]
                xs = [tuple(t.cpu() for t in quantize_fp8(x.to(TEST_DEVICE).float(), 128)) if use_fp8 else (x, None)
                      for x, _, _ in ins]
                want = reference.dispatch(cfg, [q for q, _ in xs], [s for _, s in xs] if use_fp8 else None,
                                          [i for _, i, _ in ins])
                ys = []
                for r in range(W):
                    n_ref, x_ref, s_ref = want[r]
                    g = got[r][call]
                    assert torch.equal(g["count"].cpu(), n_ref), (routing, call, r)
                    for l, n in enumerate(n_ref.tolist()):
                        rows = slice(l * cap, l * cap + n)
                        if use_fp8:
                            assert torch.equal(g["recv"][0].cpu().view(-1, H)[rows], x_ref[rows].view(torch.uint8))
                            assert torch.equal(g["recv"][1].cpu().view(-1, 1)[rows], s_ref[rows])
                        else:
                            assert torch.equal(g["recv"].cpu().view(-1, H)[rows], x_ref[rows])
                    xf = x_ref.float() * (s_ref.repeat_interleave(128, dim=1)[:, :H] if use_fp8 else 1)
                    ys.append((2 * xf).to(torch.bfloat16))
                outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins], ys)
                for r in range(W):
                    torch.testing.assert_close(got[r][call]["combined"].cpu().float(), outs[r].float(),
                                               rtol=2 ** -7, atol=1e-5)


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
        for inst in buf._a2a:
            inst.check()
    return out


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2 or TEST_DEVICE != "cuda",
                    reason="a CUDA graph of the facade needs one GPU per rank (MOE_A2A_TEST_DEVICE=cuda, 2 GPUs)")
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
            torch.testing.assert_close(got[r][call]["combined"].float(), outs[r].float(), rtol=2 ** -7, atol=1e-5)


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
                buf._a2a[handle.slot].check()
                seen.append({"count": count.cpu().clone(), "recv": recv_x.cpu().clone(), "combined": combined.cpu().clone()})
            except (ValueError, CallAborted) as exc:
                seen.append(f"{type(exc).__name__}: {exc}")
    return seen


@pytest.mark.timeout(300)
def test_bad_input_to_the_facade_aborts_that_call_everywhere_and_the_next_works():
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=2, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        got = cl.run(_bad_input_in_a_later_call)
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
            torch.testing.assert_close(got[r][call]["combined"].float(), outs[r].float(), rtol=2 ** -7, atol=1e-5)


def _bad_calls(a2a, rank):
    from moe_a2a.compat import Buffer

    errors = []
    with Buffer(transport="shm", timeout_s=10.0, node_group=a2a.layout.node_size) as buf:
        x = torch.zeros(2, H, dtype=torch.bfloat16)
        idx = torch.zeros(2, K, dtype=torch.int64)
        for kwargs in ({"use_ue8m0": True}, {"async_finish": True}, {"bogus": 1}):
            try:
                buf.low_latency_dispatch(x, idx, T_MAX, E, **kwargs)
            except ValueError as exc:
                errors.append(str(exc))
        try:
            buf.low_latency_dispatch(x.float(), idx, T_MAX, E)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.timeout(300)
def test_facade_refuses_what_it_does_not_support():
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=2, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        for errors in cl.run(_bad_calls):
            assert len(errors) == 4, errors
            assert "use_ue8m0" in errors[0] and "async_finish" in errors[1] and "bogus" in errors[2]
            assert errors[3].startswith("x:")


# ---- the first call is collective; a closed Buffer says so ---------------------------------------
def _first_calls_rejected_then_good(a2a, rank):
    """Calls 0-2 are refused (call 0: float32 x on rank 1 only; call 1: different
    num_max_dispatch_tokens_per_rank; call 2: different hidden), then three good calls; then the Buffer
    is closed and used again."""
    import time

    from moe_a2a.all_to_all import CallAborted
    from moe_a2a.compat import Buffer

    dev, seen = a2a.device, []
    buf = Buffer(transport=a2a.transport, timeout_s=20.0, node_group=a2a.layout.node_size)
    try:
        for call in range(6):
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
                recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, num_max, E, use_fp8=False)
                combined, _, _ = buf.low_latency_combine((2 * recv_x.float()).to(torch.bfloat16), idx, w, handle)
                buf._a2a[handle.slot].check()
                seen.append({"count": count.cpu().clone(), "combined": combined.cpu().clone()})
            except (ValueError, CallAborted) as exc:
                seen.append({"error": f"{type(exc).__name__}: {exc}", "built": bool(buf._a2a),
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
        assert all(not seen[r][c]["built"] and seen[r][c]["seconds"] < 5 for c in range(3)), seen[r][:3]
    # Calls 3-5: exact on every rank (a drift would pair rank 0's call with rank 1's next one).
    cap = T_MAX * W
    cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                    expert_capacity=cap)
    for call in (3, 4, 5):
        ins = [_inputs(r, 60 + call, T_MAX, "random") for r in range(W)]
        want = reference.dispatch(cfg, [x for x, _, _ in ins], None, [i for _, i, _ in ins])
        outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins],
                                 [(2 * x_ref.float()).to(torch.bfloat16) for _, x_ref, _ in want])
        for r in range(W):
            assert "error" not in seen[r][call], seen[r][call]
            assert torch.equal(seen[r][call]["count"], want[r][0]), (call, r)
            torch.testing.assert_close(seen[r][call]["combined"].float(), outs[r].float(), rtol=2 ** -7, atol=1e-5)
    # A closed Buffer: a clear error, not an IndexError.
    for r in range(W):
        assert len(got[r][1]) == 2 and all(a.startswith("ValueError: this Buffer is closed") for a in got[r][1]), got[r][1]


def test_deep_ep_module_names_size_hint_and_what_is_refused():
    from moe_a2a.compat import Buffer, topk_idx_t

    assert topk_idx_t is torch.int64
    hint = Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 256)
    cfg = A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=7168,
                    in_dtype=torch.float8_e4m3fn, scale_block=128, out_dtype=torch.bfloat16, expert_capacity=256)
    lay = cfg.layout(2)
    assert hint == 2 * (lay.send_bytes + lay.recv_bytes + lay.segment_bytes(False)) > 0
    with pytest.raises(ValueError, match="enable_shrink"):
        Buffer(None, enable_shrink=True)
