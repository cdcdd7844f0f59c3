"""The `moe-a2a` command: `demo` (a checked local cluster) and `bench` (benchmarks)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-a2a", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run dispatch -> toy expert -> combine on a local cluster, "
                                       "checked against reference.py, and print per-phase latency")
    demo.add_argument("--world-size", type=int, default=4, help="rank processes (default 4)")
    demo.add_argument("--node-size", type=int, default=2, help="ranks per simulated node (default 2)")
    demo.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "efa"],
                      help="libfabric provider between nodes (default auto: efa if present, else shm)")
    demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                      help="cuda: DeepSeek-V3 decode sizes; cpu: small sizes, kernels in the Triton "
                           "interpreter (default: cuda if available)")
    demo.add_argument("--iters", type=int, default=None, help="calls per rank (default 3 on CPU, 20 on GPU)")
    demo.add_argument("--timeout", type=float, default=60.0, help="seconds before any wait gives up")

    bench = sub.add_parser("bench", help="benchmarks (see `moe-a2a bench --help`)", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    if args.command == "demo":
        import os

        if args.device == "cpu" or (args.device == "auto" and not _has_cuda()):
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from .demo import run_demo

        return run_demo(args.world_size, args.node_size, args.transport, args.device, args.iters, args.timeout)
    from .bench import main as bench_main

    return bench_main(args.rest)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
