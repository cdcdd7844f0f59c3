"""Launch constants of the data kernels swept on one GPU: each (preset, wire, constants) a CUDA-graph call of
WORLD ranks of one node (default 2; run under MPS), rank 0's kernels timed per position as `wire_kernels.py`
reports them.

    python3 benchmarks/gpu/sweep_launch.py RESULTS.json [tiles|reduce-setup|reduce-probes] [WORLD]

The constants are module attributes set in each rank before its first call (e.g. `_launch.ROWS_PER_TILE`,
`rank_rows.MAX_REDUCE_BLOCK_H`); the plan is the list in `main`. One JSON record per entry, written as it goes.
`tiles` (default): the numbers behind `rank_rows.EXPAND_ROWS_PER_TILE` / `REDUCE_ROWS_PER_TILE`
(docs/perf-notes.md). `reduce-setup`: the reduce by source with and without the expand's row plan and the
GPU-scope arrival, beside the route rows' pack; `reduce-probes` adds where the reduce's time goes (timing only;
these variants compute wrong sums): its launch shape replaced (`@grid:G_DIV,CHUNKS`: a G_DIV-th of the persistent programs,
CHUNKS hidden chunks, 0 = as now) or its expert loads dropped (`@no_loads`: every route row out of range), so
the per-program set-up (pair tables, places, the epilogue's arrival) is told apart from the row work; the reduce
without the expand's row plan (`rank_rows.REDUCE_FROM_PLAN = False`: the pair tables in every program); and the
arrival of every data kernel's programs (`_details.node_arrive_of`, one system-scope fence a program) at GPU
scope (`@arrive_gpu`: the last program alone fences system-wide; a timing probe, not yet a tested ordering).
The runs of 2026-12-06 (docs/results/gpu-tests-2026-12-06/reduce_probe_h200/) also had `@arrive_relaxed`, the
one-fence arrival the kernels now have, against the two fences they had then.
"""
import importlib
import json
import sys
import time
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wire_kernels  # noqa: E402
from moe_a2a.triton_kernels import _details as d  # noqa: E402


@triton.jit
def _arrive_gpu(counter_ptr, num, USE_PTX: tl.constexpr):
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == num - 1
    if last:
        d.fence_sys(USE_PTX)
        tl.store(counter_ptr, 0)
    return last


def _reduce_shape(g_div, chunks):
    from moe_a2a.triton_kernels import rank_rows
    shape = rank_rows.reduce_launch_shape

    def patched(cfg, layout, device):
        (g, c), block_r, block_h, fp8, no_fma = shape(cfg, layout, device)
        return (max(1, g // g_div), chunks or c), block_r, block_h, fp8, no_fma
    return patched


def _no_loads():
    from moe_a2a.triton_kernels import rank_rows
    launch = rank_rows._BY_SOURCE.launch

    def patched(key, grid, expert_y, counts, rank_rows_, base, psb, prb, recv, stage, rank, R, *a, **kw):
        return launch(key, grid, expert_y, counts, rank_rows_, base, psb, prb, recv, stage, rank, 0, *a, **kw)
    return patched


def _resolve(value):
    """A patch value, or `@grid:G_DIV,CHUNKS` / `@no_loads`: the reduce-setup probes' replacements."""
    if isinstance(value, str) and value.startswith("@grid:"):
        return _reduce_shape(*(int(v) for v in value[len("@grid:"):].split(",")))
    if value == "@no_loads":
        return _no_loads()
    if value == "@arrive_gpu":
        return _arrive_gpu
    return value


def _rank_patched(a2a, rank, reps, patches):
    for target, value in patches.items():
        mod, attr = target.split(":")
        obj = importlib.import_module(mod)
        for part in attr.split(".")[:-1]:
            obj = getattr(obj, part)
        setattr(obj, attr.split(".")[-1], _resolve(value))
    return wire_kernels._rank(a2a, rank, reps)


def main():
    import torch
    from moe_a2a import LocalCluster
    from moe_a2a.bench.kernels import PRESETS
    from moe_a2a.config import A2AConfig, wire_config
    L = "moe_a2a.triton_kernels._launch:"
    RR = "moe_a2a.triton_kernels.rank_rows:MAX_REDUCE_BLOCK_H"
    SHAPE, BY = "moe_a2a.triton_kernels.rank_rows:reduce_launch_shape", "moe_a2a.triton_kernels.rank_rows:_BY_SOURCE.launch"
    which = sys.argv[2] if len(sys.argv) > 2 else "tiles"
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    ARR = "moe_a2a.triton_kernels._details:node_arrive_of"
    NO_PLAN = {"moe_a2a.triton_kernels.rank_rows:REDUCE_FROM_PLAN": False}
    plan = [
        ("decode", "per_route", {}), ("decode", "sender_reduced", {}), ("decode", "sender_reduced", NO_PLAN),
        ("decode", "sender_reduced", {ARR: "@arrive_gpu", **NO_PLAN}), ("prefill", "sender_reduced", {}),
        ("prefill", "sender_reduced", NO_PLAN), ("decode", "sender_reduced", {ARR: "@arrive_gpu"}),
        ("decode", "per_route", {ARR: "@arrive_gpu"}), ("prefill", "per_route", {}),
    ] + ([("decode", "sender_reduced", {SHAPE: "@grid:1,1"}), ("decode", "sender_reduced", {SHAPE: "@grid:4,0"}),
          ("decode", "sender_reduced", {BY: "@no_loads"})] if which == "reduce-probes" else []) \
        if which in ("reduce-setup", "reduce-probes") else [
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
            with LocalCluster(cfg, world_size=world, node_size=world, device="cuda", timeout_s=30, gpu_wait="kernel") as cl:
                rows = cl.run(importlib.import_module("sweep_launch")._rank_patched, 20, patches)  # by reference: __main__ pickles by value
            res = rows[0]
        except Exception as e:  # noqa: BLE001
            res = f"{type(e).__name__}: {str(e)[:300]}"
        rec = {"world": world, "preset": preset, "wire": wire, "patches": patches, "kernels": res, "s": round(time.time() - t0, 1)}
        print(json.dumps(rec), flush=True)
        out.append(rec)
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
