"""Scale-out latency MODEL of moe_a2a dispatch / combine (a model, NOT a measurement).

Predicts the end-to-end latency of one dispatch and one combine of the decode configuration
(T=128 tokens/rank, H=7168 fp8 + 56 fp32 scales, K=8 of E=256 experts, bf16 combine) at EP16/32/64
with 8 GPUs per node, for two fabrics:

- ``"efa"``: AWS EFA, 2 x 200 Gb/s NICs per GPU, peers sharded across the NICs in contiguous ranges
  (moe_a2a/proxy/engine.py: peer i -> domain i*D//N);
- ``"cx7"``: ConnectX-7, one 400 Gb/s NIC per GPU;

same-node peers over NVLink (mapped memory) in both cases.

How: a small critical-path timeline of the protocol (docs/design.md, "Protocol": GPU kernel -> flag to the
proxy -> proxy posts writes one by one -> NIC serialises them -> last byte lands -> flag to the GPU ->
receive kernel -> barrier). Each event carries the breakdown of the path that leads to it; ``max`` keeps
the breakdown of the later input. So the per-term numbers returned by :func:`predict` are the
*critical-path* contributions and always add up to the phase total; work that overlaps (e.g. NVLink
pushes while RDMA is in flight) costs nothing unless it becomes the longer branch.

Pure Python + numpy (matplotlib only for the plot). Every input is a named constant below with its
source. Run ``python -m moe_a2a.bench.latency_model --png latency-model.png --json /tmp/m.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from ._util import fraction, nonneg_float

# ---- decode configuration (docs/design.md, "Benchmarks"; the sizes our H200 kernels were measured at)
TOKENS = 128                      # T, tokens per rank
TOPK = 8                          # K, distinct experts per token
NUM_EXPERTS = 256                 # E
DISPATCH_ROW_BYTES = 7392         # 7168 B fp8 + 56 fp32 scales (our dispatch stride, brief 2026-11-29)
COMBINE_ROW_BYTES = 14336         # 7168 bf16 (our combine stride)
ROUTE_ROW_BYTES = 4 * NUM_EXPERTS  # one int32 count per expert: the routing row each rank scatters
GPUS_PER_NODE = 8                 # p5en / DGX H200 nodes
MEASURED_WORLD = 64               # the simulated layout our kernel times were measured at

# ---- our H200 measurements (2026-11-29, CUDA-graph replay, GPU time per kernel, µs) ------------------
K_ROUTE_TOKENS = 4.5              # route_tokens: per-expert counts + offsets (dispatch send)
K_PACK_TOKENS = 3.2               # pack_tokens_by_expert (dispatch send)
K_UNPACK_TOKENS = 8.3             # unpack_tokens_by_expert (dispatch recv), scales with received rows
K_PACK_COMBINE = 7.6              # pack_combine_by_source (combine send), scales with received rows
K_REDUCE_COMBINE = 4.0            # reduce_combined_tokens (combine recv), scales with T*K (own rows)
LAUNCH_GPU_US = 1.4               # one (empty) Triton launch in a graph: already inside the times above
HOST_LAUNCH_US = 11.0             # host cost of an eager Triton launch (docs/design.md, "Measured facts"); graphs hide it
FLAG_RTT_US = 6.1                 # GPU -> proxy process -> GPU flag round trip, median (our H200 measurement;
                                  # docs/design.md, "Measured facts", has 4.2 µs with a thread echo)
HBM_COPY_GBPS = 4240.0            # H200 copy bandwidth measured (4.24 TB/s), for the HBM floor only

# ---- proxy (Python + ctypes libfabric shim; docs/transport.md) --------------------------------------
POST_US = 1.4                     # Python cost per posted write: 1.0-1.8 µs median at 63 targets
POST_US_LOW, POST_US_HIGH = 1.0, 1.8  # the measured range (docs/transport.md), drawn as a band
POST_US_C_HELPER = 0.2            # WHAT-IF only: a C helper posting a whole scatter in one call
                                  # (docs/transport.md "Not done"); drawn dotted, not our implementation
CQ_US = 0.2                       # ASSUMPTION (not measured): proxy cost per completion drained (CQ batch of
                                  # 32 decoded through a memoryview, docs/transport.md "Receive side").
                                  # Charged for the local completion of each own write (drained between
                                  # posts) and for imms that arrive while the proxy is posting; imms that
                                  # arrive while it idles waiting cost nothing on the critical path.
PLAN_US = 15.0                    # ASSUMPTION (not measured): numpy remainder plan on a [W, L] count matrix

# ---- links ------------------------------------------------------------------------------------------
# EFA: 2 x 200 Gb/s per GPU in the configuration of the brief (article: "two 200 Gbps NICs are
# aggregated to provide 400 Gbps"; peers, not bytes, sharded across them).
EFA_NICS = 2
EFA_NIC_GBPS = 200 / 8            # 25 GB/s line rate per NIC
# Effective EFA bandwidth. Lower bound implied by the pplx-garden README: its EFA combine at EP64 moves
# 56/64 * 1024 rows * 14336 B = 12.8 MB per rank over the NICs in <= 391 µs in total, i.e. >= 33 GB/s of
# the 50 GB/s line rate (>= 0.66). We take 0.70. NOTE this is derived from one of the points the plot
# compares against, so the EFA combine at EP64 is not an independent check. The article's "EFA is two
# times slower than ConnectX-7 when sending 256 KB packets" (which would mean ~0.45) reads as single-
# transfer latency, not aggregate bandwidth; docs/latency-model.md shows the prediction at 0.45 too.
EFA_BW_EFFICIENCY = 0.70
EFA_BW_EFFICIENCY_PESSIMISTIC = 0.45
# ASSUMPTION: one-way latency of one RDMA write+imm on EFA (SRD, libfabric, PCIe round trips for the
# proxy-posted WQE and the completion). The article says the proxy's extra PCIe transactions "add a few
# microseconds to every transfer"; public EFA small-message latencies are ~10-15 µs (brief). We use 12.
EFA_MSG_LATENCY_US = 12.0
# ConnectX-7: one 400 Gb/s NIC per GPU (NVIDIA CX7 datasheet: up to 400 Gb/s NDR / 400GbE).
CX7_NICS = 1
CX7_NIC_GBPS = 400 / 8            # 50 GB/s line rate
CX7_BW_EFFICIENCY = 0.90          # ASSUMPTION: RC writes of >=100 KB run near line rate (relaxed ordering on)
# ASSUMPTION: one-way RDMA write latency on IB/CX7, ~1.5-2.5 µs for 1-32 KB (typical ib_write_lat /
# ib_send_lat figures; e.g. RC 1 KB 1.6 µs, 32 KB 4.6 µs incl. serialisation on an older HCA).
CX7_MSG_LATENCY_US = 2.5
# ASSUMPTION: NVLink 4 on H200 is 450 GB/s per direction nominal (900 GB/s bidirectional, NVIDIA H200
# datasheet; the article says "NVLink offers 900 GB/s"); we take 450 GB/s effective for GPU-initiated
# stores into a peer's mapped buffer.
NVLINK_GBPS = 450.0

FABRICS = ("efa", "cx7")
WORLDS = (16, 32, 64)
TERMS = ("gpu_kernels", "flags", "proxy_posting", "proxy_cq", "wire", "nvlink", "plan")


@dataclass(frozen=True)
class Fabric:
    name: str
    nics: int
    nic_gbps: float               # effective GB/s per NIC (line rate x efficiency)
    latency_us: float             # one-way per-message latency


def fabric(name: str, efa_efficiency: float | None = None) -> Fabric:
    if name == "efa":
        eff = EFA_BW_EFFICIENCY if efa_efficiency is None else efa_efficiency
        return Fabric("efa", EFA_NICS, EFA_NIC_GBPS * eff, EFA_MSG_LATENCY_US)
    if name == "cx7":
        return Fabric("cx7", CX7_NICS, CX7_NIC_GBPS * CX7_BW_EFFICIENCY, CX7_MSG_LATENCY_US)
    raise ValueError(f"fabric must be one of {FABRICS}, got {name!r}")


# ---- critical-path bookkeeping ------------------------------------------------------------------------
@dataclass(frozen=True)
class Path:
    """A point in time with the breakdown (term -> µs) of the path that led to it."""
    parts: dict = field(default_factory=dict)

    @property
    def t(self) -> float:
        return sum(self.parts.values())

    def add(self, term: str, us: float) -> "Path":
        parts = dict(self.parts)
        parts[term] = parts.get(term, 0.0) + float(us)
        return Path(parts)


def later(*paths: Path) -> Path:
    return max(paths, key=lambda p: p.t)


def post_batch(start: Path, sizes: list[float], fab: Fabric, post_us: float) -> tuple[Path, Path]:
    """The proxy posts ``sizes`` (bytes, in peer order) one write at a time from ``start``; writes go to
    NIC ``i * nics // n`` (contiguous peer shards) and are serialised there. Returns (time the last
    write was posted, time the last byte landed)."""
    n = len(sizes)
    posted, nic_free = start, [None] * fab.nics
    landed = start
    for i, size in enumerate(sizes):
        posted = posted.add("proxy_posting", post_us).add("proxy_cq", CQ_US)  # post + its completion
        nic = i * fab.nics // n
        begin = posted if nic_free[nic] is None else later(posted, nic_free[nic])
        nic_free[nic] = begin.add("wire", size / (fab.nic_gbps * 1e3))  # GB/s -> bytes per µs
        landed = later(landed, nic_free[nic].add("wire", fab.latency_us))
    return posted, landed


# ---- routing statistics (uniform routing: each token picks K distinct experts uniformly) --------------
def rows_per_pair_pmf(world: int) -> np.ndarray:
    """Distribution of the rows one rank sends to one other rank: a sum over T tokens of a
    hypergeometric (E experts, L = E/W of them on the target, K distinct draws)."""
    L = NUM_EXPERTS // world
    per_token = np.array([math.comb(L, j) * math.comb(NUM_EXPERTS - L, TOPK - j)
                          for j in range(min(L, TOPK) + 1)], float) / math.comb(NUM_EXPERTS, TOPK)
    pmf = np.array([1.0])
    for _ in range(TOKENS):
        pmf = np.convolve(pmf, per_token)
    return pmf


def private_rows(world: int) -> int:
    """Default per-sender private region (moe_a2a/config.py Layout): twice the mean rows a sender sends
    to one rank, rounded up to 8, capped at T*K."""
    routes = TOKENS * TOPK
    twice_mean = -(-2 * routes // world)          # ceil(2*T*K / W)
    return min(routes, -(-twice_mean // 8) * 8)   # round up to 8


def routing_stats(world: int) -> dict:
    nodes = world // GPUS_PER_NODE
    remote = world - GPUS_PER_NODE if nodes > 1 else 0
    pmf = rows_per_pair_pmf(world)
    P = private_rows(world)
    p_rem = float(pmf[P + 1:].sum())                      # one (sender, receiver) pair overflows P
    mean_rows = TOKENS * TOPK / world                      # rows per (sender, receiver) pair
    return dict(
        world=world, remote_peers=remote, local_peers=GPUS_PER_NODE - 1, rows_per_peer=mean_rows,
        private_rows=P, p_remainder_pair=p_rem,
        expected_remainder_writes=remote * p_rem,
        # the EP steps in lock-step: the phase waits if ANY remote pair needs a remainder write
        p_any_remainder=1.0 - (1.0 - p_rem) ** (world * remote),
        # expected rows a rank receives; independent of W under uniform routing (T*K)
        recv_rows=mean_rows * world)


def kernel_scale(world: int) -> float:
    """Received-row kernels scale linearly from the 64-rank layout (1.0 for uniform routing)."""
    return routing_stats(world)["recv_rows"] / routing_stats(MEASURED_WORLD)["recv_rows"]


# ---- the two phases -----------------------------------------------------------------------------------
def _barrier(start: Path, world: int, fab: Fabric, post_us: float) -> Path:
    """Recv kernel done -> flag to proxy -> zero-length write+imm to W-1 peers -> last imm in -> flag to
    the GPU (tx_ready). In a back-to-back loop it gates the next phase's send kernel; in a model it is
    hidden behind the expert GEMM if that is longer."""
    p = start.add("flags", FLAG_RTT_US / 2)
    _, landed = post_batch(p, [0.0] * (world - 1), fab, post_us)
    return landed.add("flags", FLAG_RTT_US / 2)


def dispatch(world: int, fab: Fabric, post_us: float = POST_US, graphs: bool = True,
             barrier: bool = True) -> Path:
    st = routing_stats(world)
    launch = 0.0 if graphs else HOST_LAUNCH_US
    g0 = Path()
    # GPU: route_tokens -> raise route_ready; pack_tokens_by_expert -> raise send_ready; then the
    # same-node private rows are pushed over NVLink while RDMA starts.
    t_route = g0.add("gpu_kernels", K_ROUTE_TOKENS + launch)
    t_pack = t_route.add("gpu_kernels", K_PACK_TOKENS + launch)
    nvl_bytes = st["local_peers"] * st["rows_per_peer"] * DISPATCH_ROW_BYTES
    t_nvl = t_pack.add("nvlink", nvl_bytes / (NVLINK_GBPS * 1e3))
    # proxy: routing row to W-1 peers, then the private write to every remote peer (zero-length too)
    p_route = t_route.add("flags", FLAG_RTT_US / 2)
    route_posted, route_landed = post_batch(p_route, [ROUTE_ROW_BYTES] * (world - 1), fab, post_us)
    if st["remote_peers"]:
        # the W-1 routing imms of the peers arrive while this proxy posts: drained in between
        p_priv = later(route_posted, t_pack.add("flags", FLAG_RTT_US / 2)).add("proxy_cq", CQ_US * (world - 1))
        size = min(st["rows_per_peer"], st["private_rows"]) * DISPATCH_ROW_BYTES
        priv_posted, data_landed = post_batch(p_priv, [size] * st["remote_peers"], fab, post_us)
        # remainder: needs every count row, a numpy plan, then one more write (rare: weighted by the
        # probability that any pair overflows its private region)
        plan = later(priv_posted, route_landed).add("plan", PLAN_US)
        _, rem_landed = post_batch(plan, [0.0], fab, post_us)  # size: a few rows; latency dominates
        extra = max(0.0, rem_landed.t - data_landed.t) * st["p_any_remainder"]
        data_landed = data_landed.add("plan", extra)     # expected delay, usually ~0
    else:
        data_landed = route_posted
    ready = later(data_landed, route_landed).add("flags", FLAG_RTT_US / 2)
    done = later(ready, t_nvl).add("gpu_kernels", K_UNPACK_TOKENS * kernel_scale(world) + launch)
    return _barrier(done, world, fab, post_us) if barrier else done


def combine(world: int, fab: Fabric, post_us: float = POST_US, graphs: bool = True,
            barrier: bool = True) -> Path:
    st = routing_stats(world)
    launch = 0.0 if graphs else HOST_LAUNCH_US
    # GPU: pack_combine_by_source stages remote rows, raises send_ready, writes same-node rows into the
    # home ranks' receive buffers over NVLink.
    t_pack = Path().add("gpu_kernels", K_PACK_COMBINE * kernel_scale(world) + launch)
    nvl_bytes = st["local_peers"] * st["rows_per_peer"] * COMBINE_ROW_BYTES
    t_nvl = t_pack.add("nvlink", nvl_bytes / (NVLINK_GBPS * 1e3))
    if st["remote_peers"]:
        p = t_pack.add("flags", FLAG_RTT_US / 2)
        size = st["rows_per_peer"] * COMBINE_ROW_BYTES
        _, landed = post_batch(p, [size] * st["remote_peers"], fab, post_us)
        ready = landed.add("flags", FLAG_RTT_US / 2)
    else:
        ready = t_pack
    done = later(ready, t_nvl).add("gpu_kernels", K_REDUCE_COMBINE + launch)
    return _barrier(done, world, fab, post_us) if barrier else done


def predict(world: int, fabric_name: str, post_us: float = POST_US, graphs: bool = True,
            barrier: bool = True, efa_efficiency: float | None = None) -> dict:
    """Predicted latency in µs: ``{"dispatch": total, "dispatch.<term>": ..., "combine": ...,
    "combine.<term>": ..., "total": dispatch + combine}``. Terms are critical-path contributions and
    sum to their phase. ``barrier`` includes each phase's imm barrier (back-to-back benchmark view)."""
    if world % GPUS_PER_NODE or NUM_EXPERTS % world:
        raise ValueError(f"world must be a multiple of {GPUS_PER_NODE} dividing {NUM_EXPERTS}, got {world}")
    fab = fabric(fabric_name, efa_efficiency)
    out = {}
    for phase, fn in (("dispatch", dispatch), ("combine", combine)):
        path = fn(world, fab, post_us=post_us, graphs=graphs, barrier=barrier)
        out[phase] = path.t
        for term in TERMS:
            out[f"{phase}.{term}"] = path.parts.get(term, 0.0)
    out["total"] = out["dispatch"] + out["combine"]
    return out


def hbm_floor_us(world: int) -> dict:
    """Bytes the GPU kernels move / measured copy bandwidth (reference only)."""
    rows = routing_stats(world)["recv_rows"]
    return {"dispatch": 2 * 2 * rows * DISPATCH_ROW_BYTES / (HBM_COPY_GBPS * 1e3),
            "combine": 2 * 2 * rows * COMBINE_ROW_BYTES / (HBM_COPY_GBPS * 1e3)}


# ---- published numbers (decode: 128 tokens/rank, H=7168, top-8, fp8 dispatch / bf16 combine) ---------
# (source, configuration, fabric, EP, dispatch µs, combine µs, dispatch+combine µs). None = not given.
PUBLISHED = [
    # pplx-garden's README (the project's published table): H200, EP64, 128 tokens
    ("pplx-garden README", "H200 EFA p5en", "efa", 64, 266.7, 391.2, None),
    ("pplx-garden README", "H200 CX7", "cx7", 64, 187.5, 309.1, None),
    # Perplexity's article on their all-to-all: "459, 582, 692 µs at EP16/32/64" on EFA vs UCCL-EP "519, 966,
    # 1159 µs". 519/966/1159 equal UCCL-EP's README dispatch+combine sums at EP16/24/32 (226+293,
    # 386+580, 465+694), so we read both triples as dispatch+combine totals.
    ("pplx article", "H200 EFA", "efa", 16, None, None, 459.0),
    ("pplx article", "H200 EFA", "efa", 32, None, None, 582.0),
    ("pplx article", "H200 EFA", "efa", 64, None, None, 692.0),
    # UCCL-EP README LL mode, p5en (8xH200, 16x200 Gb EFA), 128 tokens (README commands: 288 experts)
    ("UCCL-EP README", "p5en H200 EFA, LL", "efa", 16, 226.0, 293.0, 519.0),
    ("UCCL-EP README", "p5en H200 EFA, LL", "efa", 24, 386.0, 580.0, 966.0),
    ("UCCL-EP README", "p5en H200 EFA, LL", "efa", 32, 465.0, 694.0, 1159.0),
    # DeepEP V1 README, LL mode, H800 + CX7 400 Gb/s IB, IBGDA (kernel-only timing)
    ("DeepEP V1 LL", "H800 CX7 IBGDA", "cx7", 16, 118.0, 195.0, 313.0),
    ("DeepEP V1 LL", "H800 CX7 IBGDA", "cx7", 32, 155.0, 273.0, 428.0),
    ("DeepEP V1 LL", "H800 CX7 IBGDA", "cx7", 64, 173.0, 314.0, 487.0),
    # pplx-kernels README, 128 tokens, NVSHMEM IBGDA (hardware not stated)
    ("pplx-kernels README", "NVSHMEM IBGDA (hw n/s)", "cx7", 16, 622.0, 668.0, 1290.0),
    ("pplx-kernels README", "NVSHMEM IBGDA (hw n/s)", "cx7", 32, 428.0, 481.0, 909.0),
    ("pplx-kernels README", "NVSHMEM IBGDA (hw n/s)", "cx7", 64, 317.0, 530.0, 847.0),
]


def table(worlds=WORLDS, fabrics=FABRICS, **kw) -> list[dict]:
    rows = []
    for fab in fabrics:
        for w in worlds:
            r = {"fabric": fab, "world": w, **predict(w, fab, **kw)}
            band = {k: v for k, v in kw.items() if k != "post_us"}
            lo = predict(w, fab, post_us=POST_US_LOW, **band)
            hi = predict(w, fab, post_us=POST_US_HIGH, **band)
            fast = predict(w, fab, post_us=POST_US_C_HELPER, **band)
            r.update({"dispatch_low": lo["dispatch"], "dispatch_high": hi["dispatch"],
                      "combine_low": lo["combine"], "combine_high": hi["combine"],
                      "dispatch_c_helper": fast["dispatch"], "combine_c_helper": fast["combine"],
                      "total_c_helper": fast["total"]})
            rows.append(r)
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| fabric | EP | dispatch µs (post 1.0-1.8) | combine µs (post 1.0-1.8) | total µs | "
            "dispatch: kernels / flags / posting / cq / wire / nvlink / plan | "
            "combine: kernels / flags / posting / cq / wire / nvlink |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        d = " / ".join(f"{r['dispatch.' + t]:.0f}" for t in TERMS)
        c = " / ".join(f"{r['combine.' + t]:.0f}" for t in TERMS[:-1])
        lines.append(f"| {r['fabric']} | {r['world']} | {r['dispatch']:.0f} ({r['dispatch_low']:.0f}-"
                     f"{r['dispatch_high']:.0f}) | {r['combine']:.0f} ({r['combine_low']:.0f}-"
                     f"{r['combine_high']:.0f}) | {r['total']:.0f} | {d} | {c} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 10.5))
    colors = {"efa": "tab:orange", "cx7": "tab:blue"}
    markers = {"pplx-garden README": "*", "pplx article": "P", "UCCL-EP README": "s",
               "DeepEP V1 LL": "^", "pplx-kernels README": "v"}
    for ax, phase in zip(axes.flat[:3], ("dispatch", "combine", "total")):
        for fab in FABRICS:
            rs = [r for r in rows if r["fabric"] == fab]
            ws = [r["world"] for r in rs]
            ax.plot(ws, [r[phase] for r in rs], "-o", color=colors[fab], lw=2.5,
                    label=f"MODEL moe_a2a {fab.upper()} (Python proxy {POST_US} µs/write)")
            if phase != "total":
                ax.fill_between(ws, [r[f"{phase}_low"] for r in rs], [r[f"{phase}_high"] for r in rs],
                                color=colors[fab], alpha=0.15)
            else:
                lo = [r["dispatch_low"] + r["combine_low"] for r in rs]
                hi = [r["dispatch_high"] + r["combine_high"] for r in rs]
                ax.fill_between(ws, lo, hi, color=colors[fab], alpha=0.15)
            ax.plot(ws, [r[f"{phase}_c_helper"] for r in rs], ":", color=colors[fab], lw=1.5,
                    label=f"MODEL what-if {fab.upper()}: C-helper posting {POST_US_C_HELPER} µs/write")
        idx = {"dispatch": 4, "combine": 5, "total": 6}[phase]
        top = max([r[f"{phase}_high"] if phase != "total" else r["dispatch_high"] + r["combine_high"]
                   for r in rows] + [p[idx] for p in PUBLISHED if p[idx] is not None])
        seen = set()
        for src, cfg, fab, ep, *vals in PUBLISHED:
            v = vals[idx - 4]
            if v is None:
                continue
            lab = f"{src} ({cfg})"
            ax.scatter([ep], [v], marker=markers[src], s=90, color=colors[fab], edgecolor="k", zorder=5,
                       label=None if lab in seen else lab)
            seen.add(lab)
        ax.set_xscale("log", base=2)
        ax.set_xticks([16, 24, 32, 64])
        ax.set_xticklabels(["16", "24", "32", "64"])
        ax.set_xlabel("EP size (8 GPUs per node)")
        ax.set_ylabel("latency (µs)")
        ax.set_ylim(0, 1.6 * top)
        name = "dispatch + combine" if phase == "total" else phase
        ax.set_title(f"{name}: MODEL (not measured) vs published")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left", ncol=2)
    # where the time goes: stacked critical-path terms
    ax = axes.flat[3]
    bars = [(r["fabric"], r["world"], ph, r) for ph in ("dispatch", "combine") for r in rows]
    bottoms = np.zeros(len(bars))
    for term, col in zip(TERMS, plt.cm.tab10.colors):
        vals = np.array([r[f"{ph}.{term}"] for _, _, ph, r in bars])
        ax.bar(np.arange(len(bars)), vals, bottom=bottoms, color=col, label=term)
        bottoms += vals
    ax.set_xticks(np.arange(len(bars)))
    ax.set_xticklabels([f"{ph[0].upper()} {f.upper()}\nEP{w}" for f, w, ph, _ in bars], fontsize=7)
    ax.set_ylim(0, 1.15 * bottoms.max())
    ax.set_ylabel("µs on the critical path")
    ax.set_title("MODEL (not measured): where the time goes (D = dispatch, C = combine)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle("moe_a2a scale-out latency MODEL (not measured): decode T=128, H=7168 fp8 / bf16, K=8, "
                 "E=256; bands = proxy post cost 1.0-1.8 µs/write", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_a2a.bench.latency_model",
                                 description="moe_a2a scale-out latency MODEL (not measured)")
    ap.add_argument("--png", help="write the plot here")
    ap.add_argument("--json", help="write predictions, assumptions and published points here")
    ap.add_argument("--post-us", type=nonneg_float, default=POST_US, help="proxy cost per posted write (µs)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: add host launch cost per kernel")
    ap.add_argument("--no-barrier", action="store_true", help="leave out the per-phase imm barrier")
    ap.add_argument("--efa-efficiency", type=fraction, default=None,
                    help=f"EFA effective/line-rate bandwidth (default {EFA_BW_EFFICIENCY})")
    args = ap.parse_args(argv)
    kw = dict(post_us=args.post_us, graphs=not args.eager, barrier=not args.no_barrier,
              efa_efficiency=args.efa_efficiency)
    rows = table(**kw)
    print("moe_a2a latency MODEL (not measured), µs; terms are critical-path contributions")
    print(format_table(rows))
    if args.json:
        consts = {k: v for k, v in globals().items() if k.isupper() and isinstance(v, (int, float))}
        doc = {"kind": "MODEL (not measured)", "options": kw, "constants": consts, "predictions": rows,
               "routing": [routing_stats(w) for w in WORLDS],
               "hbm_floor_us": {w: hbm_floor_us(w) for w in WORLDS},
               "published": [dict(zip(("source", "config", "fabric", "ep", "dispatch_us", "combine_us",
                                       "total_us"), p)) for p in PUBLISHED]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
