"""A CUDA graph capturing dispatch + toy expert + combine with `bound_m`, replayed with changing
routing and token counts, checked against the reference on every replay (GPU only)."""
import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.config import A2AConfig
from moe_a2a.bench.demo import make_inputs
from moe_a2a.oracle import check_against_reference, fill_sentinel, record_call, toy_expert

needs_gpu = pytest.mark.gpu(reason="CUDA graphs; run on the GPU machine (benchmarks/gpu/run.sh)")


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

    step()  # eager warm-up: compiles every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
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
