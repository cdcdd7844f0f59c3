"""Launch constants of the data kernels swept on one GPU: each (preset, wire, constants) a CUDA-graph call of 2
ranks of one node (run under MPS), its kernels timed per position as `wire_kernels.py` reports them.

    python3 benchmarks/gpu/sweep_launch.py RESULTS.json

The constants are module attributes set in each rank before its first call (e.g. `_launch.ROWS_PER_TILE`,
`rank_rows.MAX_REDUCE_BLOCK_H`); the plan is the list in `main`. One JSON record per entry, written as it goes.
The numbers behind `rank_rows.EXPAND_ROWS_PER_TILE` / `REDUCE_ROWS_PER_TILE` (docs/perf-notes.md).
"""
import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wire_kernels  # noqa: E402


def _rank_patched(a2a, rank, reps, patches):
    for target, value in patches.items():
        mod, attr = target.split(":")
        setattr(importlib.import_module(mod), attr, value)
    return wire_kernels._rank(a2a, rank, reps)


def main():
    import torch
    from moe_a2a import LocalCluster
    from moe_a2a.bench.kernels import PRESETS
    from moe_a2a.config import A2AConfig, wire_config
    L = "moe_a2a.triton_kernels._launch:"
    RR = "moe_a2a.triton_kernels.rank_rows:MAX_REDUCE_BLOCK_H"
    plan = [
        ("decode", "fp8_combine", {}), ("prefill", "fp8_combine", {}),
        ("decode", "sender_reduced_fp8", {}), ("prefill", "sender_reduced_fp8", {}),
        ("decode", "sender_reduced", {}), ("decode", "sender_reduced", {L + "ROWS_PER_TILE": 2}),
        ("decode", "sender_reduced", {L + "ROWS_PER_TILE": 4}), ("decode", "sender_reduced", {RR: 512}),
        ("decode", "sender_reduced", {RR: 2048}), ("decode", "per_route", {L + "ROWS_PER_TILE": 4}),
        ("prefill", "sender_reduced", {}), ("prefill", "sender_reduced", {L + "ROWS_PER_TILE_LARGE": 8}),
        ("prefill", "sender_reduced", {L + "ROWS_PER_TILE_LARGE": 32}), ("prefill", "sender_reduced", {RR: 2048}),
    ]
    out = []
    for preset, wire, patches in plan:
        t0 = time.time()
        cfg = wire_config(A2AConfig(**PRESETS[preset], in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16), wire)
        try:
            with LocalCluster(cfg, world_size=2, node_size=2, device="cuda", timeout_s=30, gpu_wait="kernel") as cl:
                rows = cl.run(_rank_patched, 20, patches)
            res = rows[0]
        except Exception as e:  # noqa: BLE001
            res = f"{type(e).__name__}: {str(e)[:300]}"
        rec = {"preset": preset, "wire": wire, "patches": patches, "kernels": res, "s": round(time.time() - t0, 1)}
        print(json.dumps(rec), flush=True)
        out.append(rec)
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
