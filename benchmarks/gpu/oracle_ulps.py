"""How far compiled kernels' weighted sums are from `reference.combine`, in ulps of out_dtype.

    python3 benchmarks/gpu/oracle_ulps.py [--world 2] [--calls 8] [--out RESULTS.json]

The end-to-end oracle (`moe_a2a.oracle`) allows one ulp on a GPU, where the compiler may fuse the
kernel's `acc + w * y` into an FMA, and none on the CPU. This runs the demo's rank function (DeepSeek-V3
decode sizes, fp8 with scales, and a bf16 config) on a LocalCluster on this GPU and counts the elements
of every combined token at each ulp distance from the reference; it also runs the whole oracle (counts,
rows and untouched padding bitwise). `docs/benchmarks.md` quotes the result.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from moe_a2a import A2AConfig, LocalCluster, reference
    from moe_a2a.bench.demo import rank_roundtrip
    from moe_a2a.oracle import check_against_reference, toy_expert, ulp_distance

    configs = {
        "decode-fp8": A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=7168,
                                in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16),
        "bf16-pad8": A2AConfig(max_num_tokens=64, num_experts=32, experts_per_token=6, hidden_dim=2048,
                               in_dtype=torch.bfloat16, out_dtype=torch.bfloat16, expert_padding=8),
    }
    report = {"device": torch.cuda.get_device_name(0), "world": args.world, "calls": args.calls, "configs": {}}
    for name, cfg in configs.items():
        with LocalCluster(cfg, world_size=args.world, node_size=args.world, transport="shm", device="cuda",
                          timeout_s=120) as cl:
            results = cl.run(rank_roundtrip, cfg.max_num_tokens, 11, args.calls, "random")
        hist: Counter = Counter()
        for it in range(args.calls):
            calls = [res["calls"][it] for res in results]
            ref = reference.dispatch(cfg, [c["x"] for c in calls], [c["x_scale"] for c in calls] if cfg.has_scales
                                     else None, [c["indices"] for c in calls])
            outs = reference.combine(cfg, [c["indices"] for c in calls], [c["weights"] for c in calls],
                                     [toy_expert(ex, exs, cfg) for _, ex, exs in ref])
            for c, want in zip(calls, outs):
                values, counts = ulp_distance(c["out"], want).flatten().unique(return_counts=True)
                hist.update(dict(zip(values.tolist(), counts.tolist())))
        problems = check_against_reference(cfg, results)
        by_ulps = {str(k): v for k, v in sorted(hist.items())}
        report["configs"][name] = {"config": repr(cfg), "elements_by_ulps": by_ulps, "oracle_problems": problems}
        print(name, dict(sorted(hist.items())), "oracle:", problems or "all match")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
