"""`moe-a2a demo`: a LocalCluster on this machine's default transport, dispatch -> toy expert ->
combine, checked against `reference.py`, with the latency of each phase.

The rank function is also what the end-to-end tests run (`rank_roundtrip`), so the demo and the
tests exercise the same path.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..config import A2AConfig, wire_config
from ..oracle import check_against_reference, default_max_ulps, fill_sentinel, record_call, toy_expert


def make_inputs(cfg: A2AConfig, rank: int, num_tokens: int, seed: int, routing: str = "random"):
    """Deterministic per (seed, rank) inputs: x (+scales), indices with masks and duplicates, weights.

    routing: "random" (topk of noise, some -1), "skew" (every token to expert 0: the remainder
    path), "dupes" (duplicate experts in a row)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T, K, E, H = num_tokens, cfg.experts_per_token, cfg.num_experts, cfg.hidden_dim
    x = torch.randn(T, H, generator=g)
    if cfg.has_scales:
        scale = torch.rand(T, cfg.num_scales, generator=g) + 0.5
        x_scale = scale
    else:
        x_scale = None
    x = x.to(cfg.in_dtype)
    if routing == "skew":
        idx = torch.zeros(T, K, dtype=torch.int64)
    elif routing == "dupes":
        idx = torch.randint(0, E, (T, K), generator=g)
        idx[:, -1] = idx[:, 0]
    else:
        scores = torch.rand(T, E, generator=g)
        idx = scores.topk(min(K, E), dim=1).indices
        if K > E:
            idx = torch.cat([idx, torch.randint(0, E, (T, K - E), generator=g)], 1)
        idx[torch.rand(T, K, generator=g) < 0.1] = -1
    w = torch.rand(T, K, generator=g)
    return x, x_scale, idx.to(torch.int32), w


def call_tensors(a2a, rank: int, seed: int) -> tuple:
    """One rank's tensors of a dispatch + combine call of `max_num_tokens` tokens on its device: its inputs
    (`make_inputs`: x, x_scale, indices, weights), then the dispatch outputs (`empty_dispatch_outputs`), expert
    outputs of their shape (zeros) and the combine's output."""
    cfg, dev = a2a.cfg, a2a.device
    T = cfg.max_num_tokens
    x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, T, seed))
    num, ex, exs = a2a.empty_dispatch_outputs()
    y = torch.zeros(ex.shape, dtype=cfg.out_dtype, device=dev)
    out = torch.zeros(T, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
    return x, xs, idx, w, num, ex, exs, y, out


def rank_weights(cfg: A2AConfig, weights: torch.Tensor) -> dict:
    """The dispatch's keyword for the routes' weights: `{"weights": weights}` when the combine is reduced at
    the experts' rank (`combine_rows="rank"`: they travel with the rows), else none."""
    return {"weights": weights} if cfg.combine_rows == "rank" else {}


def rank_roundtrip(a2a, rank: int, num_tokens, seed: int, iters: int = 1, routing: str = "random",
                   split: bool = False):
    """Run `iters` dispatch+combine calls (fresh routing each) on one rank; return every call's
    inputs and outputs plus per-phase latencies in µs."""
    cfg = a2a.cfg
    dev = a2a.device
    num, ex, exs = a2a.empty_dispatch_outputs()
    T = num_tokens[rank] if isinstance(num_tokens, (list, tuple)) else num_tokens
    calls, times = [], {"dispatch_send": [], "dispatch_recv": [], "combine_send": [], "combine_recv": []}
    cuda = dev.type == "cuda"

    def clock():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    for it in range(iters):
        x, xs, idx, w = (t.to(dev) if t is not None else None for t in make_inputs(cfg, rank, T, seed + it, routing))
        out = torch.zeros(T, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
        fill_sentinel(ex, exs)  # rows the call must not write keep it (the oracle checks them)
        kw = rank_weights(cfg, w)
        t0 = clock()
        a2a.dispatch(num, ex, exs, x, xs, idx, do_recv=False, **kw)
        t1 = clock()
        a2a.dispatch(num, ex, exs, x, xs, idx, do_send=False)
        t2 = clock()
        y = toy_expert(ex, exs, cfg)
        t3 = clock()
        a2a.combine(out, idx, w, y, do_recv=False)
        t4 = clock()
        a2a.combine(out, idx, w, y, do_send=False)
        t5 = clock()
        for k, v in zip(times, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
            times[k].append(v * 1e6)
        calls.append(record_call(cfg, x, xs, idx, w, num, ex, exs, out))
    return {"calls": calls, "times": times}


_PLACEMENTS = {"host": "host-staged (the shared host segment)",
               "staged": "this node's rows in GPU memory (CUDA IPC), only rows to and from other nodes host-staged",
               "ipc": "GPU memory, same-node peers through CUDA IPC",
               "nic": "GPU memory registered with the NIC (cuMem POSIX FDs)"}


def _resolved(a2a, rank):
    """What `transport="auto"` and `buffers="auto"` resolved to on this rank."""
    return a2a.transport, a2a.placement, a2a.placement_reason


def run_demo(world_size: int = 4, node_size: int = 2, transport: str = "auto", device: str = "auto",
             iters: int | None = None, timeout_s: float = 60.0, wire: str = "per_route") -> int:
    from ..local import LocalCluster

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # DeepSeek-V3 decode sizes
        cfg = A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=7168,
                        in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16)
        iters = iters or 20
    else:  # the kernels run in the Triton interpreter: keep it small
        cfg = A2AConfig(max_num_tokens=16, num_experts=8 * world_size // 2, experts_per_token=4,
                        hidden_dim=96, in_dtype=torch.bfloat16, out_dtype=torch.bfloat16, expert_padding=4)
        iters = iters or 3
    cfg = wire_config(cfg, wire)
    print(f"moe-a2a demo: {world_size} ranks, {node_size} per node, transport={transport}, device={device}, "
          f"wire={wire}")
    print(f"  {cfg}")
    t0 = time.perf_counter()
    with LocalCluster(cfg, world_size=world_size, node_size=node_size, transport=transport, device=device,
                      timeout_s=timeout_s) as cluster:
        t1 = time.perf_counter()
        print(f"  cluster up in {t1 - t0:.1f} s")
        resolved, placement, reason = cluster.run(_resolved)[0]  # rank 0's view (all ranks agree)
        print(f"  transport: {resolved}" + (" (resolved from auto)" if transport == "auto" else ""))
        print(f"  send/recv buffers: {placement}: {_PLACEMENTS.get(placement, placement)}"
              + (f"\n    ({reason})" if reason else ""))
        results = cluster.run(rank_roundtrip, cfg.max_num_tokens, 0, iters)
    problems = check_against_reference(cfg, results, node_size=node_size)
    unit, scale = ("µs", 1.0) if device == "cuda" else ("ms", 1e-3)  # the interpreter takes milliseconds
    print(f"\n  {'phase':<16}{'median ' + unit:>12}{'min ' + unit:>12}   (over {iters} calls x {world_size} ranks; "
          f"first call excluded when iters > 1)")
    for phase in results[0]["times"]:
        vals = [v * scale for res in results for v in (res["times"][phase][1:] if iters > 1 else res["times"][phase])]
        print(f"  {phase:<16}{statistics.median(vals):>12.1f}{min(vals):>12.1f}")
    if device != "cuda":
        print("  (CPU: the Triton kernels run in the interpreter; GPU numbers are in docs/benchmarks.md)")
    if problems:
        print("\nMISMATCH against reference.py:")
        for p in problems:
            print("  " + p)
        return 1
    print(f"\n  all {iters} calls on all {world_size} ranks match reference.py "
          f"(counts, rows and untouched padding bitwise; weighted sum "
          f"within {default_max_ulps(device)} ulp of the reference's fp32 sum)")
    return 0
