"""Ranks of one node sharing this GPU, kernel waits, each half a CUDA graph, at a preset's sizes: passes or
times out, and prints the medians. The reproduction behind docs/benchmarks.md's MPS section (run it under
MPS, e.g. from `bash benchmarks/gpu/run.sh mps`, or by hand after `nvidia-cuda-mps-control -d`):

    python3 benchmarks/gpu/mps_node_local.py --world 2 --preset decode --timeout 20 --json out.json

Before ranks sharing a GPU waited apart (2026-12-02) this timed out at decode sizes under MPS: each rank's
unpack was a persistent grid of one program per SM spinning on its peers' words, which can hold every SM
while the peer's pack waits for one (MPS does not preempt); each client held to half the SMs
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50) passed. Works with any checkout that has `bench.graph._graph_rank`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--preset", choices=("decode", "prefill"), default="decode")
    p.add_argument("--gpu-wait", default="kernel")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import torch

    from moe_a2a import LocalCluster
    from moe_a2a.bench.graph import _graph_rank
    from moe_a2a.bench.kernels import PRESETS
    from moe_a2a.config import A2AConfig

    cfg = A2AConfig(**PRESETS[a.preset], in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16)
    t0 = time.monotonic()
    out = {"world": a.world, "preset": a.preset, "gpu_wait": a.gpu_wait, "config": str(cfg)}
    try:
        with LocalCluster(cfg, world_size=a.world, node_size=a.world, device="cuda", timeout_s=a.timeout,
                          gpu_wait=a.gpu_wait) as cl:
            rows = cl.run(_graph_rank, a.iters, 5, 0)
        out.update(ok=True, dispatch_us=max(r["dispatch"]["median"] for r in rows),
                   combine_us=max(r["combine"]["median"] for r in rows))
    except Exception as e:  # the outcome is the result: say it, with how long it took
        out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
