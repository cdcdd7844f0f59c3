"""Each kernel of one CUDA-graph call, per wire variant (issue 32's levers): where the time of a variant goes.
Ranks of one node on this GPU (run under MPS for kernel waits: `nvidia-cuda-mps-control -d`):

    python3 benchmarks/gpu/wire_kernels.py --world 2 --preset decode --out RESULTS.json [--wires per_route,...]
        [--node N --transport emulated]   # simulated nodes of N ranks (proxies; MOE_A2A_EMULATED_NIC caps the wire)
        [--set triton_kernels.rank_rows.REDUCE_ROWS_PER_TILE=(4,8) ...]  # a kernel variant, in every rank

Prints, per variant, rank 0's kernels in launch order with the median GPU time of each position (torch profiler
over graph replays; `_timing.kernel_positions`), then each position's slowest rank. A data kernel's time starts
after its separate wait kernel (ranks sharing a GPU wait apart), so it is its own work, not its peers'. The JSON
keeps rank 0's positions under "kernels" and every rank's under "ranks".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _apply_sets(sets):
    """`module.ATTR=VALUE` (a Python literal) under moe_a2a, set in this rank before its first launch: a kernel
    variant (launch shapes are read from module constants when a launch is first made)."""
    import ast
    import importlib

    for item in sets:
        target, _, value = item.partition("=")
        mod, _, attr = target.rpartition(".")
        module = importlib.import_module("moe_a2a." + mod)
        getattr(module, attr)  # a name that is not there is a typo, not a variant
        setattr(module, attr, ast.literal_eval(value))


def _slowest(rows):
    """Per launch position every rank has: (name, the largest of the ranks' median µs, the rank that took it)."""
    return [(at[0][0], *max((us, r) for r, (_, us) in enumerate(at))) for at in zip(*rows)]


def _rank(a2a, rank, reps, sets=()):
    import torch

    _apply_sets(sets)

    from _timing import kernel_positions
    from moe_a2a.bench.demo import call_tensors, rank_weights

    x, xs, idx, w, num, ex, exs, y, out = call_tensors(a2a, rank, 7)
    kw = rank_weights(a2a.cfg, w)

    def step():
        a2a.dispatch(num, ex, exs, x, xs, idx, **kw)
        a2a.combine(out, idx, w, y)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    return kernel_positions(graph.replay, reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--node", type=int, default=None, help="ranks a simulated node (default: all: one node)")
    p.add_argument("--transport", default="auto", help="between simulated nodes (e.g. emulated)")
    p.add_argument("--preset", choices=("decode", "prefill"), default="decode")
    p.add_argument("--wires", default="per_route,per_rank_dispatch,sender_reduced,fp8_combine,sender_reduced_fp8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--out", default=None)
    p.add_argument("--set", action="append", default=[], metavar="module.ATTR=VALUE",
                   help="a module constant under moe_a2a set in every rank before its first launch (a kernel "
                        "variant: e.g. triton_kernels.rank_rows.REDUCE_ROWS_PER_TILE=(4,8))")
    a = p.parse_args(argv)

    import torch

    from moe_a2a import LocalCluster
    from moe_a2a.bench.kernels import PRESETS
    from moe_a2a.config import A2AConfig, wire_config

    results, every_rank = {}, {}
    for wire in a.wires.split(","):
        base = A2AConfig(**PRESETS[a.preset], in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16)
        cfg = wire_config(base, wire)
        try:
            with LocalCluster(cfg, world_size=a.world, node_size=a.node or a.world, transport=a.transport,
                              device="cuda", timeout_s=a.timeout, gpu_wait="kernel") as cl:
                rows = cl.run(_rank, a.reps, a.set)
            results[wire], every_rank[wire] = rows[0], rows
            print(wire, json.dumps(rows[0]))
            print(wire, "slowest rank a position", json.dumps(_slowest(rows)))
        except Exception as e:  # noqa: BLE001 - one variant's failure is its result
            results[wire] = f"{type(e).__name__}: {str(e)[:300]}"
            print(wire, json.dumps(results[wire]))
    if a.out:
        Path(a.out).write_text(json.dumps({"world": a.world, "node": a.node or a.world, "transport": a.transport,
                                           "preset": a.preset, "set": a.set, "kernels": results,
                                           "ranks": every_rank}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
