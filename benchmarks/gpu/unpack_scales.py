"""The dispatch unpack's GPU time against the number of scale columns, decode sizes, one rank.

    python3 benchmarks/gpu/unpack_scales.py [--blocks 128,7168,896,...] [--out RESULTS.json]

T=128 tokens of H=7168 fp8 (pre-quantised), 288 experts, top-8, `expert_capacity=T`; one `AllToAll` per
`scale_block` (S = ceil(H / block) scale columns), one CUDA graph of two dispatch + combine pairs, and the
median GPU time of each kernel of a pair (the torch profiler; pack and unpack share a name and are told
apart by position). `docs/perf-notes.md` has what it found (S = 1 and S = 8 are the slow ones).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from _timing import kernel_positions, median_us

T, H, E, K = 128, 7168, 288, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="7168,896,256,224,128,120,112,100,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29534", rank=0, world_size=1)
    from moe_a2a import A2AConfig, AllToAll
    from moe_a2a.triton_kernels.quant import quantize_fp8

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    xq, _ = quantize_fp8(x, 128)
    rows = []
    for block in (int(b) for b in args.blocks.split(",")):
        cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H,
                        in_dtype=torch.float8_e4m3fn, scale_block=block, out_dtype=torch.bfloat16, expert_capacity=T)
        a2a = AllToAll(cfg, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
        num, ex, exs = a2a.empty_dispatch_outputs()
        xs = torch.rand(T, cfg.num_scales, device=dev)
        y = torch.zeros(ex.shape[0], H, dtype=torch.bfloat16, device=dev)

        def pair():
            a2a.dispatch(num, ex, exs, xq, xs, idx)
            a2a.combine(out, idx, w, y)
        for _ in range(3):
            pair()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pair()
            pair()
        kernels = kernel_positions(graph.replay)
        names = [n for n, _ in kernels[:len(kernels) // 2]]
        dispatch = [i for i, n in enumerate(names) if "dispatch" in n]  # pack, then unpack
        row = {"scale_block": block, "num_scales": cfg.num_scales, "dispatch_stride_bytes": cfg.dispatch_stride_bytes,
               "pack_us": kernels[dispatch[0]][1], "unpack_us": kernels[dispatch[1]][1],
               "graph_us_per_pair": round(median_us(graph.replay) / 2, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        a2a.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": {"T": T, "H": H, "experts": E, "top_k": K, "gpu": torch.cuda.get_device_name(0)},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
