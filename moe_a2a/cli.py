"""The `moe-a2a` command: `demo` (a checked local cluster) and `bench` (benchmarks)."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from .bench import _util as t
    from .bench.main import __doc__ as bench_doc
    from .bench.main import build_parser as build_bench_parser

    parser = argparse.ArgumentParser(prog="moe-a2a", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run dispatch -> toy expert -> combine on a local cluster, "
                                       "checked against reference.py, and print per-phase latency",
                          description="A LocalCluster on this machine: dispatch -> toy expert -> combine, "
                                      "checked against moe_a2a.reference, with the latency of each phase.")
    demo.add_argument("--world-size", type=t.positive_int, default=4, help="rank processes (default 4)")
    demo.add_argument("--node-size", type=t.positive_int, default=2,
                      help="ranks per simulated node, divides --world-size (default 2)")
    demo.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "efa"],
                      help="libfabric provider between nodes (default auto: efa if present, else shm)")
    demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                      help="cuda: DeepSeek-V3 decode sizes; cpu: small sizes, kernels in the Triton "
                           "interpreter (default: cuda if available)")
    demo.add_argument("--iters", type=t.positive_int, default=None,
                      help="calls per rank (default 3 on CPU, 20 on GPU)")
    demo.add_argument("--timeout", type=t.positive_float, default=60.0, help="seconds before any wait gives up")
    demo.set_defaults(error=demo.error)

    bench = sub.add_parser("bench", help="benchmarks (see `moe-a2a bench --help`)",
                           description=bench_doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    build_bench_parser(bench)
    return parser


def _run_demo(args) -> int:
    import os

    from .bench._util import has_cuda, refuse_without_cuda

    if args.world_size % args.node_size:
        args.error(f"--node-size {args.node_size} must divide --world-size {args.world_size}")
    if args.device == "cuda" and (rc := refuse_without_cuda("moe-a2a demo --device cuda")):
        return rc
    if args.device == "cpu" or (args.device == "auto" and not has_cuda()):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .bench.demo import run_demo

    return run_demo(args.world_size, args.node_size, args.transport, args.device, args.iters, args.timeout)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a bad flag: one argparse line, exit 2
    try:
        if args.command == "demo":
            return _run_demo(args)
        from .bench.main import run_args

        return run_args(args)
    except ValueError as e:  # a configuration the library refuses (e.g. a missing provider): the user's mistake
        print(f"moe-a2a: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moe-a2a: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
