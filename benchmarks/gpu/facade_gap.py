"""The DeepEP facade's graph gap, its parts told apart: one rank, decode sizes, three CUDA graphs of two
dispatch + combine pairs each, replayed interleaved round by round (drift hits all three alike).

    python3 benchmarks/gpu/facade_gap.py RESULTS.json [--rounds 10] [--reps 100] [--arrive-gpu] [--positions 20]
        [--set triton_kernels._launch.ROWS_PER_TILE=16 ...]
    ncu --set full -k regex:dispatch --launch-skip 16 --launch-count 2 \
        python3 benchmarks/gpu/facade_gap.py - --eager facade|deep|plain [--pairs 10]

`--eager V`: only V's eager pairs, for a profiler (each pair launches route, route fixup, pack, unpack, combine
pack, combine reduce: dispatch-named kernels 2k and 2k + 1 are pair k's pack and unpack).

- `facade`: `Buffer.low_latency_dispatch(use_fp8=True)` + `low_latency_combine` (bf16 in, the pack quantises);
- `deep`: `AllToAll` fed pre-quantised rows, its unpack writing DeepEP's column-major scales;
- `plain`: the same with row-major scale rows.
facade - deep is the fused quantisation, deep - plain the scale layout, facade - plain the gap
(docs/compat.md). `--arrive-gpu`: every data kernel's arrival at GPU scope (`sweep_launch._arrive_gpu`, a timing
probe) before anything compiles. Medians of the per-round medians, µs a pair.
"""
from __future__ import annotations

import argparse
import importlib
import json
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

T, H, E, K = 128, 7168, 288, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--arrive-gpu", action="store_true")
    ap.add_argument("--eager", choices=("facade", "deep", "plain"), default=None,
                    help="only --pairs eager pairs of this variant, nothing timed: a target for an external profiler")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--positions", type=int, default=0, metavar="REPS",
                    help="after the rounds, each variant's graph kernels by launch position (torch profiler, median "
                         "over REPS replays): which kernel a variant's difference is in")
    ap.add_argument("--set", action="append", default=[], metavar="module.ATTR=INT",
                    help="a module constant under moe_a2a set before anything launches (a kernel variant: e.g. "
                         "triton_kernels._launch.ROWS_PER_TILE=16); one process a variant, as the gap is "
                         "within the process")
    args = ap.parse_args()
    if args.arrive_gpu:  # before the first launch: Triton resolves the helper when it compiles
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from sweep_launch import _arrive_gpu

        from moe_a2a.triton_kernels import _details
        _details.node_arrive_of = _arrive_gpu
    for item in args.set:
        target, _, value = item.partition("=")
        mod, _, attr = target.rpartition(".")
        module = importlib.import_module("moe_a2a." + mod)
        getattr(module, attr)  # a name that is not there is a typo, not a variant
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
    buf = Buffer(None, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
    y_f = torch.zeros(E, T, H, dtype=torch.bfloat16, device=dev)
    cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.float8_e4m3fn,
                    scale_block=128, out_dtype=torch.bfloat16, expert_capacity=T)
    a2a = AllToAll(cfg, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
    xq, xs = quantize_fp8(x, 128)
    num, ex, exs = a2a.empty_dispatch_outputs()
    exs_deep = column_major_scales(E, T, cfg.num_scales, torch.float32, dev)
    y = torch.zeros(ex.shape[0], H, dtype=torch.bfloat16, device=dev)

    def facade():
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        buf.low_latency_combine(y_f, idx, w, handle, out=out)

    def deep():
        a2a.dispatch(num, ex, exs_deep, xq, xs, idx)
        a2a.combine(out, idx, w, y)

    def plain():
        a2a.dispatch(num, ex, exs, xq, xs, idx)
        a2a.combine(out, idx, w, y)

    if args.eager:
        pair = {"facade": facade, "deep": deep, "plain": plain}[args.eager]
        for _ in range(args.pairs):
            pair()
        torch.cuda.synchronize()
        a2a.close()
        buf.close()
        return
    graphs = {}
    for name, pair in (("facade", facade), ("deep", deep), ("plain", plain)):
        for _ in range(3):
            pair()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pair()
            pair()
        graphs[name] = graph
    times = {name: [] for name in graphs}
    for r in range(args.rounds):
        for name in (list(graphs) if r % 2 == 0 else list(graphs)[::-1]):
            for _ in range(5):
                graphs[name].replay()
            ts = []
            for _ in range(args.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graphs[name].replay()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3 / 2)
            times[name].append(statistics.median(ts))
    med = {name: round(statistics.median(v), 2) for name, v in times.items()}
    res = {"gpu": torch.cuda.get_device_name(0), "arrive_gpu": args.arrive_gpu, "set": args.set, "rounds": args.rounds,
           "reps": args.reps, "median_us_per_pair": med,
           "gap_us": {"facade-plain": round(med["facade"] - med["plain"], 2),
                      "quantisation (facade-deep)": round(med["facade"] - med["deep"], 2),
                      "layout (deep-plain)": round(med["deep"] - med["plain"], 2)},
           "per_round": {k: [round(t, 2) for t in v] for k, v in times.items()}}
    if args.positions:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _timing import kernel_positions
        res["positions"] = {name: kernel_positions(graph.replay, args.positions) for name, graph in graphs.items()}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("gpu", "arrive_gpu", "set", "median_us_per_pair", "gap_us")}))
    a2a.close()
    buf.close()


if __name__ == "__main__":
    main()
