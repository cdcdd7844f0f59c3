"""Transport micro-benchmarks: ``python -m benchmarks.transport [--provider tcp,shm] [--iters N] [--json PATH]``,
from the repository root.

Measures, per provider, between real processes on this machine:

- **Python cost per write**: time inside ``TransferEngine.scatter`` per write with the C call replaced by
  a no-op of the same prototype (what the engine itself costs, ctypes call included);
- **scatter to 1, 7 and 63 peers**: time to post one scatter (one write + immediate per peer) and time
  until every write completed locally. 63 peers are 63 engines (own fabric/domain/endpoint/CQ each) in
  at most 3 receiver processes (21 engines each), because the CI machine has 2 cores: each receiver
  process polls all its engines' CQs round-robin;
- **write+imm round trip**: ping-pong of an 8-byte write with immediate between 2 processes (median);
- **256 KiB write bandwidth**: a stream of 256 KiB writes, timed until the receiver acknowledged the
  last immediate;
- next to C ``fi_pingpong`` (libfabric-bin; two-sided send/recv, RDM) when installed;
- **the proxy's arithmetic per call** (``--plan-worlds``): validating the count matrix and planning the
  dispatch and combine writes of one rank (``plan``) at the decode configuration for 8, 64, 256 ranks.

Results are medians over ``--iters`` after warm-up (rxm connects lazily on the first writes).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

from moe_a2a.proxy.engine import TransferEngine
from moe_a2a.bench._util import choice_list, int_list, positive_int

PING, PONG, DATA, DONE = 0x1001, 0x1002, 0x1003, 0x1004
SCATTER_BYTES = 1024  # per peer per scatter: the size of a decode-step private write (a few tokens)
BW_BYTES = 256 * 1024


# ------------------------------------------------------------------------------------------ children


def _receiver(conn, provider: str, num_engines: int, nbytes: int) -> None:
    """Host ``num_engines`` engines with one registered buffer each; progress them until told to stop.
    Sends ``[(address, descriptor)]`` first."""
    engines, bufs, out = [], [], []
    for _ in range(num_engines):
        eng = TransferEngine(provider)
        buf = ctypes.create_string_buffer(nbytes)
        region = eng.register(ctypes.addressof(buf), nbytes)
        engines.append(eng)
        bufs.append(buf)
        out.append((eng.address, region.descriptor()))
    conn.send(out)
    loops = 0
    while True:
        handled = 0
        for eng in engines:
            handled += eng.progress()
        loops += 1
        if not handled:
            os.sched_yield()  # other busy processes share the 2 cores of the CI machine
        if loops % 256 == 0 and conn.poll():
            break
    for eng in engines:
        eng.close()
    conn.send("closed")


def _connect_one(eng: TransferEngine, conn, spawned: bool):
    """Register one buffer and connect to the benchmark's other process over `conn` (the spawned
    side sends its address first). Returns (buffer, region, group); keep the buffer alive."""
    buf = ctypes.create_string_buffer(BW_BYTES)
    region = eng.register(ctypes.addressof(buf), BW_BYTES)
    mine = (eng.address, region.descriptor())
    if spawned:
        conn.send(mine)
        addr, desc = conn.recv()
    else:
        addr, desc = conn.recv()
        conn.send(mine)
    [peer] = eng.connect([addr])
    return buf, region, eng.peer_group([peer], [desc])


def _one_peer(conn, provider: str):
    """The spawned side: an engine connected to the benchmark's main process."""
    eng = TransferEngine(provider)
    return (eng, *_connect_one(eng, conn, spawned=True))


def _pong(conn, provider: str, count: int) -> None:
    """Answer each PING write with a PONG write (8 bytes + immediate), ``count`` times."""
    eng, buf, region, grp = _one_peer(conn, provider)
    target = [(0, 0, 8, 0)]
    ping = {PING: 1}
    for _ in range(count):
        eng.wait_imms(ping, 30, "ping")
        eng.scatter(grp, region, target, PONG)
    eng.wait_writes(30)
    conn.send("done")
    conn.recv()
    eng.close()


def _sink(conn, provider: str, count: int) -> None:
    """Receive ``count`` DATA writes, then acknowledge with DONE."""
    eng, buf, region, grp = _one_peer(conn, provider)
    eng.wait_imms({DATA: count}, 120, "bandwidth stream")
    eng.barrier(grp, DONE)
    eng.wait_writes(30)
    conn.send("done")
    conn.recv()
    eng.close()


# ------------------------------------------------------------------------------------------ benches


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    child.close()
    return p, parent


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


WARMUP_SCATTERS = 3000  # before the timed ones in bench_python_post_cost


def bench_python_post_cost(provider: str, num_peers: int, iters: int) -> dict:
    """Python cost of ``scatter`` per write with the C call made free: the group's ``fi_writemsg``
    pointers are swapped for libc ``strlen`` on an empty string (same ctypes prototype, returns 0,
    ~ns of C), so what remains is the engine's Python (validation, template patching, context
    bookkeeping) plus the ctypes call overhead itself. Measurement harness only: it reaches into the
    group's per-peer tuples and recycles the engine's contexts, since no completion will come."""
    import ctypes.util

    from moe_a2a.proxy.libfabric import WRITEMSG_PROTO

    eng = TransferEngine(provider)
    try:
        buf = ctypes.create_string_buffer(SCATTER_BYTES * num_peers)
        region = eng.register(ctypes.addressof(buf), SCATTER_BYTES * num_peers)
        [me] = eng.connect([eng.address])
        grp = eng.peer_group([me] * num_peers, [region.descriptor()] * num_peers)
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        null_call = WRITEMSG_PROTO(ctypes.cast(libc.strlen, ctypes.c_void_p).value)
        empty = ctypes.create_string_buffer(1)
        grp.post_info = tuple((null_call, ctypes.addressof(empty)) + info[2:] for info in grp.post_info)
        targets = [(i, i * SCATTER_BYTES, SCATTER_BYTES, 0) for i in range(num_peers)]
        free, all_ctx = eng._free_ctx, list(eng._free_ctx)
        times = []
        perf = time.perf_counter
        # Untimed warm-up first: on the GPU host the first few thousand scatters of a fresh process cost
        # up to 1.6x the steady state (benchmarks/gpu/post_jitter.py), which the proxy, a long-lived process,
        # pays once.
        warmup = max(WARMUP_SCATTERS, iters // 5)
        for i in range(warmup + iters):
            t0 = perf()
            eng.scatter(grp, region, targets, DATA)
            t1 = perf()
            if i >= warmup:
                times.append(t1 - t0)
            free[:] = all_ctx  # no completion will come: hand every context back
    finally:
        eng.close()
    return {"peers": num_peers, "python_us_per_write_median": statistics.median(times) * 1e6 / num_peers,
            "python_us_per_write_min": min(times) * 1e6 / num_peers}


def bench_scatter(provider: str, num_peers: int, iters: int) -> dict:
    """Scatter of SCATTER_BYTES to each of ``num_peers`` engines in up to 3 receiver processes."""
    procs = min(num_peers, 3)
    per = [num_peers // procs + (i < num_peers % procs) for i in range(procs)]
    children = [_spawn(_receiver, provider, n, SCATTER_BYTES) for n in per]
    remote = [x for _, c in children for x in c.recv()]
    eng = TransferEngine(provider)
    try:
        buf = ctypes.create_string_buffer(SCATTER_BYTES * num_peers)
        src = eng.register(ctypes.addressof(buf), SCATTER_BYTES * num_peers)
        peers = eng.connect([a for a, _ in remote])
        grp = eng.peer_group(peers, [d for _, d in remote])
        targets = [(i, i * SCATTER_BYTES, SCATTER_BYTES, 0) for i in range(num_peers)]
        post, total = [], []
        perf = time.perf_counter
        for it in range(iters + 50):  # the first 50 connect lazily (EAGAIN retries): not measured
            t0 = perf()
            eng.scatter(grp, src, targets, DATA)
            t1 = perf()
            eng.wait_writes(30)
            t2 = perf()
            if it >= 50:
                post.append(t1 - t0)
                total.append(t2 - t0)
        retries = eng.eagain_retries
    finally:
        eng.close()
        for p, c in children:
            c.send("stop")
            c.recv()
            p.join(10)
    med_post = statistics.median(post)
    return {"peers": num_peers, "receiver_processes": procs, "bytes_per_peer": SCATTER_BYTES,
            "post_us_median": med_post * 1e6, "post_us_p99": _pct(post, 0.99) * 1e6,
            "post_us_per_write": med_post * 1e6 / num_peers,
            "completed_us_median": statistics.median(total) * 1e6, "eagain_retries": retries}


def bench_rtt(provider: str, iters: int) -> dict:
    warm = 100
    p, conn = _spawn(_pong, provider, iters + warm)
    eng = TransferEngine(provider)
    try:
        buf, region, grp = _connect_one(eng, conn, spawned=False)
        target = [(0, 0, 8, 0)]
        pong = {PONG: 1}
        rtts = []
        perf = time.perf_counter
        for it in range(iters + warm):
            t0 = perf()
            eng.scatter(grp, region, target, PING)
            eng.wait_imms(pong, 30, "pong")
            if it >= warm:
                rtts.append(perf() - t0)
        conn.recv()
        conn.send("close")
        eng.wait_writes(30)
    finally:
        eng.close()
        p.join(10)
    return {"rtt_us_median": statistics.median(rtts) * 1e6, "rtt_us_p99": _pct(rtts, 0.99) * 1e6}


def bench_bandwidth(provider: str, count: int) -> dict:
    p, conn = _spawn(_sink, provider, count)
    eng = TransferEngine(provider)
    try:
        buf, region, grp = _connect_one(eng, conn, spawned=False)
        target = [(0, 0, BW_BYTES, 0)]
        t0 = time.perf_counter()
        for _ in range(count):
            eng.scatter(grp, region, target, DATA)
        eng.wait_imms({DONE: 1}, 120, "bandwidth ack")
        dt = time.perf_counter() - t0
        eng.wait_writes(30)
        conn.recv()
        conn.send("close")
    finally:
        eng.close()
        p.join(10)
    return {"bw_GBps": count * BW_BYTES / dt / 1e9, "writes": count, "bytes_per_write": BW_BYTES}


def bench_fi_pingpong(provider: str, size: int, iters: int) -> dict | None:
    """C ``fi_pingpong`` (send/recv over an RDM endpoint) server+client on 127.0.0.1; None if missing."""
    exe = shutil.which("fi_pingpong")
    if exe is None:
        return None
    cmd = [exe, "-p", provider, "-e", "rdm", "-I", str(iters), "-S", str(size)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.5)  # the server must listen on its control port before the client connects
        out = subprocess.run(cmd + ["127.0.0.1"], capture_output=True, text=True, timeout=120).stdout
    except subprocess.TimeoutExpired:
        return {"error": "fi_pingpong timed out"}
    finally:
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    # Header: bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
    for line in out.splitlines():
        m = re.match(r"\s*(\S+)\s+\S+\s+\S+\s+\S+\s+(\S+)s\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", line)
        if m and m.group(1) != "bytes":
            return {"size": size, "iters": iters, "MBps": float(m.group(3)), "usec_per_xfer": float(m.group(4))}
    return {"error": f"could not parse fi_pingpong output: {out!r}"}


# ------------------------------------------------------------------------------------------ main


def bench_proxy_plan(world_size: int, iters: int) -> dict:
    """Python time the proxy spends per call on arithmetic (no waiting, no posting): everything
    `Proxy.run_epoch` computes from the count matrix, at DeepSeek-V3 decode sizes (T=128, K=8,
    E=max(256, W), 8 ranks per node), uniform random routing."""
    import numpy as np
    import torch

    from moe_a2a.protocol import plan
    from moe_a2a.config import A2AConfig

    W, r = world_size, min(3, world_size - 1)
    cfg = A2AConfig(max_num_tokens=128, num_experts=max(256, W), experts_per_token=8, hidden_dim=7168,
                    in_dtype=torch.float8_e4m3fn)
    lay = cfg.layout(W, min(8, W))
    rng = np.random.default_rng(0)
    routing = np.stack([np.bincount(rng.integers(0, lay.num_experts, 128 * 8), minlength=lay.num_experts)
                        for _ in range(W)]).astype(np.int32)
    send, recv = lay.send_offset_bytes, lay.recv_offset_bytes

    def one_call():
        private = plan.group_targets(plan.private_writes(routing[r].astype(np.int64), r, lay), r, send, recv)
        counts = routing.astype(np.int64)
        plan.validate_counts(counts, lay)
        routes = plan.route_matrix(counts, lay)
        remainder = plan.group_targets(plan.remainder_writes(routes, r, lay), r, send, recv)
        plan.expected_dispatch_imms(routes, r, lay)
        combine = plan.group_targets(plan.combine_writes(routes, r, lay), r, send, recv)
        return len(private) + len(remainder) + len(combine)

    writes = one_call()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        one_call()
        times.append(time.perf_counter() - t0)
    return {"world_size": W, "writes_planned": writes, "plan_us_median": statistics.median(times) * 1e6,
            "plan_us_min": min(times) * 1e6}


def run(provider: str, iters: int, peer_counts: list[int]) -> dict:
    res: dict = {"provider": provider}
    res["python_post"] = [bench_python_post_cost(provider, n, iters) for n in peer_counts]
    res["scatter"] = [bench_scatter(provider, n, iters) for n in peer_counts]
    res["rtt"] = bench_rtt(provider, iters)
    res["bandwidth"] = bench_bandwidth(provider, max(100, iters // 5))
    res["fi_pingpong_64B"] = bench_fi_pingpong(provider, 64, max(iters, 10000))
    res["fi_pingpong_256KiB"] = bench_fi_pingpong(provider, BW_BYTES, 200)
    return res


def format_table(results: list[dict], plans: list[dict] = ()) -> str:
    rows = [("provider", "metric", "value")]
    for c in plans:
        rows.append(("-", f"proxy arithmetic per call, {c['world_size']:>3} ranks (median / min)",
                     f"{c['plan_us_median']:.1f} / {c['plan_us_min']:.1f} us"))
    for r in results:
        p = r["provider"]
        for c in r["python_post"]:
            rows.append((p, f"Python cost per write, {c['peers']:>2} targets (median / min)",
                         f"{c['python_us_per_write_median']:.2f} / {c['python_us_per_write_min']:.2f} us"))
        for s in r["scatter"]:
            rows.append((p, f"scatter {s['peers']:>2} peers: post (median / p99)",
                         f"{s['post_us_median']:.1f} / {s['post_us_p99']:.1f} us"))
            rows.append((p, f"scatter {s['peers']:>2} peers: post per write", f"{s['post_us_per_write']:.2f} us"))
            rows.append((p, f"scatter {s['peers']:>2} peers: all completed", f"{s['completed_us_median']:.1f} us"))
        rows.append((p, "write+imm round trip (median / p99)",
                     f"{r['rtt']['rtt_us_median']:.1f} / {r['rtt']['rtt_us_p99']:.1f} us"))
        rows.append((p, "256 KiB write bandwidth", f"{r['bandwidth']['bw_GBps']:.2f} GB/s"))
        for key, label in (("fi_pingpong_64B", "C fi_pingpong 64 B (one-way)"),
                           ("fi_pingpong_256KiB", "C fi_pingpong 256 KiB")):
            v = r.get(key)
            if v is None:
                rows.append((p, label, "fi_pingpong not installed"))
            elif "error" in v:
                rows.append((p, label, v["error"][:60]))
            else:
                rows.append((p, label, f"{v['usec_per_xfer']:.2f} us, {v['MBps'] / 1000:.2f} GB/s"))
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `python -m benchmarks.transport`."""
    ap.add_argument("--provider", default="tcp,shm", type=choice_list(("tcp", "shm", "efa", "verbs"), allow_empty=True),
                    help="comma-separated: tcp, shm, efa, verbs; '' for none (default tcp,shm)")
    ap.add_argument("--iters", type=positive_int, default=2000, help="measured iterations per benchmark (default 2000)")
    ap.add_argument("--peers", default="1,7,63", type=int_list(1), help="scatter peer counts (default 1,7,63)")
    ap.add_argument("--plan-worlds", default="8,64,256", type=int_list(1, allow_empty=True),
                    help="world sizes for the proxy-arithmetic benchmark, '' to skip (default 8,64,256)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return ap


def run_args(args) -> int:
    from moe_a2a.proxy import libfabric as lf

    if args.provider:  # before anything is spawned: a missing provider is the user's mistake, not a crash
        available = lf.list_providers()
        missing = [p for p in args.provider if lf.PROVIDER_NAMES[p] not in available]
        if missing:
            raise ValueError(f"--provider {','.join(missing)}: not offered by libfabric here "
                             f"(available: {available}; efa and verbs need their devices)")
    plans = [bench_proxy_plan(w, args.iters) for w in args.plan_worlds]
    results = [run(p, args.iters, args.peers) for p in args.provider]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "iters": args.iters}
    print(f"# {meta}")
    print(format_table(results, plans))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "proxy_plan": plans}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    from ._cli import main as cli_main

    return cli_main("transport", __doc__.splitlines()[0], add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
