"""The soak: many consecutive dispatch + combine calls with random routing, every result
checked, and the resources of every rank and proxy watched for growth.

Each rank computes every rank's inputs of a call from the call's seed (`demo.make_inputs`), so it can
check its own results with the end-to-end oracle (`moe_a2a.oracle`) without any exchange: counts, rows
and untouched padding bitwise, the weighted sum to its ulp bound. Every `--sample` calls it records, for
itself and its proxy process, the resident memory (VmRSS), the open file descriptors, and the machine's
/dev/shm entries. Growth is the last sample
minus the first one taken after warm-up.

    python -m benchmarks.soak --calls 10000 --world 2 --node 1 --transport shm --json soak.json

(from the repository root; the kernels run in the Triton interpreter, TRITON_INTERPRET=1 is set).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from moe_a2a.oracle import check_call, fill_sentinel, record_call, toy_expert
from moe_a2a.bench.demo import make_inputs
from moe_a2a.bench._util import nonneg_int, positive_float, positive_int, progress, write_json

ROUTINGS = ("random", "skew", "dupes")


def _resources(pid: int) -> dict:
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"rss_bytes": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _sample(a2a, call: int) -> dict:
    proxy = a2a.proxies[0].proc.pid if a2a.proxies else None
    return {"call": call, "rank": _resources(os.getpid()), "proxy": _resources(proxy) if proxy else None,
            "dev_shm": len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else None}


def _check_call(a2a, rank: int, seed: int, routing: str, call: dict) -> list[str]:
    cfg, W = a2a.cfg, a2a.world_size
    inputs = [make_inputs(cfg, r, cfg.max_num_tokens, seed, routing) + (None,) for r in range(W)]
    return check_call(cfg, inputs, {rank: call}, where=f"call {seed} ")


def soak_chunk(a2a, rank: int, first: int, count: int, warmup: int, sample_every: int, total: int) -> dict:
    """Calls `first .. first+count-1` of the soak on one rank (call i uses seed i); a resource sample
    at the first call after warm-up, every `sample_every` calls after it, and at the last call (`total` - 1)."""
    cfg, dev = a2a.cfg, a2a.device
    num, ex, exs = a2a.empty_dispatch_outputs()
    samples, problems = [], []
    start = time.perf_counter()
    for it in range(first, first + count):
        routing = ROUTINGS[it % len(ROUTINGS)] if it % 7 == 0 else "random"
        x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, cfg.max_num_tokens, it, routing))
        fill_sentinel(ex, exs)
        a2a.dispatch(num, ex, exs, x, xs, idx)
        y = toy_expert(ex, exs, cfg)
        out = torch.zeros(x.shape[0], cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
        a2a.combine(out, idx, w, y)
        problems += _check_call(a2a, rank, it, routing, record_call(cfg, x, xs, idx, w, num, ex, exs, out))
        if it >= warmup and ((it - warmup) % sample_every == 0 or it == total - 1):
            samples.append(_sample(a2a, it - warmup))
    return {"problems": problems, "samples": samples, "seconds": time.perf_counter() - start}


def run(cfg, world: int, node: int, transport: str, calls: int, warmup: int, sample_every: int,
        timeout: float, chunk: int = 100) -> dict:
    """The soak over a LocalCluster, in chunks of `chunk` calls per `LocalCluster.run` (each must end
    within the cluster's timeout); one progress bar in this process."""
    from moe_a2a.local import LocalCluster

    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    total = warmup + calls
    per_rank = [{"rank": r, "problems": [], "samples": [], "seconds": 0.0} for r in range(world)]
    with LocalCluster(cfg, world_size=world, node_size=node, transport=transport, device="cpu",
                      timeout_s=timeout) as cl:
        bar = progress(total=total, desc="soak calls")
        for first in range(0, total, chunk):
            count = min(chunk, total - first)
            for acc, part in zip(per_rank, cl.run(soak_chunk, first, count, warmup, sample_every, total)):
                acc["problems"] += part["problems"]
                acc["samples"] += part["samples"]
                acc["seconds"] += part["seconds"]
            bar.update(count)
        bar.close()
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    for acc in per_rank:
        first_s, last_s = acc["samples"][0], acc["samples"][-1]
        growth = {"rank_rss_bytes": last_s["rank"]["rss_bytes"] - first_s["rank"]["rss_bytes"],
                  "rank_fds": last_s["rank"]["fds"] - first_s["rank"]["fds"],
                  "dev_shm_entries": (last_s["dev_shm"] or 0) - (first_s["dev_shm"] or 0)}
        if first_s["proxy"] and last_s["proxy"]:
            growth.update(proxy_rss_bytes=last_s["proxy"]["rss_bytes"] - first_s["proxy"]["rss_bytes"],
                          proxy_fds=last_s["proxy"]["fds"] - first_s["proxy"]["fds"])
        acc.update(num_problems=len(acc["problems"]), problems=acc["problems"][:20], growth=growth,
                   ms_per_call=1e3 * acc["seconds"] / total)
    return {"config": str(cfg), "world": world, "node": node, "transport": transport, "calls": calls,
            "warmup": warmup, "per_rank": per_rank, "dev_shm_left_after_close": sorted(shm_after - shm_before),
            "date": time.strftime("%Y-%m-%d")}


def print_summary(res: dict) -> None:
    print(f"soak: {res['calls']} dispatch + combine calls, {res['world']} ranks ({res['node']} per node), "
          f"{res['transport']}, CPU (Triton interpreter)")
    for r in res["per_rank"]:
        g = r["growth"]
        print(f"  rank {r['rank']}: {r['num_problems']} wrong results; {r['ms_per_call']:.1f} ms per call; "
              f"growth after warm-up: rank RSS {g['rank_rss_bytes'] / 2**20:+.1f} MiB, fds {g['rank_fds']:+d}, "
              f"proxy RSS {g.get('proxy_rss_bytes', 0) / 2**20:+.1f} MiB, proxy fds {g.get('proxy_fds', 0):+d}, "
              f"/dev/shm entries {g['dev_shm_entries']:+d}")
    print(f"  left in /dev/shm after close: {res['dev_shm_left_after_close'] or 'nothing'}")


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The soak's options."""
    ap.add_argument("--calls", type=positive_int, default=10000, help="checked calls after warm-up (default 10000)")
    ap.add_argument("--warmup", type=nonneg_int, default=20, help="checked calls before the first sample (default 20)")
    ap.add_argument("--sample", type=positive_int, default=500, help="calls between resource samples (default 500)")
    ap.add_argument("--world", type=positive_int, default=2, help="ranks (default 2)")
    ap.add_argument("--node", type=positive_int, default=1, help="ranks per node (default 1: through the proxies)")
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"], help="provider (default shm)")
    ap.add_argument("--timeout", type=positive_float, default=60.0, help="seconds before any wait gives up")
    ap.add_argument("--json", default=None, help="write the results here")
    return ap


def run_args(args) -> int:
    from moe_a2a.config import A2AConfig

    if args.world % args.node:
        args.error(f"--node {args.node} must divide --world {args.world}")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Small sizes (the kernels run in the interpreter): fp8 with scales and padding, so every path moves.
    cfg = A2AConfig(max_num_tokens=8, num_experts=4 * args.world, experts_per_token=3, hidden_dim=32,
                    in_dtype=torch.float8_e4m3fn, scale_block=16, expert_padding=2)
    res = run(cfg, args.world, args.node, args.transport, args.calls, args.warmup, args.sample, args.timeout)
    print_summary(res)
    write_json(args.json, res)
    return 0 if all(r["num_problems"] == 0 for r in res["per_rank"]) and not res["dev_shm_left_after_close"] else 1


def main(argv: list[str] | None = None) -> int:
    from ._cli import main as cli_main

    return cli_main("soak", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
