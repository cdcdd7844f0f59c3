"""Why the Python cost per posted write has a median twice its minimum on the GPU host (docs/benchmarks.md):
the same micro-benchmark as `benchmarks.transport` (fi_writemsg replaced by a no-op, 63 targets, shm),
under variants that remove one suspect each: Python's cyclic GC, the process moving between cores, and
a short run against a long one. Prints the median and minimum per write of each (the result and its
reading: docs/perf-notes.md).

`python3 benchmarks/gpu/post_jitter.py [out.json]`
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

from benchmarks import transport


def _run(label: str, iters: int = 3000) -> dict:
    t0 = time.perf_counter()
    res = transport.bench_python_post_cost("shm", 63, iters)
    res.update(label=label, wall_s=time.perf_counter() - t0)
    return res


def main(out: str | None) -> None:
    rows = [_run("as is")]
    gc.disable()
    rows.append(_run("gc disabled"))
    gc.enable()
    cpu = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {cpu})
    rows.append(_run(f"pinned to cpu {cpu}"))
    gc.disable()
    rows.append(_run(f"pinned to cpu {cpu}, gc disabled"))
    rows.append(_run(f"pinned, gc disabled, 20000 iterations", 20000))
    for r in rows:
        print(f"{r['label']:<40} median {r['python_us_per_write_median']:.2f} µs   min "
              f"{r['python_us_per_write_min']:.2f} µs   ({r['wall_s']:.1f} s)")
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
