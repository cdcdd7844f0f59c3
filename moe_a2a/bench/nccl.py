"""The baseline users write today: dispatch and combine with `torch.distributed.all_to_all_single`.

Per call, as in most MoE codebases: sort this rank's routes by destination rank, exchange the
per-rank counts (one small all-to-all, then a host sync for the split sizes), exchange the token
bytes (fp8 payload + fp32 scales as one byte row) and the expert ids, sort the received rows by
expert; combine sends expert outputs back with the reversed splits and forms the weighted sum with
`index_add_`. Timed with CUDA events per rank (`--backend gloo` runs the same code on CPU, for tests).

    moe-a2a bench nccl --world 2 --preset decode --iters 200     (or python -m moe_a2a.bench.nccl ...)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ._util import nonneg_int, positive_int, refuse_without_cuda


def _stats(v):
    s = sorted(v)
    return {"median": statistics.median(s), "p10": s[len(s) // 10], "p90": s[min(len(s) - 1, 9 * len(s) // 10)],
            "min": s[0], "max": s[-1], "n": len(s)}


def _rank(rank: int, world: int, port: int, backend: str, sizes: dict, iters: int, warmup: int, queue) -> None:
    import torch
    import torch.distributed as dist

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    T, E, K, H = sizes["max_num_tokens"], sizes["num_experts"], sizes["experts_per_token"], sizes["hidden_dim"]
    L, S = E // world, (H + 127) // 128
    g = torch.Generator().manual_seed(rank)
    row_bytes = H + 4 * S  # fp8 payload + fp32 scales, as bytes
    payload = torch.randint(0, 255, (T, row_bytes), generator=g, dtype=torch.uint8).to(dev)
    sets = [torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(dev) for _ in range(4)]
    w = torch.rand(T, K, generator=g).to(dev)
    times = {"dispatch": [], "combine": []}

    def clock():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def span(a, b):
        if cuda:
            b.synchronize()
            return a.elapsed_time(b) * 1e3
        return (b - a) * 1e6

    for it in range(warmup + iters):
        idx = sets[it % len(sets)]
        dist.barrier()
        t0 = clock()
        # ---- dispatch
        e = idx.flatten()
        dest = e // L
        order = torch.argsort(dest, stable=True)
        send = payload.index_select(0, order // K)
        send_e = e[order].to(torch.int32)
        send_counts = torch.bincount(dest, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()  # host sync, as users do
        n = sum(out_splits)
        recv = torch.empty(n, row_bytes, dtype=torch.uint8, device=dev)
        recv_e = torch.empty(n, dtype=torch.int32, device=dev)
        dist.all_to_all_single(recv, send, out_splits, in_splits)
        dist.all_to_all_single(recv_e, send_e, out_splits, in_splits)
        perm = torch.argsort(recv_e, stable=True)
        expert_x = recv.index_select(0, perm)                      # expert-major, ready for a GEMM
        t1 = clock()
        # ---- combine (the toy expert output: bf16 rows of the same count)
        y = expert_x[:, :H].view(torch.float8_e4m3fn).to(torch.bfloat16) if cuda else \
            expert_x[:, :H].to(torch.bfloat16)
        back = torch.empty_like(y)
        back[perm] = y                                             # undo the expert sort
        home = torch.empty(T * K, H, dtype=torch.bfloat16, device=dev)
        dist.all_to_all_single(home, back, in_splits, out_splits)
        out = torch.zeros(T, H, dtype=torch.float32, device=dev)
        out.index_add_(0, order // K, home.float() * w.flatten()[order, None])
        out = out.to(torch.bfloat16)
        t2 = clock()
        if it >= warmup:
            times["dispatch"].append(span(t0, t1))
            times["combine"].append(span(t1, t2))
    queue.put((rank, {k: _stats(v) for k, v in times.items()}))
    dist.destroy_process_group()


def run(world: int = 2, preset: str = "decode", backend: str = "nccl", iters: int = 200, warmup: int = 20,
        sizes: dict | None = None) -> list[dict]:
    import multiprocessing as mp
    import socket

    from .kernels import PRESETS

    sizes = sizes or PRESETS[preset]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, backend, sizes, iters, warmup, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return [results[r] for r in range(world)]


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options (shared by `moe-a2a bench nccl` and `python -m moe_a2a.bench.nccl`)."""
    ap.add_argument("--world", type=positive_int, default=2, help="ranks, one per GPU (default 2)")
    ap.add_argument("--preset", default="decode", choices=["decode", "prefill"], help="sizes (default decode)")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="gloo: CPU, for tests")
    ap.add_argument("--iters", type=positive_int, default=200, help="timed calls (default 200)")
    ap.add_argument("--warmup", type=nonneg_int, default=20, help="untimed calls first (default 20)")
    ap.add_argument("--json", default=None, help="write results here")
    return ap


def run_args(args) -> int:
    if args.backend == "nccl" and (rc := refuse_without_cuda("moe-a2a bench nccl")):
        return rc
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared machines)
    res = run(args.world, args.preset, args.backend, args.iters, args.warmup)
    print(f"all_to_all_single baseline ({args.backend}), {args.world} ranks, {args.preset}: median µs per rank")
    for phase in ("dispatch", "combine"):
        print(f"  {phase:<9}" + "".join(f"{r[phase]['median']:>10.1f}" for r in res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "world": args.world, "preset": args.preset,
                       "backend": args.backend, "per_rank": res}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_a2a.bench.nccl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    return run_args(add_arguments(ap).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
