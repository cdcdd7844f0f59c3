"""The GPU -> proxy process -> GPU flag round trip through pinned host memory: one Triton program raises
PING = i in a shared page and spins until a plain Python process (numpy on the page, as the proxy reads
its flags) answers PONG = i; the kernel is timed with CUDA events, per round trip (GPU).

    python -m benchmarks.flags --iters 2000 --reps 10 --json flags.json     (from the repository root)
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from moe_a2a.bench._util import positive_int, refuse_without_cuda, write_json


def stats(samples: list[float]) -> dict:
    s = sorted(samples)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]
    return {"median": statistics.median(s), "p10": q(0.1), "p90": q(0.9), "min": s[0], "max": s[-1], "n": len(s)}


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flag round trip's options."""
    ap.add_argument("--iters", type=positive_int, default=2000, help="round trips per kernel (default 2000)")
    ap.add_argument("--reps", type=positive_int, default=20, help="kernels timed (default 20)")
    ap.add_argument("--json", default=None, help="write results here")
    return ap


def run_args(args) -> int:
    if rc := refuse_without_cuda("python -m benchmarks.flags"):
        return rc

    import torch
    import triton
    import triton.language as tl

    from moe_a2a.protocol.memory import SharedSegment, device_view, unique_name
    from moe_a2a.triton_kernels import _details as d

    timeout_ns = 30 * 10**9  # the whole kernel: a dead echo process ends it instead of hanging the GPU

    @triton.jit
    def ping_kernel(flags_ptr, n_iters, timeout_ns):
        # One program: raise PING = i, spin until the other process answers PONG = i. Measures the
        # round trip alone, without launch costs in between. Past the deadline every wait gives up at
        # once (the host then finds PONG short of n_iters).
        deadline = d.globaltimer_ns() + timeout_ns
        for i in range(1, n_iters + 1):
            v = i.to(tl.int64)
            tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                                      [flags_ptr, v], dtype=tl.int32, is_pure=False, pack=1)
            seen = d.load_acquire_sys(flags_ptr + 1, True)
            while (seen < v) & (d.globaltimer_ns() < deadline):
                seen = d.load_acquire_sys(flags_ptr + 1, True)

    seg = SharedSegment(unique_name("moe_a2a-bench"), 4096, create=True)
    echo = None
    try:
        seg.register_cuda()
        flags = device_view(seg.addr, 4096, torch.device("cuda")).view(torch.int64)
        echo = subprocess.Popen([sys.executable, "-c", _ECHO, seg.name, str(args.iters + 100)])
        time.sleep(0.5)
        ping_kernel[(1,)](flags, 100, timeout_ns)  # warm-up (compiles) with the echo process running
        torch.cuda.synchronize()
        seg.numpy(0, 2, "int64")[:] = 0
        time.sleep(0.05)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(args.reps):
            seg.numpy(0, 2, "int64")[:] = 0
            time.sleep(0.01)
            start.record()
            ping_kernel[(1,)](flags, args.iters, timeout_ns)
            end.record()
            end.synchronize()
            if int(seg.numpy(8, 1, "int64")[0]) != args.iters:
                raise TimeoutError(f"benchmarks.flags: the echo process answered {int(seg.numpy(8, 1, 'int64')[0])} "
                                   f"of {args.iters} pings within {timeout_ns / 1e9:g}s")
            samples.append(start.elapsed_time(end) * 1e3 / args.iters)
    finally:
        if echo is not None:
            echo.kill()
        seg.close()
    st = stats(samples)
    print(f"GPU -> proxy process -> GPU flag round trip: median {st['median']:.2f} µs "
          f"(min {st['min']:.2f}, p90 {st['p90']:.2f}) over {args.reps} x {args.iters} round trips")
    write_json(args.json, {"flag_round_trip_us": st})
    return 0


# The echo process: plain Python + numpy on the shared page, as the proxy reads its flags.
_ECHO = """
import os, sys, numpy as np
from moe_a2a.protocol.memory import SharedSegment
seg = SharedSegment(sys.argv[1]); f = seg.numpy(0, 2, np.int64)
parent, n = os.getppid(), 0
while True:
    v = f[0]
    if v != f[1]:
        f[1] = v
    n += 1
    if n % 65536 == 0 and os.getppid() != parent:
        break  # the benchmark is gone
"""


def main(argv: list[str] | None = None) -> int:
    from ._cli import main as cli_main

    return cli_main("flags", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
