"""A CUDA graph capturing dispatch + toy expert + combine with `bound_m`, replayed with changing
routing and token counts, checked against the reference on every replay (GPU only)."""
import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.config import A2AConfig
from moe_a2a.bench.demo import make_inputs
from moe_a2a.oracle import check_against_reference, fill_sentinel, record_call, toy_expert

needs_gpu = pytest.mark.gpu(reason="CUDA graphs; run on the GPU machine (benchmarks/gpu/run.sh)")


def _captured(step) -> "torch.cuda.CUDAGraph":
    """`step` run once eagerly (every kernel compiled before capture), then captured in a CUDA graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _graph_rank(a2a, rank, live_tokens):
    cfg, dev = a2a.cfg, a2a.device
    T = cfg.max_num_tokens
    x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, T, 100))
    bound = torch.tensor([T], dtype=torch.int32, device=dev)
    num, ex, exs = a2a.empty_dispatch_outputs()
    out = torch.zeros(T, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)

    def step():
        a2a.dispatch(num, ex, exs, x, xs, idx, bound_m=bound)
        a2a.combine(out, idx, w, toy_expert(ex, exs, cfg), bound_m=bound)

    graph = _captured(step)
    calls = []
    for it, n in enumerate(live_tokens):
        nx, nxs, nidx, nw = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, T, 200 + it))
        x.copy_(nx), idx.copy_(nidx), w.copy_(nw), bound.fill_(n[rank])
        if xs is not None:
            xs.copy_(nxs)
        out.zero_()
        fill_sentinel(ex, exs)
        graph.replay()
        torch.cuda.synchronize()
        k = n[rank]
        calls.append({**record_call(cfg, x[:k].clone(), None if xs is None else xs[:k].clone(), idx[:k].clone(),
                                    w[:k].clone(), num, ex, exs, out[:k]),
                      "untouched": out[k:].abs().sum().item()})
    return {"calls": calls}


@needs_gpu
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cuda_graph_replays_with_changing_routing_and_token_counts():
    cfg = A2AConfig(max_num_tokens=32, num_experts=16, experts_per_token=4, hidden_dim=256,
                    in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16, expert_padding=4)
    live = [[32, 32], [5, 17], [0, 32], [31, 1]]  # per replay, per rank: tokens behind bound_m
    with LocalCluster(cfg, world_size=2, node_size=2, transport="shm", device="cuda", timeout_s=60,
                      gpu_wait="kernel") as cl:
        results = cl.run(_graph_rank, live)
    assert check_against_reference(cfg, results) == []
    assert all(c["untouched"] == 0 for r in results for c in r["calls"])


def _shrink_graph_rank(comm, store: str, fp8: bool, stopper: int, replays: int, timeout_s: float):
    """One rank of a 3-rank node on the GPU(s) here, kernel waits, shrink mode, one CUDA graph of dispatch +
    toy expert + combine. Every rank replays once; then `stopper` stops replaying (it waits at the final
    barrier, alive) and the others replay `replays` more times with new inputs."""
    import os
    import time

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    from moe_a2a import AllToAll
    from moe_a2a.runtime.shrink import RankMask

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=comm.rank, world_size=comm.size)
    rank, W = comm.rank, comm.size
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    cfg = A2AConfig(max_num_tokens=32, num_experts=12, experts_per_token=4, hidden_dim=256,
                    in_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, out_dtype=torch.bfloat16)
    mask = RankMask(W, rank, dev)
    a2a = AllToAll(cfg, device=dev, gpu_wait="kernel", node_group=W, timeout_s=timeout_s, rank_mask=mask)
    T = cfg.max_num_tokens
    x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, T, 100))
    num, ex, exs = a2a.empty_dispatch_outputs()
    out = torch.zeros(T, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)

    def step():
        a2a.dispatch(num, ex, exs, x, xs, idx)
        a2a.combine(out, idx, w, toy_expert(ex, exs, cfg))

    graph = _captured(step)
    calls = []
    for it in range(1 + replays):
        if it == 1 and rank == stopper:
            break
        nx, nxs, nidx, nw = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, T, 200 + it))
        x.copy_(nx), idx.copy_(nidx), w.copy_(nw)
        if xs is not None:
            xs.copy_(nxs)
        out.zero_()
        fill_sentinel(ex, exs)
        t0 = time.monotonic()
        graph.replay()
        torch.cuda.synchronize()
        calls.append({**record_call(cfg, x.cpu(), None if xs is None else xs.cpu(), idx.cpu(), w.cpu(), num.cpu(),
                                    ex.cpu(), None if exs is None else exs.cpu(), out.cpu()),
                      "seconds": time.monotonic() - t0, "mask": mask.tensor.tolist()})
    dist.barrier()  # the stopper stays alive (its buffers mapped) until the survivors are done
    a2a.close()
    import io

    out = io.BytesIO()  # bytes: tensors through the pipe would live in shared memory that dies with us
    torch.save({"calls": calls, "cfg": cfg}, out)
    return out.getvalue()


@needs_gpu
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_shrink_under_a_cuda_graph_masks_a_rank_that_stops_replaying(tmp_path, fp8):
    """Shrink mode inside a CUDA graph: the kernels' own waits mask the rank that stopped (at the
    deadline, `timeout_s`) and the replay completes among the survivors, right against the reference
    with the stopped rank's tokens absent and the routes to its experts dropped; the replay after that
    does not wait for it. Three ranks on one node: three GPUs, or one shared under MPS
    (`benchmarks/gpu/run.sh mps` starts it)."""
    from moe_a2a.oracle import check_call
    from moe_a2a.runtime.wiring import mps_enabled
    from tests.proxy._peers import run_peers

    if torch.cuda.device_count() < 3 and not mps_enabled(torch.device("cuda", 0)):
        pytest.skip("needs 3 GPUs, or MPS on this one (benchmarks/gpu/run.sh mps): ranks sharing a GPU "
                    "without MPS wait on the host")
    stopper, replays, timeout_s = 2, 2, 3.0
    import io

    got = run_peers(3, _shrink_graph_rank, str(tmp_path / "store"), fp8, stopper, replays, timeout_s, timeout_s=240)
    assert all(isinstance(g, bytes) for g in got), got
    got = [torch.load(io.BytesIO(g), weights_only=False) for g in got]
    cfg = got[0]["cfg"]
    L = cfg.num_experts // 3
    first = [g["calls"][0] for g in got]
    assert check_call(cfg, [(c["x"], c["x_scale"], c["indices"], c["weights"], None) for c in first],
                      dict(enumerate(first)), where="before the stop ") == []
    survivors = [r for r in range(3) if r != stopper]
    for it in range(1, 1 + replays):
        calls = {r: got[r]["calls"][it] for r in survivors}
        inputs = []
        for s in range(3):
            if s == stopper:  # sends nothing
                c = calls[survivors[0]]
                inputs.append((c["x"][:0], None if c["x_scale"] is None else c["x_scale"][:0],
                               c["indices"][:0], c["weights"][:0], None))
            else:
                idx = calls[s]["indices"]
                kept = torch.where((idx >= 0) & (idx // L == stopper), -1, idx)  # its experts sent nothing back
                inputs.append((calls[s]["x"], calls[s]["x_scale"], kept, calls[s]["weights"], None))
        assert check_call(cfg, inputs, calls, where=f"replay {it} ") == []
        for r in survivors:
            assert calls[r]["mask"] == [int(q == stopper) for q in range(3)], (it, r, calls[r]["mask"])
    for r in survivors:  # the first replay without it waited for the deadline; the next did not
        assert got[r]["calls"][1]["seconds"] >= timeout_s * 0.9, got[r]["calls"][1]["seconds"]
        assert got[r]["calls"][2]["seconds"] < 1.0, got[r]["calls"][2]["seconds"]
