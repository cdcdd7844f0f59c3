"""`moe-a2a demo`: a LocalCluster on this machine's default transport, dispatch -> toy expert ->
combine, checked against `reference.py`, with the latency of each phase.

The rank function is also what the end-to-end tests run (`rank_roundtrip`), so the demo and the
tests exercise the same path.
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import reference
from ..config import A2AConfig


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


def toy_expert(expert_x: torch.Tensor, expert_x_scale, cfg: A2AConfig) -> torch.Tensor:
    """A stand-in for the grouped GEMM: y = 2 * x (dequantised with its scales when present)."""
    y = expert_x.float()
    if expert_x_scale is not None:
        y = y * expert_x_scale.repeat_interleave(cfg.block_size, dim=1)[:, : cfg.hidden_dim]
    return (2 * y).to(cfg.out_dtype)


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
        t0 = clock()
        a2a.dispatch(num, ex, exs, x, xs, idx, do_recv=False)
        t1 = clock()
        a2a.dispatch(num, ex, exs, x, xs, idx, do_send=False)
        t2 = clock()
        rows = a2a.layout.max_dispatch_rows if cfg.expert_capacity else int(sum(
            (n + cfg.expert_padding - 1) // cfg.expert_padding * cfg.expert_padding for n in num.tolist()))
        y = toy_expert(ex, exs, cfg)
        t3 = clock()
        a2a.combine(out, idx, w, y, do_recv=False)
        t4 = clock()
        a2a.combine(out, idx, w, y, do_send=False)
        t5 = clock()
        for k, v in zip(times, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
            times[k].append(v * 1e6)
        calls.append({"x": x, "x_scale": xs, "indices": idx, "weights": w, "num": num.clone(),
                      "expert_x": ex[:rows].clone(), "expert_x_scale": None if exs is None else exs[:rows].clone(),
                      "out": out})
    return {"calls": calls, "times": times}


def check_against_reference(cfg: A2AConfig, results: list, atol: float = 1e-2, rtol: float = 1e-2) -> list[str]:
    """Compare every call of every rank with `reference`; return a list of problems (empty = all good)."""
    problems = []
    W = len(results)
    for it in range(len(results[0]["calls"])):
        calls = [res["calls"][it] for res in results]
        ref = reference.dispatch(cfg, [c["x"] for c in calls],
                                 [c["x_scale"] for c in calls] if cfg.has_scales else None,
                                 [c["indices"] for c in calls])
        ys = []
        for r, (num, ex, exs) in enumerate(ref):
            got = calls[r]
            if not torch.equal(got["num"], num):
                problems.append(f"call {it} rank {r}: expert counts {got['num'].tolist()} != {num.tolist()}")
                continue
            pad_rows = _live_rows(cfg, num)
            if not torch.equal(got["expert_x"][pad_rows].view(torch.uint8), ex[pad_rows].view(torch.uint8)):
                problems.append(f"call {it} rank {r}: expert_x differs from the reference")
            if exs is not None and not torch.equal(got["expert_x_scale"][pad_rows], exs[pad_rows]):
                problems.append(f"call {it} rank {r}: expert_x_scale differs from the reference")
            ys.append(toy_expert(ex, exs, cfg))
        if len(ys) != W:
            continue
        outs = reference.combine(cfg, [c["indices"] for c in calls], [c["weights"] for c in calls], ys)
        for r in range(W):
            if not torch.allclose(calls[r]["out"].float(), outs[r].float(), atol=atol, rtol=rtol):
                err = (calls[r]["out"].float() - outs[r].float()).abs().max().item()
                problems.append(f"call {it} rank {r}: combine differs from the reference (max error {err:.3g})")
    return problems


def _live_rows(cfg: A2AConfig, num: torch.Tensor) -> torch.Tensor:
    """Indices of non-padding rows of an expert-major tensor with per-expert counts `num`."""
    rows, start = [], 0
    for n in num.tolist():
        rows.extend(range(start, start + n))
        start += cfg.expert_capacity or (n + cfg.expert_padding - 1) // cfg.expert_padding * cfg.expert_padding
    return torch.tensor(rows, dtype=torch.int64)


_PLACEMENTS = {"host": "host-staged (the shared host segment)",
               "staged": "this node's rows in GPU memory (CUDA IPC), only rows to and from other nodes host-staged",
               "ipc": "GPU memory, same-node peers through CUDA IPC",
               "nic": "GPU memory registered with the NIC (cuMem POSIX FDs)"}


def _resolved(a2a, rank):
    """What `transport="auto"` and `buffers="auto"` resolved to on this rank."""
    return a2a.transport, a2a.placement, a2a.placement_reason


def run_demo(world_size: int = 4, node_size: int = 2, transport: str = "auto", device: str = "auto",
             iters: int | None = None, timeout_s: float = 60.0) -> int:
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
    print(f"moe-a2a demo: {world_size} ranks, {node_size} per node, transport={transport}, device={device}")
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
    problems = check_against_reference(cfg, results)
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
          f"(data movement bitwise, weighted sum to fp32 tolerance)")
    return 0
