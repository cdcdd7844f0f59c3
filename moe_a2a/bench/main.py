"""`moe-a2a bench`: benchmarks that write JSON and PNG and print a table (docs/design.md, "Benchmarks").

    moe-a2a bench kernels   --preset decode|prefill|both --world 64 --node 8     (GPU)
    moe-a2a bench e2e       --world 4 --node 2 --preset decode --transport shm    (LocalCluster)
                            [--wire per_route|per_rank_dispatch|sender_reduced|fp8_combine|sender_reduced_fp8]
    moe-a2a bench timeline  one traced call drawn as a Gantt chart (GPU / proxy / wire lanes)
    moe-a2a bench nccl      the torch.distributed all_to_all_single baseline (moe_a2a.bench.nccl)

The maintainers' instruments (the proxy alone, libfabric costs, the soak, the flag round trip) are
`python -m benchmarks.<name>` from the repository root (docs/benchmarks.md).

Every timing is a median over many calls after warm-up; JSON files keep p10/p90/min/max too.
Nothing is written unless asked (--json, --png), except `timeline`'s chart (default ./timeline.png).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from ..config import WIRES
from ._util import nonneg_int, positive_float, positive_int, progress, refuse_without_cuda
from ._util import write_json as _write


# The wires by name (`config.WIRES`, importable without torch): issue 32's levers (reference.WIRE_VARIANTS) and
# issue 46's relay over the sender-reduced rows; together the choices of --wire.
WIRE_NAMES = tuple(name for name, (*_, relay) in WIRES.items() if not relay)
RELAY_WIRE_NAMES = tuple(name for name, (*_, relay) in WIRES.items() if relay)
WIRE_CHOICES = WIRE_NAMES + RELAY_WIRE_NAMES


def _stats(samples: list[float]) -> dict:
    s = sorted(samples)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]
    return {"median": statistics.median(s), "p10": q(0.1), "p90": q(0.9), "min": s[0], "max": s[-1], "n": len(s)}


# ---- kernels ------------------------------------------------------------------------------------------
def run_kernels(args) -> int:
    from .kernels import bench_kernels, format_table, launcher_overhead

    if not args.launchers and (rc := refuse_without_cuda("moe-a2a bench kernels")):
        return rc
    if args.launchers:
        res = launcher_overhead()
        print("Python cost per launcher call, kernel launch stubbed out (decode sizes, µs):")
        for name, us in res.items():
            print(f"  {name:<26}{us:>8.1f}")
        _write(args.json, {"launcher_python_us": res})
        return 0

    presets = ["decode", "prefill"] if args.preset == "both" else [args.preset]
    results = []
    for p in presets:  # bench_kernels shows the (one) progress bar
        res = bench_kernels(p, world=args.world, node=args.node, iters=args.iters)
        print(format_table(res), flush=True)
        results.append(res)
    _write(args.json, {"kernels": results})
    if args.png:
        _plot_kernels(results, args.png)
    return 0


def _plot_kernels(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results):
        names = list(res["kernels"])
        tri = [res["kernels"][n]["triton"]["median_us"] for n in names]
        tor = [res["kernels"][n].get("torch", {}).get("median_us", 0) for n in names]
        flo = [res["kernels"][n]["floor_us"] for n in names]
        xs = range(len(names))
        ax.bar([x - 0.27 for x in xs], tor, 0.27, label="plain torch")
        ax.bar(xs, tri, 0.27, label="moe_a2a Triton")
        ax.bar([x + 0.27 for x in xs], flo, 0.27, label="floor (bytes/BW + launch)")
        ax.set_xticks(list(xs), [n.replace("_", "\n", 1) for n in names], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("GPU time per call, µs (median)")
        ax.set_title(f"{res['preset']}: T={res['config'].split('max_num_tokens=')[1].split(',')[0]}, "
                     f"layout of {res['world']} ranks")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- end to end over a LocalCluster ------------------------------------------------------------------
# The proxy's own spans of one traced call (protocol.words.TRACE_EVENTS): what benchmarks/proxy.py measures
# against synthetic peers, here inside a run (the in-run factor, docs/benchmarks.md).
PROXY_SPANS = {"private_post": ("send_ready_seen", "private_posted"),
               "remainder": ("count_rows_received", "remainder_posted"),
               "combine_post": ("combine_send_seen", "combine_posted"),
               "dispatch_proxy": ("send_ready_seen", "dispatch_received"),
               "combine_proxy": ("combine_send_seen", "combine_received")}


def _e2e_rank(a2a, rank, iters, warmup, seed, trace_proxy=False, check=True):
    """Per-phase latency of dispatch/combine halves on one rank (events on GPU, wall clock on CPU); with
    `trace_proxy`, also the proxy's spans of every timed call (`PROXY_SPANS`, µs). With `check`, first one
    call through the toy expert, recorded for the oracle (`demo.rank_roundtrip`, input seed `seed + 4`).
    Returns (those stats, the rank's `bytes_last_call()` of the last timed call, the checked call or None)."""
    import torch

    from .demo import make_inputs, rank_roundtrip, rank_weights

    cfg, dev = a2a.cfg, a2a.device
    checked = rank_roundtrip(a2a, rank, cfg.max_num_tokens, seed + 4) if check else None
    num, ex, exs = a2a.empty_dispatch_outputs()
    sets = [tuple(t if t is None else t.to(dev) for t in make_inputs(cfg, rank, cfg.max_num_tokens, seed + i))
            for i in range(4)]
    y = torch.zeros(ex.shape, dtype=cfg.out_dtype, device=dev)
    out = torch.zeros(cfg.max_num_tokens, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
    phases = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
    times = {p: [] for p in phases + ("total",)}
    cuda = dev.type == "cuda"
    bound = torch.tensor([cfg.max_num_tokens], dtype=torch.int32, device=dev)  # skips the index sync
    # one bar, rank 0's only, gone when done (and off when stderr is not a terminal)
    for it in progress(range(warmup + iters), desc="calls (rank 0)", disable=True if rank != 0 else None):
        x, xs, idx, w = sets[it % len(sets)]
        kw = rank_weights(cfg, w)  # combine_rows="rank": the weights travel with the dispatch
        marks = []

        def mark():
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)
            else:
                marks.append(time.perf_counter())

        mark()
        a2a.dispatch(num, ex, exs, x, xs, idx, bound_m=bound, do_recv=False, **kw)
        mark()
        a2a.dispatch(num, ex, exs, x, xs, idx, bound_m=bound, do_send=False)
        mark()
        a2a.combine(out, idx, w, y, do_recv=False)
        mark()
        a2a.combine(out, idx, w, y, do_send=False)
        mark()
        if cuda:
            torch.cuda.synchronize()
            d = [marks[i].elapsed_time(marks[i + 1]) * 1e3 for i in range(4)]
        else:
            d = [(marks[i + 1] - marks[i]) * 1e6 for i in range(4)]
        if it >= warmup:
            for p, v in zip(phases, d):
                times[p].append(v)
            times["total"].append(sum(d))
            if trace_proxy and a2a.with_proxy:
                ev = a2a.trace()["proxy"]
                for name, (a, b) in PROXY_SPANS.items():
                    if a in ev and b in ev:
                        times.setdefault("proxy." + name, []).append((ev[b] - ev[a]) / 1e3)
        if trace_proxy and it == warmup - 1:
            a2a.set_tracing(True)
    # After the last call no peer starts another, so its count rows are still in place (`bytes_last_call`).
    return {p: _stats(v) for p, v in times.items()}, a2a.bytes_last_call(), checked


def _cluster_setup(args):
    """(device, config) of a LocalCluster benchmark: the preset's sizes on a GPU; small ones on CPU,
    where the kernels run in the Triton interpreter; rows as `args.wire` says (per route without one)."""
    import torch

    from .kernels import PRESETS
    from ..config import A2AConfig, wire_config

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sizes = dict(max_num_tokens=16, num_experts=8 * args.world, experts_per_token=4, hidden_dim=128)
    else:
        sizes = PRESETS[args.preset]
    cfg = A2AConfig(**sizes, in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16)
    return device, wire_config(cfg, getattr(args, "wire", "per_route"))


def run_e2e(args) -> int:
    from ..local import LocalCluster
    from ..oracle import check_against_reference

    if args.graph:
        from . import graph

        if rc := refuse_without_cuda("moe-a2a bench e2e --graph"):
            return rc
        presets = ["decode", "prefill"] if args.preset is None else [args.preset]
        res = graph.run(args.world, args.node, presets, args.iters, args.warmup, args.timeout, not args.no_nccl,
                        proxies=args.proxies or "auto", buffers=args.buffers, transport=args.transport,
                        wire=args.wire)
        graph.print_table(res)
        _write(args.json, res)
        if args.png:
            graph.plot_timeline(res, args.png)
        return 1 if graph.check_problems(res) else 0
    args.preset = args.preset or "decode"

    if args.device == "cuda" and (rc := refuse_without_cuda("moe-a2a bench e2e --device cuda")):
        return rc
    device, cfg = _cluster_setup(args)
    check = device == "cpu" or args.preset == "decode"  # as --graph: prefill's rows are too many to bring back
    with LocalCluster(cfg, world_size=args.world, node_size=args.node, transport=args.transport, device=device,
                      timeout_s=args.timeout, proxies=args.proxies or "auto", buffers=args.buffers) as cl:
        res, nbytes, checked = (list(col) for col in zip(*cl.run(_e2e_rank, args.iters, args.warmup, 0,
                                                                  args.trace_proxy, check)))
    problems = check_against_reference(cfg, checked, node_size=args.node) if check else []
    print(f"end to end, {args.world} ranks ({args.node} per node), transport {args.transport}, wire {args.wire}, "
          f"{device}: {cfg}")
    print(f"{'phase':<16}" + "".join(f"{'rank ' + str(r):>12}" for r in range(args.world)) + "   (median µs)")
    for p in res[0]:
        print(f"{p:<16}" + "".join(f"{r[p]['median']:>12.1f}" for r in res))
    print("bytes sent in the last call, node-local + remote (runtime/traffic.py):")
    for ph in ("dispatch", "combine"):
        print(f"{ph:<16}" + "".join(f"{b[ph]['node_sent'] + b[ph]['remote_sent']:>12}" for b in nbytes))
    verdict = "not checked (prefill)" if not check else "matches" if not problems else "MISMATCH"
    print("one call through the toy expert against reference.py: " + "\n  ".join([verdict, *problems]))
    _write(args.json, {"config": str(cfg), "world": args.world, "node": args.node, "transport": args.transport,
                       "wire": args.wire, "proxies": args.proxies or "auto", "buffers": args.buffers, "device": device,
                       "per_rank": res, "bytes_per_rank": nbytes,
                       "check": {"calls": 1, "problems": problems} if check else None})
    if args.png:
        _plot_e2e(res, args.png, f"{args.world} ranks ({args.node} per node), {args.transport}, {args.wire}, {device}")
    return 1 if problems else 0


def _plot_e2e(res: list[dict], path: str, title: str) -> None:
    """Per-phase median latency of every rank, with p10-p90 whiskers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(res[0])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(res)
    for r, per in enumerate(res):
        xs = [i + (r - (len(res) - 1) / 2) * width for i in range(len(phases))]
        med = [per[p]["median"] for p in phases]
        err = [[m - per[p]["p10"] for p, m in zip(phases, med)], [per[p]["p90"] - m for p, m in zip(phases, med)]]
        ax.bar(xs, med, width, yerr=err, capsize=2, label=f"rank {r}")
    ax.set_xticks(range(len(phases)), [p.replace("_", " ") for p in phases])
    ax.set_ylabel("µs (median, p10-p90)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- timeline of one traced call ---------------------------------------------------------------------
def _timeline_rank(a2a, rank, seed):
    import torch

    from ..oracle import toy_expert
    from .demo import make_inputs

    cfg, dev = a2a.cfg, a2a.device
    num, ex, exs = a2a.empty_dispatch_outputs()
    out = torch.zeros(cfg.max_num_tokens, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
    traces = []
    for it in range(3):  # the last call is the one drawn: kernels compiled, connections up
        x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, cfg.max_num_tokens, seed + it))
        a2a.set_tracing(it == 2)
        a2a.dispatch(num, ex, exs, x, xs, idx, do_recv=False)
        a2a.dispatch(num, ex, exs, x, xs, idx, do_send=False)
        y = toy_expert(ex, exs, cfg)
        a2a.combine(out, idx, w, y, do_recv=False)
        a2a.combine(out, idx, w, y, do_send=False)
        traces.append(a2a.trace())
    a2a.set_tracing(False)
    traces[-1]["bytes"] = a2a.bytes_last_call()  # the traced call's bytes, beside its timestamps
    return traces[-1]


# Proxy activity between two of its timestamps: (start event, end event, label, kind).
_PROXY_SPANS = [
    ("route_ready_seen", "private_planned", "plan private", "post"),
    ("send_ready_seen", "private_posted", "post private", "post"),
    ("private_posted", "count_rows_received", "wait count rows + private", "wire"),
    ("count_rows_received", "remainder_posted", "post remainder", "post"),
    ("remainder_posted", "dispatch_received", "wait tokens", "wire"),
    ("dispatch_recv_done_seen", "dispatch_barrier", "barrier", "wire"),
    ("combine_send_seen", "combine_posted", "post combine", "post"),
    ("combine_posted", "combine_received", "wait outputs", "wire"),
    ("combine_recv_done_seen", "combine_barrier", "barrier", "wire"),
]


def plot_timeline(traces: list[dict], path: str, title: str) -> None:
    """One Gantt chart of a dispatch + combine: per rank a GPU/model lane and a proxy lane (posting
    vs waiting on the wire/peers), times relative to the first event of any rank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(min(v[0] for v in t["model"].values()) for t in traces)
    t_end = max(max(v[1] for v in t["model"].values()) for t in traces)
    unit, scale = ("ms", 1e6) if t_end - t0 > 1e8 else ("µs", 1e3)  # the interpreter takes seconds
    colors = {"dispatch_send": "#1f77b4", "dispatch_recv": "#aec7e8", "combine_send": "#ff7f0e",
              "combine_recv": "#ffbb78", "post": "#2ca02c", "wire": "#d62728"}
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.8 * len(traces)))
    labels = []
    for i, t in enumerate(traces):
        y_model, y_proxy = 2 * i, 2 * i + 1
        labels += [f"rank {t['rank']} kernels", f"rank {t['rank']} proxy"]
        for name, (a, b) in t["model"].items():
            ax.barh(y_model, (b - a) / scale, left=(a - t0) / scale, color=colors[name], edgecolor="k", lw=0.3)
        p = t["proxy"]
        for start, end, label, kind in _PROXY_SPANS:
            if start in p and end in p:
                ax.barh(y_proxy, max(p[end] - p[start], 1) / scale, left=(p[start] - t0) / scale, color=colors[kind],
                        edgecolor="k", lw=0.3, alpha=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} since the first rank started dispatch")
    handles = [matplotlib.patches.Patch(color=c, label=n.replace("_", " ") if n not in ("post", "wire") else
                                        {"post": "proxy posting writes", "wire": "waiting: wire / peers"}[n])
               for n, c in colors.items()]
    ax.legend(handles=handles, fontsize=7, ncol=3, loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_timeline(args) -> int:
    from ..local import LocalCluster

    if args.device == "cuda" and (rc := refuse_without_cuda("moe-a2a bench timeline --device cuda")):
        return rc
    device, cfg = _cluster_setup(args)
    with LocalCluster(cfg, world_size=args.world, node_size=args.node, transport=args.transport, device=device,
                      timeout_s=args.timeout, proxies=args.proxies or "auto", buffers=args.buffers) as cl:
        traces = cl.run(_timeline_rank, 0)
    title = (f"one traced dispatch + combine: {args.world} ranks, {args.node} per node, {args.transport}, {device}, "
             f"T={cfg.max_num_tokens} H={cfg.hidden_dim} K={cfg.experts_per_token} E={cfg.num_experts}")
    for t in traces:
        spans = {k: round((b - a) / 1e3, 1) for k, (a, b) in t["model"].items()}
        sent = {ph: b["node_sent"] + b["remote_sent"] for ph, b in t["bytes"].items()}
        print(f"rank {t['rank']}: model halves µs {spans}; bytes sent {sent}")
    if args.png:
        plot_timeline(traces, args.png, title)
    _write(args.json, {"config": str(cfg), "device": device, "traces": traces})
    return 0


def _cluster_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of the benchmarks that start a LocalCluster."""
    p.add_argument("--world", type=positive_int, default=4, help="ranks (default 4)")
    p.add_argument("--node", type=positive_int, default=2, help="ranks per node, divides --world (default 2)")
    p.add_argument("--preset", default="decode", choices=["decode", "prefill"], help="sizes on GPU")
    p.add_argument("--transport", default="shm", choices=["shm", "tcp", "efa", "emulated", "auto"],
                   help="provider ('emulated': the emulated NIC, an instrument: docs/transport.md)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="rank device")
    p.add_argument("--timeout", type=positive_float, default=60.0, help="seconds before any wait gives up")
    p.add_argument("--proxies", type=positive_int, default=None,
                   help="proxy processes per rank (default: the library's, one per NIC on EFA, else 1)")
    p.add_argument("--buffers", default="auto", choices=["auto", "staged", "host", "gpu"],
                   help="where send/recv buffers live (AllToAll's `buffers`; default: the library's choice)")
    p.set_defaults(check=_check_cluster_args)
    return p


def _check_cluster_args(args) -> str | None:
    """The cross-flag check argparse cannot do alone: an error message, or None."""
    if args.world % args.node:
        return f"--node {args.node} must divide --world {args.world}"
    return None


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The `bench` sub-commands, added to `parser` (the `moe-a2a bench` sub-parser of moe_a2a.cli), or to
    a new stand-alone parser. Each sub-parser sets `run` (the function that takes the parsed args)."""
    from . import nccl

    if parser is None:
        parser = argparse.ArgumentParser(prog="moe-a2a bench", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
    raw = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    k = sub.add_parser("kernels", help="each Triton kernel vs plain torch vs the floor (GPU)")
    k.add_argument("--preset", default="both", choices=["decode", "prefill", "both"],
                   help="decode: T=128, prefill: T=4096 (H=7168 fp8 + 56 scales, K=8, E=256)")
    k.add_argument("--world", type=positive_int, default=64, help="world size of the simulated layout (default 64)")
    k.add_argument("--node", type=positive_int, default=8, help="ranks per node in the layout (default 8)")
    k.add_argument("--iters", type=positive_int, default=200, help="timed calls per kernel (default 200)")
    k.add_argument("--json", default=None, help="write results here")
    k.add_argument("--png", default=None, help="write a bar chart here")
    k.add_argument("--launchers", action="store_true",
                   help="instead: the Python cost of each launcher with the kernel launch stubbed (any machine)")
    k.set_defaults(run=run_kernels, check=_check_cluster_args)
    e = _cluster_args(sub.add_parser("e2e", help="dispatch/combine halves over a LocalCluster"))
    e.add_argument("--iters", type=positive_int, default=100, help="timed calls (default 100)")
    e.add_argument("--warmup", type=nonneg_int, default=10, help="untimed calls first (default 10)")
    e.add_argument("--json", default=None, help="write results here")
    e.add_argument("--png", default=None, help="write a per-phase bar chart here (with --graph: the timeline "
                                               "of one traced graph-mode call)")
    e.add_argument("--graph", action="store_true",
                   help="GPU: CUDA-graph replay, eager, the NCCL baseline and the floor side by side, at decode "
                        "and prefill (--preset picks one), one rank per GPU where there are several")
    e.add_argument("--no-nccl", action="store_true", help="with --graph: skip the NCCL baseline")
    e.add_argument("--wire", default="per_route", choices=WIRE_CHOICES,
                   help="how rows travel (reference.WIRE_VARIANTS, issue 32): per-rank dispatch rows, the combine "
                        "reduced at the experts' rank, fp8 combine rows (A2AConfig's dispatch_rows, combine_rows, "
                        "combine_fp8); relay / relay_fp8: sender_reduced / sender_reduced_fp8 through the relay "
                        "(A2AConfig.relay: once per (token, node) across nodes); default per_route")
    e.add_argument("--trace-proxy", action="store_true",
                   help="without --graph: also the proxy's own spans of every timed call (posting, planned "
                        "writes), to compare with benchmarks/proxy.py")
    e.set_defaults(run=run_e2e, preset=None)  # None: decode, or both presets with --graph
    tl = _cluster_args(sub.add_parser("timeline", help="trace one dispatch + combine and draw GPU / proxy / "
                                                       "wire lanes"))
    tl.add_argument("--png", default="timeline.png", help="the Gantt chart (default ./timeline.png)")
    tl.add_argument("--json", default=None, help="write the raw timestamps here")
    tl.set_defaults(run=run_timeline)
    n = sub.add_parser("nccl", help="torch.distributed all_to_all_single baseline (GPU; gloo on CPU)",
                       description=nccl.__doc__, formatter_class=raw)
    nccl.add_arguments(n)
    n.set_defaults(run=nccl.run_args)
    for p in sub.choices.values():
        p.set_defaults(error=p.error)  # cross-flag problems are reported by the sub-command's parser
    return parser


def run_args(args) -> int:
    """Run the benchmark of `args` parsed by a build_parser parser; a cross-flag problem is a one-line
    argparse error of the sub-command (exit 2)."""
    check = getattr(args, "check", None)
    problem = check(args) if check else None
    if problem:
        args.error(problem)
    return args.run(args) or 0


def main(argv: list[str] | None = None) -> int:
    """`moe-a2a bench ...` without the `moe-a2a` part (tests call this; the command is moe_a2a.cli)."""
    return run_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
