"""The `moe-a2a` command: `doctor` (is this host ready?), `demo` (a checked local cluster), `sizes` (the
buffers one rank holds for given sizes) and `bench` (benchmarks)."""
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
    from .bench.main import WIRE_CHOICES
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
    demo.add_argument("--wire", default="per_route", choices=WIRE_CHOICES,
                      help="how rows travel (reference.WIRE_VARIANTS: A2AConfig's dispatch_rows, combine_rows, "
                           "combine_fp8; relay / relay_fp8 add A2AConfig.relay; A2AConfig's docstring says where "
                           "each works); default per_route")
    demo.set_defaults(error=demo.error)

    sizes = sub.add_parser(
        "sizes", help="bytes one rank's instance holds (send, recv, segment; GPU and host memory) for given "
                      "sizes, beside the DeepEP facade's get_low_latency_rdma_size_hint",
        description="One rank's buffers for an A2AConfig of these sizes (runtime/traffic.py: buffer_bytes) per "
                    "placement, and what moe_a2a.compat's Buffer.get_low_latency_rdma_size_hint(tokens, hidden, "
                    "world, experts) returns for the same shapes (the facade's instances: two bf16 and two fp8, "
                    "top-k 8; not DeepEP's own formula). Nothing is allocated.")
    sizes.add_argument("--tokens", type=t.positive_int, default=128, help="max tokens per rank per call (default 128)")
    sizes.add_argument("--hidden", type=t.positive_int, default=7168, help="hidden size H (default 7168)")
    sizes.add_argument("--experts", type=t.positive_int, default=256,
                       help="experts E, divisible by --world (default 256)")
    sizes.add_argument("--topk", type=t.positive_int, default=8, help="experts per token K (default 8)")
    sizes.add_argument("--world", type=t.positive_int, default=8, help="ranks W (default 8)")
    sizes.add_argument("--node-size", type=t.positive_int, default=None,
                       help="ranks per node, divides --world (default: every rank on one node)")
    sizes.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"],
                       help="dispatch payload: bf16, or fp8 e4m3 with an fp32 scale per 128 (default bf16); "
                            "the combine is bf16")
    sizes.add_argument("--wire", default="per_route", choices=WIRE_CHOICES,
                       help="how rows travel (as `moe-a2a bench e2e --wire`): per-rank rows shrink the buffers, the "
                            "relay adds its fp32 partial region (default per_route)")
    sizes.add_argument("--proxies", type=t.positive_int, default=1,
                       help="proxy processes a rank (default 1; under the relay each write is in a piece per proxy, "
                            "and the segment's write tables hold them)")
    sizes.add_argument("--json", action="store_true", help="print the report as JSON")
    sizes.set_defaults(error=sizes.error)

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

    return run_demo(args.world_size, args.node_size, args.transport, args.device, args.iters, args.timeout, args.wire)


def _run_doctor(args) -> int:
    from . import doctor

    if 256 % args.world:
        args.error(f"--world {args.world} must divide the 256 experts of the sized configuration")
    if args.world % args.node:
        args.error(f"--node {args.node} must divide --world {args.world}")
    return doctor.run(args)


def _mib(n: int) -> str:
    return f"{n:>15,} B  {n / 2**20:>10.1f} MiB"


def _run_sizes(args) -> int:
    import json

    import torch

    from .compat.deep_ep import Buffer
    from .config import A2AConfig, wire_config
    from .protocol.words import MAX_PROXY_SHARDS
    from .runtime.traffic import sizes_report

    node = args.node_size or args.world
    if args.world % node:
        args.error(f"--node-size {node} must divide --world {args.world}")
    cfg = A2AConfig(max_num_tokens=args.tokens, num_experts=args.experts, experts_per_token=args.topk,
                    hidden_dim=args.hidden, in_dtype=torch.float8_e4m3fn if args.dtype == "fp8" else torch.bfloat16,
                    out_dtype=torch.bfloat16)
    cfg = wire_config(cfg, args.wire)
    if args.proxies > MAX_PROXY_SHARDS:
        args.error(f"--proxies must be at most {MAX_PROXY_SHARDS}, got {args.proxies}")
    rep = sizes_report(cfg, args.world, node, args.proxies)
    # The facade's own instances for these shapes (compat/_slots.instance_bytes), not DeepEP's formula.
    rep["deep_ep_facade_hint_bytes"] = Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, args.world,
                                                                             args.experts)
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0
    rows = rep["rows"]
    print(f"moe-a2a sizes: {args.world} ranks, {node} per node; {cfg}")
    print(f"  rows: dispatch {rows['dispatch_stride_bytes']} B, combine {rows['combine_stride_bytes']} B, count row "
          f"{rows['count_row_bytes']} B; private rows per sender {rows['private_rows']}")
    first = next(iter(rep["placements"].values()))
    print(f"  send buffer  {_mib(first['send_bytes'])}\n  recv buffer  {_mib(first['recv_bytes'])}")
    if rows.get("relay_partial_bytes"):
        print(f"    of which the relay's fp32 partials (send buffer) {_mib(rows['relay_partial_bytes'])}")
    if rows.get("row_plan_bytes"):
        print(f"  row plan     {_mib(rows['row_plan_bytes'])}  (the expand's expert rows of each received row, "
              f"for the reduce at the experts' rank; on the device)")
    print(f"  write tables {_mib(rep['write_table_bytes'])}  (in the segment; {args.proxies} proxies a rank)")
    print("  one rank, per placement (AllToAll(buffers=...); on a GPU):")
    for name, b in rep["placements"].items():
        print(f"    {name:<7} GPU {_mib(b['device_bytes'])}   host (segment) {_mib(b['host_bytes'])}")
    print(f"  DeepEP facade: Buffer.get_low_latency_rdma_size_hint({args.tokens}, {args.hidden}, {args.world}, "
          f"{args.experts}) = {_mib(rep['deep_ep_facade_hint_bytes']).strip()}\n"
          f"    (moe_a2a.compat's own instances for these shapes: two bf16 and two fp8, top-k 8, capacity "
          f"tokens x world per expert; not DeepEP's formula)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a bad flag: one argparse line, exit 2
    try:
        if args.command == "doctor":
            return _run_doctor(args)
        if args.command == "demo":
            return _run_demo(args)
        if args.command == "sizes":
            return _run_sizes(args)
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
