"""The cost of returning fp8 scales in DeepEP's layout (issue 33, 3): the scale_layout kernel alone, and the
DeepEP facade's fp8 dispatch + combine with and without it, one GPU.

    python3 benchmarks/gpu/scale_layout.py --out RESULTS.json [--reps 200] [--check]

DeepEP returns an fp8 dispatch's scales column-major per expert, TMA-aligned (DeepGEMM's masked grouped GEMM
reads them as is); the facade's receive writes them row-major inside each received row, and
`triton_kernels/scale_layout.py` copies them (rows below each expert's count) at every fp8 receive.
- `kernel`: `scales_to_column_major` alone at decode sizes (T=128 tokens a rank, H=7168, 288 experts,
  top-8) for W = 1, 2, 8 ranks (L = 288 / W experts, C = 128 W rows each), fp32 scales (S = 56) and UE8M0
  words (S = 14), the counts of a random top-8 routing of every rank's tokens (`decode`) or every row
  (`full`); the source is the facade's (views into rows of 2H bytes). Per case: eager (CUDA events around
  one launch: a remembered launch, so mostly host), one CUDA graph of 20 launches (µs per launch), the
  kernel's GPU time (torch profiler), and torch's strided `copy_` of every row for comparison.
- `facade`: `Buffer.low_latency_dispatch(use_fp8=True)` + `low_latency_combine`, one rank (W = 1), in one
  CUDA graph of two pairs and eager, with the scales written (as shipped) and with the kernel replaced by a
  no-op (the row-major views' cost), fp32 and UE8M0: µs per pair, median over `--reps`, and the graph's
  kernels in order.
`--check`: every case once at small sizes (T=8, H=512, 16 experts, top-4), no timing, values checked (also on
a CPU with TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

try:
    import moe_a2a  # noqa: F401
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

T, H, E, K = 128, 7168, 288, 8


def _counts(W: int, L: int, fill: str, g: torch.Generator) -> torch.Tensor:
    """Rows per local expert of rank 0: every rank's T tokens routed to K random experts each."""
    C = T * W
    if fill == "full":
        return torch.full((L,), C, dtype=torch.int32)
    idx = torch.stack([torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices for _ in range(W)])
    return torch.bincount(idx.flatten(), minlength=E)[:L].to(torch.int32)


def kernel_cases(dev, reps: int, check: bool) -> list[dict]:
    from moe_a2a.triton_kernels.scale_layout import column_major_scales, scales_to_column_major

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    for W in (1, 2, 8):
        L, C = E // W, T * W
        # The received rows: 2H bytes each (H / 2 words); an fp8 call's scales start at byte H.
        words = torch.randint(-2**31, 2**31 - 1, (L * C, H // 2), dtype=torch.int32, device=dev)
        for fmt, S, dtype in (("fp32", H // 128, torch.float32), ("ue8m0", -(-H // 512), torch.int32)):
            for fill in ("decode", "full"):
                src = words[:, H // 4:H // 4 + S].view(dtype).view(L, C, S)
                counts = _counts(W, L, fill, g).to(dev)
                out = column_major_scales(L, C, S, dtype, dev)
                dense = torch.empty(L, S, C, dtype=dtype, device=dev).transpose(1, 2)

                def launch():
                    scales_to_column_major(src, out, counts)

                def torch_copy():
                    dense.copy_(src)
                launch()
                for l in range(L):  # the values, below each count
                    n = int(counts[l])
                    assert torch.equal(out[l, :n].view(torch.int32).cpu(), src[l, :n].view(torch.int32).cpu())
                row = {"W": W, "L": L, "C": C, "format": fmt, "S": S, "fill": fill,
                       "rows_copied": int(counts.sum()), "bytes_moved": int(counts.sum()) * S * 4 * 2,
                       "out_stride": list(out.stride())}
                if not check:
                    from _timing import kernel_positions, median_us
                    row["eager_us"] = round(median_us(launch, reps), 2)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(20):
                            launch()
                    row["graph_us_per_launch"] = round(median_us(graph.replay, reps) / 20, 2)
                    row["kernel_us"] = kernel_positions(launch)[0][1]
                    row["torch_copy_all_rows_kernel_us"] = kernel_positions(torch_copy)[0][1]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def facade_cases(dev, reps: int, check: bool) -> list[dict]:
    from moe_a2a.compat import Buffer
    from moe_a2a.compat import deep_ep as m

    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    rows = []
    transpose = m._Slot.transpose_scales
    buf = Buffer(None, transport="shm", device=dev, gpu_wait="kernel" if dev.type == "cuda" else "auto",
                 timeout_s=60.0)
    try:
        buf.warm_up(T, H, E, top_k=K, use_fp8=True, zero_copy=True)
        for fmt, ue8m0 in (("fp32", False), ("ue8m0", True)):
            for scales in ("deep_ep_layout", "no_transpose"):
                m._Slot.transpose_scales = transpose if scales == "deep_ep_layout" else (lambda self: None)

                def pair():
                    recv_x, count, handle, _, _ = buf.low_latency_dispatch(
                        x, idx, T, E, use_fp8=True, round_scale=ue8m0, use_ue8m0=ue8m0)
                    buf.get_next_low_latency_combine_buffer(handle)  # the experts would write it
                    buf.low_latency_combine(None, idx, w, handle, zero_copy=True, out=out)
                    return recv_x, count
                recv_x, count = pair()
                pair()
                row = {"format": fmt, "scales": scales, "scale_stride": list(recv_x[1].stride())}
                if scales == "deep_ep_layout":  # rows below the counts hold the quantised tokens' scales
                    assert recv_x[1].stride()[1] == 1 and int(count.sum()) == T * K
                if not check:
                    from _timing import kernel_positions, median_us
                    torch.cuda.synchronize()
                    row["eager_us_per_pair"] = round(median_us(pair, reps), 1)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        pair()
                        pair()
                    row["graph_us_per_pair"] = round(median_us(graph.replay, reps) / 2, 1)
                    row["graph_kernels_in_order"] = kernel_positions(graph.replay)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "graph_kernels_in_order"}), flush=True)
    finally:
        m._Slot.transpose_scales = transpose
        buf.destroy()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--check", action="store_true", help="run each case once, check values, no timing")
    args = ap.parse_args()
    import torch.distributed as dist

    if args.check:  # small sizes: the interpreter on a CPU runs it in a minute
        global T, H, E, K
        T, H, E, K = 8, 512, 16, 4

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1)
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif not args.check:
        raise SystemExit("no GPU: only --check runs here (with TRITON_INTERPRET=1)")
    import triton
    result = {"config": {"T": T, "H": H, "experts": E, "top_k": K, "reps": args.reps,
                         "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
                         "torch": torch.__version__, "triton": triton.__version__},
              "kernel": kernel_cases(dev, args.reps, args.check),
              "facade": facade_cases(dev, args.reps, args.check)}
    dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
