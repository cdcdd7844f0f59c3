"""Timing helpers of the GPU benchmarks (the device method: warm-up, CUDA events, median)."""
from __future__ import annotations

import statistics

import torch


def median_us(fn, reps: int = 200, warmup: int = 10) -> float:
    """Median of `reps` calls of `fn`, µs, CUDA events around each, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def kernel_positions(fn, reps: int = 20) -> list[tuple[str, float]]:
    """The kernels one call of `fn` runs, in launch order, with the median GPU time (µs) of each position
    over `reps` calls (torch profiler): kernels that share a name (a send and a receive compiled under
    one symbol) are told apart by their position."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    n = len(events) // reps
    return [(events[i].name[:50], round(statistics.median(events[r * n + i].time_range.elapsed_us()
                                                           for r in range(reps)), 2)) for i in range(n)]
