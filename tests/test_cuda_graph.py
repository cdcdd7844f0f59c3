"""A CUDA graph capturing dispatch + toy expert + combine with `bound_m`, replayed with changing
routing and token counts, checked against the reference on every replay (GPU only)."""
import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.config import A2AConfig
from moe_a2a.bench.demo import check_against_reference, make_inputs, toy_expert

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="CUDA graphs need a GPU; run on the GPU machine (benchmarks/gpu/run.sh)")


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
        graph.replay()
        torch.cuda.synchronize()
        k = n[rank]
        rows = int(sum((c + cfg.expert_padding - 1) // cfg.expert_padding * cfg.expert_padding for c in num.tolist()))
        calls.append({"x": x[:k].clone(), "x_scale": None if xs is None else xs[:k].clone(),
                      "indices": idx[:k].clone(), "weights": w[:k].clone(), "num": num.clone(),
                      "expert_x": ex[:rows].clone(), "expert_x_scale": None if exs is None else exs[:rows].clone(),
                      "out": out[:k].clone(), "untouched": out[k:].abs().sum().item()})
    return {"calls": calls}


@needs_gpu
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
