"""One variant of the facade-gap pairs, eager, for an external profiler (Nsight Compute: the kernels of the
last pairs). One rank, decode sizes, as `facade_gap.py`:

    ncu --set full -k regex:dispatch --launch-skip 16 --launch-count 2 \\
        python3 benchmarks/gpu/facade_pairs.py facade|deep|plain [--pairs 10] [--set module.ATTR=INT ...]

- `facade`: `Buffer.low_latency_dispatch(use_fp8=True)` + `low_latency_combine` (the pack quantises);
- `deep`: `AllToAll` fed pre-quantised rows, its unpack writing DeepEP's column-major scales;
- `plain`: the same with row-major scale rows.
Each pair launches route, route fixup, pack, unpack, combine pack, combine reduce (so dispatch-named kernels
2k and 2k + 1 are pair k's pack and unpack).
"""
from __future__ import annotations

import argparse
import importlib
import socket

import torch
import torch.distributed as dist

T, H, E, K = 128, 7168, 288, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=("facade", "deep", "plain"))
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], metavar="module.ATTR=INT")
    args = ap.parse_args()
    for item in args.set:
        target, _, value = item.partition("=")
        mod, _, attr = target.rpartition(".")
        module = importlib.import_module("moe_a2a." + mod)
        getattr(module, attr)
        setattr(module, attr, int(value))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from moe_a2a import A2AConfig, AllToAll
    from moe_a2a.compat import Buffer
    from moe_a2a.compat._slots import column_major_scales
    from moe_a2a.triton_kernels.quant import quantize_fp8

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    if args.variant == "facade":
        buf = Buffer(None, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
        y_f = torch.zeros(E, T, H, dtype=torch.bfloat16, device=dev)

        def pair():
            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
            buf.low_latency_combine(y_f, idx, w, handle, out=out)
        closer = buf
    else:
        cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H,
                        in_dtype=torch.float8_e4m3fn, scale_block=128, out_dtype=torch.bfloat16, expert_capacity=T)
        a2a = AllToAll(cfg, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
        xq, xs = quantize_fp8(x, 128)
        num, ex, exs = a2a.empty_dispatch_outputs()
        if args.variant == "deep":
            exs = column_major_scales(E, T, cfg.num_scales, torch.float32, dev)
        y = torch.zeros(ex.shape[0], H, dtype=torch.bfloat16, device=dev)

        def pair():
            a2a.dispatch(num, ex, exs, xq, xs, idx)
            a2a.combine(out, idx, w, y)
        closer = a2a
    for _ in range(args.pairs):
        pair()
    torch.cuda.synchronize()
    print(f"{args.variant}: {args.pairs} pairs done")
    closer.close()


if __name__ == "__main__":
    main()
