"""`moe-a2a bench e2e --graph`: one run that puts side by side, per half and at decode and prefill,

- moe_a2a, CUDA-graph replay: one graph per half (dispatch, combine) per rotating input set, replayed
  back to back without host syncs, as a model's decode step replays them; CUDA events per half;
- moe_a2a, eager: the same calls made from Python back to back, events around each half (launch
  gaps included: when the host is slower than the GPU, that is what an eager caller pays);
- the NCCL `all_to_all_single` baseline (`bench/nccl.py`), eager;
- the floor: bytes moved / bandwidth, the slower of HBM (4.3 TB/s) and NVLink, + one GPU<->GPU flag round
  trip per half. The NVLink bandwidth and the round trip are ASSUMPTIONS (`ASSUMED`): no raw file of them
  is in the repository, so the floor is an estimate, and the JSON records the values it used.

One rank per GPU where there are several (LocalCluster puts rank i on GPU i % num_gpus). Besides the
medians, one graph-mode call is traced with the kernel-side stamps (%globaltimer at the start and end
of each half) for the timeline plot.

    moe-a2a bench e2e --graph --world 2 --node 2 --json e2e_graph.json --png timeline.png
"""
from __future__ import annotations

import statistics

HBM_GBPS = 4300.0          # H200 device copy: copy_bw_GBps of docs/results/kernels.json (4261), rounded

# The floor's two other inputs are assumptions, not measurements of the repository: a 2 x H200 (NV18)
# measurement of 2026-11-30 (a 64 MiB GPU0 -> GPU1 `copy_`; a one-program kernel per GPU answering the
# other's flag through peer memory), raw file lost. Pass measured values to `floor_us` when there are some.
ASSUMED = {"nvlink_gbps": 358.0, "peer_flag_rtt_us": 2.7,
           "source": "assumption: 2 x H200 measurement of 2026-11-30, raw file lost"}


def _stats(v: list[float]) -> dict:
    s = sorted(v)
    return {"median": statistics.median(s), "p10": s[len(s) // 10], "p90": s[min(len(s) - 1, 9 * len(s) // 10)],
            "min": s[0], "n": len(s)}


def floor_us(cfg, world: int, nvlink_gbps: float = ASSUMED["nvlink_gbps"],
             peer_flag_rtt_us: float = ASSUMED["peer_flag_rtt_us"]) -> dict:
    """Bytes-moved floor of each half for uniform routing, one rank per GPU, all on one node.

    dispatch: pack reads T tokens and writes T*K rows; unpack reads T*K rows (a (W-1)/W share over
    NVLink) and writes them. combine: pack reads and writes T*K rows (the remote share over NVLink);
    reduce reads T*K rows and writes T. Each half also needs one flag hand-off. `nvlink_gbps` and
    `peer_flag_rtt_us` default to the ASSUMED values; the result's "assumed" says which were used."""
    T, K = cfg.max_num_tokens, cfg.experts_per_token
    row, y = cfg.dispatch_stride_bytes, cfg.combine_stride_bytes
    remote = (world - 1) / world
    hbm_d = T * row + 2 * T * K * row + T * K * row * (1 - remote)
    nvl_d = T * K * row * remote
    hbm_c = T * K * y + T * K * y * (1 - remote) + T * K * y + T * y
    nvl_c = T * K * y * remote
    # HBM and NVLink traffic overlap (different engines), so the slower of the two bounds each half.
    us = lambda hbm, nvl: max(hbm / (HBM_GBPS * 1e3), nvl / (nvlink_gbps * 1e3)) + peer_flag_rtt_us  # noqa: E731
    assumed = {"nvlink_gbps": nvlink_gbps, "peer_flag_rtt_us": peer_flag_rtt_us,
               "source": ASSUMED["source"] if (nvlink_gbps, peer_flag_rtt_us) ==
               (ASSUMED["nvlink_gbps"], ASSUMED["peer_flag_rtt_us"]) else "given by the caller"}
    return {"dispatch": us(hbm_d, nvl_d), "combine": us(hbm_c, nvl_c), "assumed": assumed,
            "bytes": {"dispatch_hbm": hbm_d, "dispatch_nvlink": nvl_d, "combine_hbm": hbm_c, "combine_nvlink": nvl_c}}


def _graph_rank(a2a, rank, iters: int, warmup: int, seed: int, sets: int = 4, check: bool = False):
    """Per-half latency of CUDA-graph replays, then one traced graph call (kernel-side stamps). With
    `check`, one more replay of input set 0's graphs with the toy expert's output in `expert_y`, recorded for
    the oracle (`result["checked"]`, `check_against_reference`'s per-rank entry)."""
    import torch

    from ..oracle import fill_sentinel, record_call, toy_expert
    from .demo import make_inputs, rank_weights

    cfg, dev = a2a.cfg, a2a.device
    T = cfg.max_num_tokens
    num, ex, exs = a2a.empty_dispatch_outputs()
    y = torch.zeros(ex.shape, dtype=cfg.out_dtype, device=dev)
    bound = torch.tensor([T], dtype=torch.int32, device=dev)
    inputs = [tuple(t if t is None else t.to(dev) for t in make_inputs(cfg, rank, T, seed + i)) for i in range(sets)]
    outs = [torch.zeros(T, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev) for _ in range(sets)]

    def dispatch(i):  # the weights travel with the rows when the experts' rank reduces (combine_rows="rank")
        x, xs, idx, w = inputs[i]
        a2a.dispatch(num, ex, exs, x, xs, idx, bound_m=bound, **rank_weights(cfg, w))

    def combine(i):
        _, _, idx, w = inputs[i]
        a2a.combine(outs[i], idx, w, y, bound_m=bound)

    def timed(run_dispatch, run_combine) -> dict:
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(warmup + iters)]
        for it, ev in enumerate(events):  # back to back, no host sync: the GPUs pace each other
            ev[0].record()
            run_dispatch(it % sets)
            ev[1].record()
            run_combine(it % sets)
            ev[2].record()
        torch.cuda.synchronize()
        d = [ev[0].elapsed_time(ev[1]) * 1e3 for ev in events[warmup:]]
        c = [ev[1].elapsed_time(ev[2]) * 1e3 for ev in events[warmup:]]
        return {"dispatch": _stats(d), "combine": _stats(c), "total": _stats([a + b for a, b in zip(d, c)])}

    for i in range(2):  # compile every kernel before timing and capture
        dispatch(i)
        combine(i)
    torch.cuda.synchronize()
    eager = timed(dispatch, combine)
    graphs = []
    for i in range(sets):
        pair = (torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph())
        with torch.cuda.graph(pair[0]):
            dispatch(i)
        with torch.cuda.graph(pair[1]):
            combine(i)
        graphs.append(pair)
    torch.cuda.synchronize()
    result = timed(lambda i: graphs[i][0].replay(), lambda i: graphs[i][1].replay())
    result.update(eager=eager, node_local=a2a.node_local)
    if check:  # the captured calls, checked: padding keeps the sentinel, the combine sums the toy expert's rows
        fill_sentinel(ex, exs)
        graphs[0][0].replay()
        y.copy_(toy_expert(ex, exs, cfg))
        graphs[0][1].replay()
        torch.cuda.synchronize()
        x, xs, idx, w = inputs[0]
        result["checked"] = {"calls": [record_call(cfg, x, xs, idx, w, num, ex, exs, outs[0])]}
        y.zero_()

    # One more call, traced: the model's halves stamped on the stream inside the graphs.
    a2a.set_tracing(True)
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(gd):
        dispatch(0)
    with torch.cuda.graph(gc):
        combine(0)
    for _ in range(3):  # the last of these is the one read back
        gd.replay()
        gc.replay()
    torch.cuda.synchronize()
    result["trace"] = a2a.trace(latest=True)
    result["trace"]["bytes"] = a2a.bytes_last_call()  # the traced call's bytes (its inputs: set 0), beside its stamps
    a2a.set_tracing(False)
    return result


def run(world: int, node: int, presets: list[str], iters: int, warmup: int, timeout: float,
        nccl: bool = True, proxies="auto", buffers: str = "auto", transport: str = "auto",
        wire: str = "per_route") -> dict:
    """Both halves timed per preset (`presets`) over `wire` (a `reference.WIRE_VARIANTS` name). The decode
    preset's graphs are also checked against the reference (one replay, `check_against_reference`): each
    preset's `check` holds the problems found (empty: all good; prefill is not checked: hundreds of MB of
    rows per rank to bring back and to recompute on the CPU). `bytes_per_rank`: each rank's traced graph
    call (input set 0), `AllToAll.bytes_last_call()`."""
    import time

    import torch

    from ..config import A2AConfig, wire_config
    from ..local import LocalCluster
    from ..oracle import check_against_reference
    from .kernels import PRESETS

    out = {"world": world, "node": node, "proxies": proxies, "buffers": buffers, "transport": transport,
           "wire": wire, "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "presets": {}}
    for preset in presets:
        start = time.perf_counter()
        cfg = wire_config(A2AConfig(**PRESETS[preset], in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16), wire)
        n_iters = iters if preset == "decode" else max(20, iters // 5)
        check = preset == "decode"
        with LocalCluster(cfg, world_size=world, node_size=node, device="cuda", timeout_s=timeout,
                          proxies=proxies, buffers=buffers, transport=transport) as cl:
            graph = cl.run(_graph_rank, n_iters, warmup, 0, 4, check)
        row = {"config": str(cfg), "graph": graph, "eager": [g.pop("eager") for g in graph],
               "floor": floor_us(cfg, world), "bytes_per_rank": [g["trace"]["bytes"] for g in graph]}
        if check:
            row["check"] = {"calls": 1, "problems": check_against_reference(cfg, [g.pop("checked") for g in graph],
                                                                             node_size=node)}
        if nccl:
            from .nccl import run as run_nccl

            row["nccl"] = run_nccl(world=world, preset=preset, iters=n_iters, warmup=warmup)
        row["seconds"] = round(time.perf_counter() - start, 1)
        out["presets"][preset] = row
    return out


def check_problems(res: dict) -> list[str]:
    """Every problem the oracle found in a `run` result, prefixed with its preset."""
    return [f"{preset}: {p}" for preset, row in res["presets"].items()
            for p in (row.get("check") or {}).get("problems", [])]


def _slowest_rank_median(rows: list[dict], key: str) -> float:
    return max(r[key]["median"] for r in rows)  # the slowest rank is the call's latency


def print_table(res: dict) -> None:
    print(f"{res['world']} ranks ({res['node']} per node) on {res['device']}, wire {res.get('wire', 'per_route')}; "
          f"µs, median per rank, slowest rank")
    print(f"{'preset':<9}{'half':<10}{'graph':>10}{'eager':>10}{'nccl':>10}{'floor*':>10}")
    for preset, row in res["presets"].items():
        for half in ("dispatch", "combine", "total"):
            graph = _slowest_rank_median(row["graph"], half)
            eager = _slowest_rank_median(row["eager"], half)
            floor = row["floor"]["dispatch"] + row["floor"]["combine"] if half == "total" else row["floor"][half]
            nccl = "-"
            if "nccl" in row:
                key = {"dispatch": "dispatch", "combine": "combine", "total": "total"}[half]
                vals = [r.get(key, {}).get("median") for r in row["nccl"]]
                nccl = f"{max(vals):.1f}" if all(v is not None for v in vals) else "-"
            print(f"{preset:<9}{half:<10}{graph:>10.1f}{eager:>10.1f}{nccl:>10}{floor:>10.1f}")
    for preset, row in res["presets"].items():
        sent = [{ph: b[ph]["node_sent"] + b[ph]["remote_sent"] for ph in ("dispatch", "combine")}
                for b in row.get("bytes_per_rank", [])]
        check = row.get("check")
        verdict = "not checked" if check is None else "matches the reference" if not check["problems"] else \
            f"{len(check['problems'])} problem(s) against the reference: " + "; ".join(check["problems"][:3])
        print(f"{preset}: bytes sent per rank (traced call) {sent}; {verdict}")
    a = next(iter(res["presets"].values()), {}).get("floor", {}).get("assumed", ASSUMED)
    print(f"* floor with NVLink {a['nvlink_gbps']:g} GB/s and a peer flag round trip of {a['peer_flag_rtt_us']:g} µs "
          f"({a['source']}): an estimate")


def plot_timeline(res: dict, path: str) -> None:
    """One graph-mode call per preset: each rank's halves on its lane (kernel-side stamps), legend outside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(res["presets"])
    fig, axes = plt.subplots(len(presets), 1, figsize=(9, 1.2 + 1.1 * res["world"] * len(presets)), squeeze=False)
    colors = {"dispatch_send": "#4c72b0", "dispatch_recv": "#55a868", "combine_send": "#c44e52",
              "combine_recv": "#8172b2"}
    for ax, preset in zip(axes[:, 0], presets):
        traces = [g["trace"] for g in res["presets"][preset]["graph"]]
        t0 = min(s[0] for t in traces for s in t["model"].values())
        for lane, t in enumerate(traces):
            for half, (a, b) in t["model"].items():
                ax.barh(lane, (b - a) / 1e3, left=(a - t0) / 1e3, color=colors[half], label=half if lane == 0 else None)
        ax.set_yticks(range(len(traces)), [f"rank {t['rank']}" for t in traces])
        ax.set_xlabel("µs since the first rank started dispatch")
        ax.set_title(f"{preset}: one CUDA-graph call, kernel-side stamps")
        ax.invert_yaxis()
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130, bbox_inches="tight")
