"""The DeepEP facade's cost against `AllToAll` fed pre-quantised input, decode sizes, one node.

    python3 benchmarks/gpu/facade_cost.py [--ranks N] [--reps 200] [--out RESULTS.json] [--profile] [--interleave]
                                          [--host-split [--cprofile]] [--deep-ep-scales]

One rank per GPU (N <= the GPUs here, default all), T=128 tokens, H=7168, 288 experts, top-8; every rank
routes at random. Per variant, eager (one dispatch + combine pair, CUDA events around it) and one CUDA
graph holding two pairs (replayed, timed per replay): the median over `--reps` after a warm-up, in µs
per pair.
- `facade_fp8`: `Buffer.low_latency_dispatch(use_fp8=True)` + `low_latency_combine` (bf16 in, fp8 on the
  wire: the quantisation is the facade's);
- `a2a_prequantised`: `AllToAll.dispatch` of fp8 rows with their scales (quantised before, not timed) +
  `AllToAll.combine`.
`--profile`: each variant's kernels by name (eager pairs) and by position in the graph (pack and unpack
share a name). `--interleave`: eager pairs of the two variants alternated 3 x reps times (host noise hits
both alike): median and 10th / 90th percentiles, and of the gap paired round by round
(`facade_minus_a2a_interleaved_eager_us`). `--host-split`: the host time of each half (a sync after
each pair, so no launch-queue waits), 2 x reps pairs alternated, for the two variants and for
`facade_instances_direct`, the facade's own `AllToAll` instances called with the arguments the facade gives
them: facade_fp8 minus it is the facade's own Python; with `--cprofile`, each variant's functions by own
host time (rank 0, `reps` pairs). `--deep-ep-scales`: a third variant,
`a2a_prequantised_deep_ep_scales`, as `a2a_prequantised` but its unpack writes the scales straight into
DeepEP's layout (a 3-D `out_expert_x_scale`, column-major per expert, TMA-aligned): that layout's cost in
the unpack against row-major scale rows, in every mode asked for.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
from _timing import kernel_positions, median_us

T, H, E, K = 128, 7168, 288, 8


def _rank(rank: int, n: int, port: int, reps: int, profile: bool, interleave: bool, host_split: bool,
          deep_ep_scales: bool, cprofile: bool, queue) -> None:
    import torch.distributed as dist

    from moe_a2a import A2AConfig, AllToAll
    from moe_a2a.compat import Buffer
    from moe_a2a.triton_kernels.quant import quantize_fp8

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    L = E // n
    results = {}

    buf = Buffer(None, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
    y_facade = torch.zeros(L, T * n, H, dtype=torch.bfloat16, device=dev)

    def facade_pair():
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        buf.low_latency_combine(y_facade, idx, w, handle, out=out)

    cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H,
                    in_dtype=torch.float8_e4m3fn, scale_block=128, out_dtype=torch.bfloat16, expert_capacity=T * n)
    a2a = AllToAll(cfg, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
    xq, xs = quantize_fp8(x, 128)
    num, ex, exs = a2a.empty_dispatch_outputs()
    y = torch.zeros(ex.shape[0], H, dtype=torch.bfloat16, device=dev)

    def a2a_pair():
        a2a.dispatch(num, ex, exs, xq, xs, idx)
        a2a.combine(out, idx, w, y)

    pairs = (("facade_fp8", facade_pair), ("a2a_prequantised", a2a_pair))
    if deep_ep_scales:
        from moe_a2a.compat._slots import column_major_scales

        exs_deep_ep = column_major_scales(L, T * n, cfg.num_scales, torch.float32, dev)  # [L, C, S] column-major

        def a2a_deep_ep_pair():
            a2a.dispatch(num, ex, exs_deep_ep, xq, xs, idx)
            a2a.combine(out, idx, w, y)

        pairs += (("a2a_prequantised_deep_ep_scales", a2a_deep_ep_pair),)
    for name, pair in pairs:
        dist.barrier()
        eager = median_us(pair, reps)
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pair()
            pair()
        graph_us = median_us(graph.replay, reps) / 2
        results[name] = {"eager_us_per_pair": round(eager, 1), "graph_us_per_pair": round(graph_us, 1)}
        if profile:
            results[name]["graph_kernels_in_order"] = kernel_positions(graph.replay)
    if interleave:
        times = {name: [] for name, _ in pairs}
        dist.barrier()
        for i in range(3 * reps):
            for name, pair in (pairs if i % 2 else pairs[::-1]):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                pair()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b) * 1e3)
        # Paired by round (each round runs both): the gap without the machine's slow drifts.
        gaps = sorted(f - a for f, a in zip(times["facade_fp8"], times["a2a_prequantised"]))
        results["facade_minus_a2a_interleaved_eager_us"] = {"median": round(gaps[len(gaps) // 2], 1),
                                                            "p10": round(gaps[len(gaps) // 10], 1),
                                                            "p90": round(gaps[9 * len(gaps) // 10], 1)}
        for name, t in times.items():
            t.sort()
            results[name]["interleaved_eager_us"] = {"median": round(t[len(t) // 2], 1),
                                                     "p10": round(t[len(t) // 10], 1),
                                                     "p90": round(t[9 * len(t) // 10], 1)}
    if host_split:
        from moe_a2a.compat.deep_ep import _fp8_quantize

        quantize, turn = _fp8_quantize(H, False, False), {}
        y_rows = y_facade.view(-1, H)

        def direct_dispatch():  # what low_latency_dispatch(use_fp8=True) calls, in the slots' order
            slot = buf._slots[buf._next]
            buf._next ^= 1
            turn["slot"] = slot
            slot.instances[True].dispatch(slot.num, slot.ex, slot.exs, x, buf._token_ids[T], idx, quantize=quantize,
                                          out_source_ranges=slot.layout_range,
                                          out_quantized_scale=slot.recv_x[True, False][1])

        halves = {
            "facade_fp8": (lambda: buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2],
                           lambda handle: buf.low_latency_combine(y_facade, idx, w, handle, out=out)),
            "facade_instances_direct": (direct_dispatch,
                                        lambda _: turn["slot"].instances[True].combine(out, idx, w, y_rows)),
            "a2a_prequantised": (lambda: a2a.dispatch(num, ex, exs, xq, xs, idx),
                                 lambda _: a2a.combine(out, idx, w, y)),
        }
        if deep_ep_scales:
            halves["a2a_prequantised_deep_ep_scales"] = (lambda: a2a.dispatch(num, ex, exs_deep_ep, xq, xs, idx),
                                                         lambda _: a2a.combine(out, idx, w, y))
        host = {name: ([], []) for name in halves}
        order = list(halves)
        dist.barrier()
        for i in range(2 * reps):
            for name in (order if i % 2 else order[::-1]):
                dispatch, combine = halves[name]
                t0 = time.perf_counter()
                handle = dispatch()
                t1 = time.perf_counter()
                combine(handle)
                t2 = time.perf_counter()
                torch.cuda.synchronize()
                host[name][0].append((t1 - t0) * 1e6)
                host[name][1].append((t2 - t1) * 1e6)
        for name, (d_us, c_us) in host.items():
            results.setdefault(name, {})["host_us"] = {"dispatch": round(statistics.median(d_us), 1),
                                                       "combine": round(statistics.median(c_us), 1)}
        if cprofile and rank == 0:  # where each variant's host time goes, by function (own time)
            import cProfile
            import io
            import pstats

            for name, (dispatch, combine) in halves.items():
                prof = cProfile.Profile()
                for _ in range(reps):
                    prof.enable()
                    combine(dispatch())
                    prof.disable()
                    torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                results[name]["cprofile_top_own_time"] = text.getvalue().splitlines()
    if profile:  # the kernels of one eager pair of each variant, by GPU time (where the difference goes)
        for name, pair in pairs:
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    pair()
                torch.cuda.synchronize()
            results[name]["kernels_us_per_pair"] = {
                e.key[:60]: round(e.device_time_total / 20, 2) for e in prof.key_averages() if e.device_time_total > 0}
    buf.check()
    a2a.check()
    buf.close()
    a2a.close()
    queue.put((rank, results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="also list each variant's kernels (torch profiler)")
    ap.add_argument("--interleave", action="store_true", help="also time eager pairs of the variants alternated")
    ap.add_argument("--host-split", action="store_true", help="also the host time of each half, per variant")
    ap.add_argument("--deep-ep-scales", action="store_true",
                    help="also AllToAll with its unpack writing the scales in DeepEP's layout (3-D out_expert_x_scale)")
    ap.add_argument("--cprofile", action="store_true",
                    help="with --host-split: also a cProfile of each variant's halves on rank 0 (by own time)")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.reps, args.profile, args.interleave,
                                             args.host_split, args.deep_ep_scales, args.cprofile, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    summary = {"config": {"ranks": args.ranks, "T": T, "H": H, "experts": E, "top_k": K, "reps": args.reps,
                          "gpu": torch.cuda.get_device_name(0)}, "per_rank": [got[r] for r in range(args.ranks)]}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
