"""The DeepEP facade's own Python per dispatch + combine pair: `Buffer` calls with its `AllToAll` halves
stubbed out, so only the facade's code runs (decode sizes, one rank, fp8 calls).

    python3 benchmarks/facade_python.py [--device cpu|cuda] [--profile]

Builds a `moe_a2a.compat.Buffer` (shm, one rank), makes one real call, then replaces every instance's
`dispatch` and `combine` by no-ops and times 20 x 1000 pairs: the median and the fastest thousand, µs
per pair. `--profile`: the facade's frames by own time (cProfile, 20 000 pairs). `docs/perf-notes.md`
has the numbers; `benchmarks/gpu/facade_cost.py --host-split` measures the same cost in place.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import socket
import statistics
import time

import torch
import torch.distributed as dist

T, H, E, K = 128, 7168, 288, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from moe_a2a.compat import Buffer

    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    y = torch.zeros(E, T, H, dtype=torch.bfloat16, device=dev)
    with Buffer(None, transport="shm", device=dev, timeout_s=60.0) as buf:
        buf.low_latency_combine(y, idx, w, buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2], out=out)
        for slot in buf._slots:
            for a2a in slot.instances.values():
                a2a.dispatch = a2a.combine = lambda *a, **k: None

        def pair():
            handle = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2]
            buf.low_latency_combine(y, idx, w, handle, out=out)

        for _ in range(1000):
            pair()
        batches = []
        for _ in range(20):
            t0 = time.perf_counter()
            for _ in range(1000):
                pair()
            batches.append((time.perf_counter() - t0) * 1e3)  # ms per 1000 pairs = µs per pair
        print(f"{dev}: the facade's Python per pair: median {statistics.median(batches):.2f} µs, "
              f"fastest thousand {min(batches):.2f} µs")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20000):
                pair()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
            print(text.getvalue())
        for slot in buf._slots:  # the real halves again, so that close() ends the instances cleanly
            for a2a in slot.instances.values():
                del a2a.dispatch, a2a.combine


if __name__ == "__main__":
    main()
