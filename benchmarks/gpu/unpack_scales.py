"""The dispatch unpack's GPU time and registers against the number of scale columns, decode sizes, one rank.

    python3 benchmarks/gpu/unpack_scales.py [--blocks 7168,3584,...] [--scale-rows padded,tight] [--out RESULTS.json]

T=128 tokens of H=7168 fp8 (pre-quantised), 288 experts, top-8, `expert_capacity=T`; one `AllToAll` per
`scale_block` (S = ceil(H / block) scale columns) and per kind of scale output: `padded`, the
`empty_dispatch_outputs()` tensor (rows 64-byte aligned), or `tight`, a contiguous `[rows, S]` tensor. Per
case: one CUDA graph of two dispatch + combine pairs, the median GPU time of each kernel of a pair (the
torch profiler; pack and unpack share a name and are told apart by position), and the compiled unpack's
registers and spills. `docs/perf-notes.md` has what it found.
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
    ap.add_argument("--blocks", default="7168,3584,1792,1024,896,448,256,128,64")
    ap.add_argument("--scale-rows", default="padded,tight")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29534", rank=0, world_size=1)
    from moe_a2a import A2AConfig, AllToAll
    from moe_a2a.triton_kernels import dispatch as dispatch_kernels
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
        for kind in args.scale_rows.split(","):
            cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H,
                            in_dtype=torch.float8_e4m3fn, scale_block=block, out_dtype=torch.bfloat16,
                            expert_capacity=T)
            a2a = AllToAll(cfg, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
            num, ex, exs = a2a.empty_dispatch_outputs()
            if kind == "tight":
                exs = torch.zeros(exs.shape[0], cfg.num_scales, device=dev)
            xs = torch.rand(T, cfg.num_scales, device=dev)
            y = torch.zeros(ex.shape[0], H, dtype=torch.bfloat16, device=dev)

            def pair():
                a2a.dispatch(num, ex, exs, xq, xs, idx)
                a2a.combine(out, idx, w, y)
            dispatch_kernels._UNPACK.clear()
            for _ in range(3):
                pair()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                pair()
                pair()
            kernels = kernel_positions(graph.replay)
            names = [n for n, _ in kernels[:len(kernels) // 2]]
            dispatch = [i for i, n in enumerate(names) if "dispatch" in n]  # pack, then unpack
            compiled = next(iter(dispatch_kernels._UNPACK._entries.values()))[0]
            row = {"scale_block": block, "num_scales": cfg.num_scales, "scale_rows": kind,
                   "scale_row_stride": exs.stride(0), "dispatch_stride_bytes": cfg.dispatch_stride_bytes,
                   "pack_us": kernels[dispatch[0]][1], "unpack_us": kernels[dispatch[1]][1],
                   "unpack_registers": compiled.n_regs, "unpack_spills": compiled.n_spills,
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
