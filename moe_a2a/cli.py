"""The `moe-a2a` command: `doctor` (is this host ready?), `demo` (a checked local cluster) and `bench`
(benchmarks)."""
from __future__ import annotations

import argparse
import sys


def demo_device(text: str) -> str:
    """`demo --device`, as LocalCluster takes it: "cpu:N" is "cpu" (any case); "cuda:N" is refused, since
    the demo's ranks go to GPU i % num_gpus (CUDA_VISIBLE_DEVICES picks the GPUs)."""
    name, _, index = text.strip().lower().partition(":")
    if index and name == "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: the demo puts rank i on GPU i % num_gpus: pass cuda "
                                         f"(CUDA_VISIBLE_DEVICES picks the GPUs)")
    if index and name == "cpu" and index.isdigit():
        return "cpu"
    return name if not index else text


def build_parser() -> argparse.ArgumentParser:
    from .bench import _util as t
    from .bench.main import __doc__ as bench_doc
    from .bench.main import build_parser as build_bench_parser

    parser = argparse.ArgumentParser(prog="moe-a2a", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    doctor = sub.add_parser(
        "doctor", help="check this host first: libfabric, providers, EFA/verbs devices, GPU memory, NIC map, "
                       "limits, environment, each with a verdict and the fix",
        description="Checks this host for moe_a2a: the libfabric loaded, what fi_getinfo offers for tcp, shm, efa "
                    "and verbs, RDMA devices, FI_HMEM and peer memory / DMA-BUF, the GPU <-> NIC map, "
                    "RLIMIT_MEMLOCK, the largest registration against EFA's limit, and the FI_* / MOE_A2A_* "
                    "variables; each an ok / warn / fail verdict with its fix. Exit status: 0 when nothing "
                    "fails (warnings allowed), 1 when a check fails, 2 for a bad flag.")
    doctor.add_argument("--json", action="store_true", help="print the report (checks and facts) as JSON")
    doctor.add_argument("--world", type=t.positive_int, default=64,
                        help="ranks to size the registrations for (default 64; must divide 256 experts)")
    doctor.add_argument("--node", type=t.positive_int, default=8, help="ranks per node (default 8)")
    doctor.add_argument("--tokens", type=t.positive_int, default=128,
                        help="tokens per rank per call (default 128: DeepSeek-V3 decode)")
    doctor.add_argument("--facts", metavar="FILE", default=None,
                        help="check recorded facts (a --json report's 'facts', e.g. tests/data/doctor/p5_efa.json) "
                             "instead of this host")
    doctor.set_defaults(error=doctor.error)

    demo = sub.add_parser("demo", help="run dispatch -> toy expert -> combine on a local cluster, "
                                       "checked against reference.py, and print per-phase latency",
                          description="A LocalCluster on this machine: dispatch -> toy expert -> combine, "
                                      "checked against moe_a2a.reference, with the latency of each phase.")
    demo.add_argument("--world-size", type=t.positive_int, default=4, help="rank processes (default 4)")
    demo.add_argument("--node-size", type=t.positive_int, default=2,
                      help="ranks per simulated node, divides --world-size (default 2)")
    demo.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "efa"],
                      help="libfabric provider between nodes (default auto: efa if present, else shm)")
    demo.add_argument("--device", default="auto", type=demo_device, choices=["auto", "cpu", "cuda"],
                      help="cuda: DeepSeek-V3 decode sizes, rank i on GPU i %% num_gpus; cpu (or cpu:0): small "
                           "sizes, kernels in the Triton interpreter (default: cuda if available)")
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


def _run_doctor(args) -> int:
    from . import doctor

    if 256 % args.world:
        args.error(f"--world {args.world} must divide the 256 experts of the sized configuration")
    if args.world % args.node:
        args.error(f"--node {args.node} must divide --world {args.world}")
    return doctor.run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a bad flag: one argparse line, exit 2
    try:
        if args.command == "doctor":
            return _run_doctor(args)
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
