"""The proxy's host cost per phase: ``python -m benchmarks.proxy [--worlds 8,16,...] [--provider tcp|shm|auto]
[--epochs N] [--json PATH] [--quick]``, from the repository root (docs/benchmarks.md, "Proxy host cost").

The real proxy step loop, nothing emulated on its side: one `Proxy` process (`moe_a2a/proxy/worker.py`)
started by `ProxyHandle` with a `ProxySpec` exactly as `runtime/wiring.py` starts it (host-staged buffers
in the rank's `SharedSegment`, a busy-polling proxy, its own `TransferEngine` on a real provider), for
rank 0 of a world of W ranks, one rank per node (every other rank remote). This process plays rank 0's
*model*: per call it writes the three write tables exactly as the kernels write them
(`triton_kernels/write_plan.py`, run once per routing set and checked against `protocol/plan.py`) and
raises the GPU -> proxy flags in the kernels' order, waiting for the proxy's.

The W - 1 remote ranks are **synthetic peers**: one helper process with its own `TransferEngine`(s) on the
same provider impersonates all of them (one registered region per peer, reserved with MAP_NORESERVE so
only what is written costs memory). Per call it sends what W - 1 real peers send rank 0 (each peer's
private write: its count row then min(n, P) rows, imm DISPATCH or DISPATCH_MORE; a remainder write after
a DISPATCH_MORE; its combine write), with the rows `protocol/plan.py` gives every peer, and it progresses
its CQs so rank 0's writes land. It sends call e's writes as soon as it has received rank 0's combine
writes of call e - 1 (immediates carry the epoch, so early arrivals are part of the protocol), and this
process waits for them (plus `gap_s`) before it starts call e: what is timed is the proxy's own work,
not the peers' latency.

Reported per world size, from the proxy's own trace (`Flag.TRACE`, `protocol.words.TRACE_EVENTS`):

- ``dispatch_host_us`` = dispatch_received - send_ready_seen: post the PRIVATE table, count every
  peer's immediate, post the REMAINDER table, count the remainders;
- ``combine_host_us`` = combine_received - combine_send_seen: post the COMBINE table, count the
  combine immediates;
- the posting parts alone (``dispatch_post_us`` = private_posted - send_ready_seen,
  ``combine_post_us`` = combine_posted - combine_send_seen), the other steps between, and the completion
  waits (``*_writes_wait_us``: until the proxy's own writes completed).

Median and p90 over the timed calls, beside the goal ``10 + 0.9 * remote_peers`` µs per phase (the project's goal).

For the in-run factor (the proxy's cost inside a real run divided by this bench's): `proxy_phase_us`
takes one `AllToAll.trace()` (or this bench's raw trace) and returns the same deltas; `summarize` and
`in_run_factor` do the rest::

    a2a.set_tracing(True)
    samples = []
    for _ in range(200):
        ...dispatch + combine...
        samples.append(proxy_phase_us(a2a.trace()))   # latest=True for CUDA-graph replays
    factor = in_run_factor(summarize(samples), bench_row)   # bench_row: one entry of the JSON's "results"

or straight from `moe-a2a bench e2e --trace-proxy --json e2e.json` (same spans, "proxy.*" per rank):
`in_run_factor(e2e["per_rank"][0], bench_row)`.
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection

import numpy as np

from moe_a2a.protocol.words import ERROR_TIMEOUT, TRACE_EVENTS, Flag, Imm, WriteTable, encode_imm
from moe_a2a.bench._util import int_list, nonneg_float, nonneg_int, positive_float, positive_int

DEFAULT_WORLDS = (8, 16, 32, 64, 128, 256)
GOAL_BASE_US, GOAL_PER_PEER_US = 10.0, 0.9
GOAL = f"{GOAL_BASE_US:g} + {GOAL_PER_PEER_US:g} * remote_peers µs per phase"
EPOCH_MASK = 0xFFFF  # the epoch bits of an immediate (protocol.words.IMM_EPOCH_BITS)
STARTUP_S = 60.0     # start-up waits (a proxy importing on a loaded 2-core machine), as runtime/wiring.py

# (start event, end event) of every reported span, in the proxy's order.
PHASES = {
    "dispatch_host_us": ("send_ready_seen", "dispatch_received"),
    "combine_host_us": ("combine_send_seen", "combine_received"),
    "dispatch_post_us": ("send_ready_seen", "private_posted"),
    "dispatch_imms_rows_us": ("private_posted", "count_rows_received"),
    "remainder_us": ("count_rows_received", "remainder_posted"),
    "dispatch_tail_us": ("remainder_posted", "dispatch_received"),
    "dispatch_writes_wait_us": ("dispatch_received", "dispatch_writes_done"),
    "combine_post_us": ("combine_send_seen", "combine_posted"),
    "combine_imms_us": ("combine_posted", "combine_received"),
    "combine_writes_wait_us": ("combine_received", "combine_writes_done"),
}
PHASE_HELP = {
    "dispatch_host_us": "SEND_READY seen -> DISPATCH_RECV_READY: the dispatch phase's host work",
    "combine_host_us": "COMBINE_SEND_READY seen -> COMBINE_RECV_READY: the combine phase's host work",
    "dispatch_post_us": "posting the PRIVATE table (one write per remote peer)",
    "dispatch_imms_rows_us": "counting the peers' private immediates (and raising COUNT_ROWS_READY)",
    "remainder_us": "REMAINDER_PLANNED seen, posting the REMAINDER table",
    "dispatch_tail_us": "the writes-posted count, counting the remainder immediates",
    "dispatch_writes_wait_us": "until the proxy's dispatch writes completed locally",
    "combine_post_us": "posting the COMBINE table",
    "combine_imms_us": "counting the combine immediates",
    "combine_writes_wait_us": "until the proxy's combine writes completed locally",
}


def goal_us(remote_peers: int) -> float:
    """The goal for one phase's host time: 10 µs + 0.9 µs per remote peer."""
    return GOAL_BASE_US + GOAL_PER_PEER_US * remote_peers


# ---- the in-run comparison ----------------------------------------------------------------------------
def proxy_phase_us(trace) -> dict[str, float]:
    """The spans of `PHASES` (µs) of one call's proxy trace: an `AllToAll.trace()` dict (its "proxy"
    part), a {event: t_ns} dict, or this bench's raw `[len(TRACE_EVENTS), 2]` (epoch, ns) array. Spans
    whose events are missing (not traced, node-local call, another epoch) are left out."""
    if isinstance(trace, dict):
        stamps = trace.get("proxy", trace)
    else:
        rows = np.asarray(trace).reshape(len(TRACE_EVENTS), 2)
        epoch = int(rows[TRACE_EVENTS.index("send_ready_seen"), 0])
        stamps = {name: int(t) for name, (e, t) in zip(TRACE_EVENTS, rows.tolist()) if e == epoch}
    return {k: (stamps[b] - stamps[a]) / 1e3 for k, (a, b) in PHASES.items() if a in stamps and b in stamps}


def _quantiles(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "min": s[0],
            "max": s[-1], "n": len(s)}


def summarize(samples: list[dict]) -> dict[str, dict]:
    """Per span: median, p90, min, max, n over `proxy_phase_us` samples."""
    keys = [k for k in PHASES if any(k in s for s in samples)]
    return {k: _quantiles([s[k] for s in samples if k in s]) for k in keys}


# `moe-a2a bench e2e --trace-proxy` keeps the same spans per rank as "proxy.<name>" (bench/main.py, PROXY_SPANS).
E2E_SPAN_NAMES = {"proxy.dispatch_proxy": "dispatch_host_us", "proxy.combine_proxy": "combine_host_us",
                  "proxy.private_post": "dispatch_post_us", "proxy.combine_post": "combine_post_us",
                  "proxy.remainder": "remainder_us"}


def in_run_factor(in_run: dict, bench_row: dict) -> dict[str, float]:
    """In-run proxy cost / this bench's, per phase (medians). `in_run`: `summarize`'s output, or one rank's
    entry of `bench e2e --trace-proxy`'s "per_rank" (its "proxy.*" spans); `bench_row`: one entry of this
    bench's JSON "results" (the same world size and provider, ideally)."""
    spans = dict(in_run)
    spans.update({E2E_SPAN_NAMES[k]: v for k, v in in_run.items() if k in E2E_SPAN_NAMES})
    out = {}
    for k in ("dispatch_host_us", "combine_host_us", "dispatch_post_us", "combine_post_us", "remainder_us"):
        ref = bench_row.get(k) or bench_row.get("parts", {}).get(k)
        if k in spans and ref and ref["median"] > 0:
            out[k] = spans[k]["median"] / ref["median"]
    return out


# ---- routings, tables, the peers' writes ------------------------------------------------------------
def routing_sets(lay, tokens: int, topk: int, sets: int, seed: int) -> np.ndarray:
    """`[sets, W, E]` int32 count rows: every rank routes `tokens` tokens to `topk` distinct experts,
    uniformly at random (the docs' decode workload)."""
    W, E = lay.world_size, lay.num_experts
    rng = np.random.default_rng(seed)
    out = np.zeros((sets, W, E), np.int32)
    for s in range(sets):
        for w in range(W):
            keys = rng.random((tokens, E))
            chosen = np.argpartition(keys, topk - 1, axis=1)[:, :topk] if topk < E else np.argsort(keys, axis=1)
            out[s, w] = np.bincount(chosen.ravel(), minlength=E)
    return out


def expected_tables(counts: np.ndarray, rank: int, lay) -> tuple[np.ndarray, int]:
    """`[3, W, 4]` int64 rows of `protocol.plan` (+ immediates of epoch 0) for this rank's remote peers,
    zero elsewhere, and the number of remainder writes: what the kernels must write."""
    from moe_a2a.protocol import plan

    W, P = lay.world_size, lay.private_rows
    out = np.zeros((int(WriteTable.NUM_TABLES), W, 4), np.int64)
    routes = plan.route_matrix(counts.astype(np.int64), lay)
    for peer, src, n, dst in plan.private_writes(counts[rank].astype(np.int64), rank, lay).tolist():
        kind = Imm.DISPATCH_MORE if routes[rank, peer] > P else Imm.DISPATCH
        out[WriteTable.PRIVATE, peer] = (src, n, dst, encode_imm(kind, rank, 0))
    rem = plan.remainder_writes(routes, rank, lay)
    for peer, src, n, dst in rem.tolist():
        out[WriteTable.REMAINDER, peer] = (src, n, dst, encode_imm(Imm.DISPATCH_REMAINDER, rank, 0))
    for peer, src, n, dst in plan.combine_writes(routes, rank, lay).tolist():
        out[WriteTable.COMBINE, peer] = (src, n, dst, encode_imm(Imm.COMBINE, rank, 0))
    return out, len(rem)


def kernel_tables(counts: np.ndarray, rank: int, lay, device: str = "cpu") -> tuple[np.ndarray, int]:
    """The write tables as the kernels write them (`plan_private_writes`, then
    `plan_remainder_and_combine_writes` once COUNT_ROWS_READY is up), for epoch 0 (the immediates' epoch
    bits are patched per call), and Flag.REMAINDER_WRITES; checked against `expected_tables`. CPU tensors
    need TRITON_INTERPRET=1 (set before triton is first imported)."""
    import torch

    from moe_a2a.protocol.words import flag_word
    from moe_a2a.triton_kernels import write_plan
    from moe_a2a.triton_kernels.node_sync import NodeSync

    W, dev = lay.world_size, torch.device(device)
    flags = torch.zeros(flag_word(Flag.NUM_FLAGS), dtype=torch.int64, device=dev)
    epoch = torch.zeros(1, dtype=torch.int64, device=dev)
    node = NodeSync(epoch=epoch, failed=torch.zeros(1, dtype=torch.int64, device=dev),
                    counter=torch.zeros(2, dtype=torch.int32, device=dev), flags=flags,
                    peer_sync_bytes=torch.full((W,), -1, dtype=torch.int64, device=dev), sync_bytes=0, rank=rank,
                    node_first=lay.node_of(rank) * lay.node_size, node_size=lay.node_size, dispatch_ready_bytes=0,
                    combine_ready_bytes=0, counts_bytes=0, num_experts=lay.num_experts, timeout_s=10.0,
                    with_proxy=True, kernel_waits=False)
    c = torch.tensor(counts, dtype=torch.int32, device=dev)
    # The remote rows as the private writes leave them: at the head of each private slot of the recv
    # buffer, where the plan kernel copies them from.
    base = torch.zeros(lay.private_header_offset_bytes(W - 1) + lay.routing_row_bytes, dtype=torch.uint8)
    for s in lay.remote_peers(rank):
        at = lay.private_header_offset_bytes(s)
        base[at: at + lay.routing_row_bytes] = torch.tensor(counts[s], dtype=torch.int32).view(torch.uint8)
    base = base.to(dev)
    tables = torch.full((int(WriteTable.NUM_TABLES), 1, W, 4), -7, dtype=torch.int64, device=dev)  # whole writes
    write_plan.plan_private_writes(c, tables, epoch, flags, rank, lay)
    write_plan.plan_remainder_and_combine_writes(c, tables, node, base, 0, rank, lay)
    tables = tables[:, 0]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    got = tables.cpu().numpy().copy()
    remainders = int(flags[flag_word(Flag.REMAINDER_WRITES)])
    want, n_rem = expected_tables(counts, rank, lay)
    if int(node.failed) or not np.array_equal(got, want) or remainders != n_rem:
        bad = np.argwhere((got != want).any(-1))[:4].tolist()
        raise AssertionError(f"write tables of the kernels differ from protocol.plan's (rank {rank}, W={W}): "
                             f"(table, peer) {bad}, REMAINDER_WRITES {remainders} vs {n_rem}, failed {int(node.failed)}")
    return got, remainders


def peer_writes(lay, rank: int, counts: np.ndarray, seed: int):
    """What the synthetic peers send `rank` per routing set, and the bytes they send it from.

    Returns (source, writes): `source` a uint8 array, the peers' one source buffer: a combine block
    (rank's T*K combine rows, laid out as rank's send buffer orders them, shared by every set), then per
    set and peer p an entry [p's count row][the n rows p sends rank]; `writes[s]` a list of
    (peer, kind, src_offset, length, dst_offset) in posting order (privates, remainders, combines) with
    the lengths and destinations `protocol.plan` gives peer p (dst relative to rank's recv buffer). The
    contents are seeded random bytes with the count rows in place: the same in every process."""
    from moe_a2a.protocol import plan

    W, P = lay.world_size, lay.private_rows
    ds, cs, rowb = lay.dispatch_stride_bytes, lay.combine_stride_bytes, lay.routing_row_bytes
    peers = [p for p in range(W) if p != rank]
    comb_bytes = lay.max_routes * cs
    layout, offset = [], comb_bytes
    for c in counts:
        routes = plan.route_matrix(c.astype(np.int64), lay)
        entries, writes_p, writes_r, writes_c = [], [], [], []
        for p in peers:
            n = int(routes[p, rank])
            start = offset
            offset += rowb + n * ds
            entries.append((start, p))
            priv = plan.private_writes(c[p].astype(np.int64), p, lay)
            _, _, plen, pdst = priv[priv[:, 0] == rank][0].tolist()
            kind = Imm.DISPATCH_MORE if n > P else Imm.DISPATCH
            writes_p.append((p, kind, start, plen, pdst))  # plen: the count row and min(n, P) rows
            if n > P:
                rem = plan.remainder_writes(routes, p, lay)
                _, _, rlen, rdst = rem[rem[:, 0] == rank][0].tolist()
                writes_r.append((p, Imm.DISPATCH_REMAINDER, start + rowb + P * ds, rlen, rdst))
            comb = plan.combine_writes(routes, p, lay)
            _, _, clen, cdst = comb[comb[:, 0] == rank][0].tolist()
            # The rows rank's routes to p came back with, at the place rank's send buffer gave them.
            writes_c.append((p, Imm.COMBINE, cdst - lay.combine_recv_offset_bytes, clen, cdst))
        layout.append((entries, writes_p + writes_r + writes_c))
    source = np.random.default_rng(seed).integers(0, 256, offset, dtype=np.uint8)
    for c, (entries, _) in zip(counts, layout):
        for start, p in entries:
            source[start:start + rowb] = c[p].astype(np.int32).view(np.uint8)
    return source, [w for _, w in layout]


# ---- the synthetic peers' process -------------------------------------------------------------------
_MAP_NORESERVE = 0x4000  # Linux; the mmap module does not export it


def _reserve(nbytes: int) -> int:
    """Anonymous memory that costs only what is written (MAP_NORESERVE): one region per synthetic peer."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {nbytes} B (MAP_NORESERVE) failed")
    return addr


class _SyntheticPeers:
    """The W - 1 remote ranks of rank `rank`, in one process (see the module docstring)."""

    def __init__(self, engines, setup: dict) -> None:
        from moe_a2a.proxy.engine import ACCESS_SOURCE, ACCESS_TARGET

        self.engines, self.lay, self.rank = engines, setup["layout"], setup["rank"]
        self.epochs, self.timeout_s = setup["epochs"], setup["timeout_s"]
        lay, r, k = self.lay, self.rank, len(engines)
        W = lay.world_size
        self.source, writes = peer_writes(lay, r, setup["counts"], setup["seed"])
        # One region per peer, as large as a segment (the proxy adds the recv buffer's offset in it).
        nbytes = lay.segment_bytes(True)
        self.region_addr = {p: _reserve(nbytes) for p in range(W) if p != r}
        self.descriptors = [None] * W
        for p, addr in self.region_addr.items():
            self.descriptors[p] = engines[p % k].register(addr, nbytes, ACCESS_TARGET).descriptor()
        src_addr = self.source.ctypes.data
        self.src = [e.register(src_addr, len(self.source), ACCESS_SOURCE) for e in engines]
        self.groups = []
        for e in engines:
            [peer] = e.connect([setup["proxy_address"]])
            self.groups.append(e.peer_group([peer], [setup["proxy_region"]]))
        # Per set and engine: the targets (dst in rank's segment) and the immediates of epoch 0.
        recv = lay.recv_offset_bytes
        self.targets = [[[] for _ in engines] for _ in writes]
        self.imm_bases = [[[] for _ in engines] for _ in writes]
        for s, ws in enumerate(writes):
            for p, kind, src, length, dst in ws:
                self.targets[s][p % k].append((0, src, length, recv + dst))
                self.imm_bases[s][p % k].append(encode_imm(kind, p, 0))
        self.combine_imm = lambda e: encode_imm(Imm.COMBINE, r, e)
        self.posted_epochs = 0

    def progress(self) -> int:
        return sum(e.progress() for e in self.engines)

    def post(self, epoch: int) -> None:
        s, low = epoch % len(self.targets), epoch & EPOCH_MASK
        for e, grp, src, targets, bases in zip(self.engines, self.groups, self.src, self.targets[s],
                                               self.imm_bases[s]):
            if targets:
                e.scatter(grp, src, targets, [b | low for b in bases])
        deadline = time.monotonic() + self.timeout_s
        while any(e.writes_pending for e in self.engines):  # every engine progresses meanwhile
            if not self.progress():
                os.sched_yield()
            if time.monotonic() > deadline:
                raise TimeoutError(f"synthetic peers: epoch {epoch}'s writes to rank {self.rank} did not complete "
                                   f"within {self.timeout_s:g}s")
        self.posted_epochs = epoch

    def combines_in(self, epoch: int) -> int:
        imm = self.combine_imm(epoch)
        return sum(e.imm_count(imm) for e in self.engines)

    def drain(self, epoch: int) -> None:
        """Progress until rank's combine writes of `epoch` are in (its dispatch writes preceded them on
        every connection); give up silently after timeout_s (the counts then say what is missing)."""
        deadline = time.monotonic() + self.timeout_s
        while epoch and self.combines_in(epoch) < self.lay.world_size - 1 and time.monotonic() < deadline:
            if not self.progress():
                os.sched_yield()

    def stats(self) -> dict:
        counts: dict[int, int] = {}
        for e in self.engines:
            for imm, n in e.imm_counts().items():
                counts[imm] = counts.get(imm, 0) + n
        return {"imm_counts": counts, "writes_posted": sum(e.writes_posted for e in self.engines),
                "eagain_retries": sum(e.eagain_retries for e in self.engines)}

    def read(self, peer: int, offset: int, nbytes: int) -> bytes:
        return ctypes.string_at(self.region_addr[peer] + offset, nbytes)

    def serve(self, conn, parent_pid: int) -> None:
        """Progress; post call e once rank's combine writes of e - 1 are in (after "start" for e = 1);
        answer the parent's requests between polls."""
        W, started, loops = self.lay.world_size, False, 0
        while True:
            handled = self.progress()
            e = self.posted_epochs + 1
            if started and e <= self.epochs and (e == 1 or self.combines_in(e - 1) >= W - 1):
                self.post(e)
                conn.send(("posted", e))
                continue
            loops += 1
            if loops % 32 == 0:
                if conn.poll():
                    msg = conn.recv()
                    if msg[0] == "start":
                        started = True
                    elif msg[0] == "read":
                        conn.send(("bytes", self.read(*msg[1:])))
                    elif msg[0] == "stats":  # after the last call: once rank's last writes are all in
                        self.drain(self.posted_epochs if self.posted_epochs == self.epochs else 0)
                        conn.send(("stats", self.stats()))
                    elif msg[0] == "stop":
                        return
                if os.getppid() != parent_pid:
                    return
            if not handled:
                os.sched_yield()  # the model process shares this core


def _peer_process(fd: int) -> None:
    """Entry of the synthetic peers' process (`_Helper` starts it): its arguments, then the setup, come
    over the socket `fd`."""
    from multiprocessing.connection import Connection

    from moe_a2a.proxy.engine import TransferEngine

    conn = Connection(fd)
    try:  # die with the bench (Linux), as the proxy does
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
    engines, peers = [], None
    try:
        provider, num_engines, cpus, timeout_s, parent_pid = conn.recv()
        if cpus:
            os.sched_setaffinity(0, cpus)
        engines = [TransferEngine(provider, local_only=True, timeout_s=timeout_s, idle_yield=True)
                   for _ in range(num_engines)]
        conn.send(("addresses", [e.address for e in engines]))
        setup = conn.recv()
        peers = _SyntheticPeers(engines, setup)
        conn.send(("regions", peers.descriptors))
        peers.serve(conn, parent_pid)
    except (EOFError, OSError):  # the bench went away
        pass
    except BaseException:  # the bench reports it
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        for e in engines:
            e.close()


# ---- the model side -----------------------------------------------------------------------------------
class _Helper:
    """The parent's end of the synthetic peers' process."""

    def __init__(self, provider: str, num_engines: int, cpus, timeout_s: float) -> None:
        ours, theirs = socket.socketpair()
        self.conn = Connection(os.dup(ours.fileno()))
        ours.close()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: benchmarks/ is no package's
        code = (f"import sys; sys.path.insert(0, {root!r}); from benchmarks.proxy import _peer_process; "
                f"_peer_process(int(sys.argv[1]))")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     close_fds=True)
        theirs.close()
        self.conn.send((provider, num_engines, cpus, timeout_s, os.getpid()))
        self.dead = False
        self.posted = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL; then remove what it left in /dev/shm (libfabric shm's `{pid}:*` region) while it is
        still an unreaped zombie (its pid cannot be reused), and reap it."""
        from moe_a2a.protocol.memory import remove_process_shm_files

        if self.proc.returncode is None:
            self.proc.kill()
            try:
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                pass
            remove_process_shm_files(self.proc.pid, segments=False)
        self.proc.wait(5)

    def recv(self, kind: str, timeout_s: float):
        """The next message of `kind` ("posted" messages are tallied on the way)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"bench proxy: the synthetic peers' process did not answer ({kind}) within "
                                   f"{timeout_s:g}s")
            try:
                if not self.conn.poll(min(left, 0.05)):
                    if not self.alive():
                        raise EOFError
                    continue
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.dead = True
                raise TimeoutError(f"bench proxy: the synthetic peers' process exited (code {self.proc.poll()}) "
                                   f"while we waited for {kind}") from None
            if msg[0] == "error":
                self.dead = True
                raise RuntimeError(f"bench proxy: the synthetic peers failed:\n{msg[1]}")
            if msg[0] == "posted":
                self.posted = max(self.posted, msg[1])
                if kind == "posted":
                    return msg
                continue
            if msg[0] == kind:
                return msg[1]
            raise RuntimeError(f"bench proxy: unexpected message from the synthetic peers: {msg[0]!r}")

    def wait_posted(self, epoch: int, timeout_s: float) -> None:
        """Until the peers posted call `epoch` (returns at once when their process is dead: the proxy's
        own timeout then tells what is missing)."""
        while self.posted < epoch and not self.dead:
            try:
                self.recv("posted", timeout_s)
            except TimeoutError:
                if not self.dead:
                    raise

    def request(self, msg: tuple, kind: str, timeout_s: float = 30.0):
        self.conn.send(msg)
        return self.recv(kind, timeout_s)

    def close(self) -> None:
        if self.alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.conn.close()


def _cpu_plan(proxy_cpu: str):
    """(CPU override for the proxy or None, CPUs for this process and the peers or None)."""
    allowed = sorted(os.sched_getaffinity(0))
    if proxy_cpu == "none" or (proxy_cpu == "auto" and len(allowed) < 2):
        return None, None
    cpu = allowed[-1] if proxy_cpu == "auto" else int(proxy_cpu)
    if cpu not in allowed:
        raise ValueError(f"--proxy-cpu {cpu}: not in this process's affinity {allowed}")
    others = [c for c in allowed if c != cpu] or allowed
    return str(cpu), others


def bench_world(world: int, provider: str = "tcp", epochs: int = 100, warmup: int = 10, *, tokens: int = 128,
                hidden: int = 7168, experts: int = 256, topk: int = 8, private_rows: int | None = None, rank: int = 0,
                sets: int = 4, seed: int = 0,
                timeout_s: float = 30.0, gap_s: float = 1e-3, peer_engines: int = 1, proxy_cpu: str = "auto",
                check: bool = False, show_progress: bool = True, _kill_peers_at: int | None = None) -> dict:
    """One world size: the real proxy of rank `rank` against W - 1 synthetic peers for `warmup` + `epochs`
    calls (see the module docstring); returns the row the JSON keeps. `check`: after the last call,
    compare the bytes of the last call's writes where they landed (both directions) and the count rows
    the proxy copied. Fails with TimeoutError (naming the flag or, from the proxy, the missing peers)
    rather than hanging when a process dies."""
    import torch

    from moe_a2a.config import A2AConfig
    from moe_a2a.protocol.segment import Flags, read_error
    from moe_a2a.proxy.fabric import auto_provider
    from moe_a2a.protocol.proxy_spec import ProxySpec
    from moe_a2a.runtime.proxy_handle import ProxyHandle
    from moe_a2a.protocol.memory import SharedSegment, unique_name
    from moe_a2a.bench._util import progress

    W, total = world, warmup + epochs
    if provider == "auto":
        provider = auto_provider()
    cfg = A2AConfig(max_num_tokens=tokens, num_experts=experts, experts_per_token=topk, hidden_dim=hidden,
                    in_dtype=torch.float8_e4m3fn, max_private_tokens=private_rows)
    lay = cfg.layout(W, 1)
    remote = len(lay.remote_peers(rank))
    counts = routing_sets(lay, tokens, topk, sets, seed)
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    planned = [kernel_tables(c, rank, lay, device) for c in counts]
    proxy_cpus, my_cpus = _cpu_plan(proxy_cpu)
    helper = _Helper(provider, peer_engines, my_cpus, timeout_s)
    seg = handle = None
    old_affinity = os.sched_getaffinity(0)
    try:
        addresses = helper.recv("addresses", STARTUP_S)
        seg = SharedSegment(unique_name(), lay.segment_bytes(True), create=True)
        spec = ProxySpec(lay, rank, seg.name, True, provider, 0.8 * timeout_s, parent_pid=os.getpid(),
                         idle_yield=False, local_only=True, cpu_override=proxy_cpus)
        handle = ProxyHandle(spec)
        p_addr, p_region, _ = handle.address(STARTUP_S)
        helper.conn.send({"layout": lay, "rank": rank, "counts": counts, "seed": seed + 1, "epochs": total,
                          "timeout_s": timeout_s, "proxy_address": p_addr, "proxy_region": p_region})
        regions = helper.recv("regions", STARTUP_S)
        table = [(addresses[p % peer_engines], regions[p], f"synthetic-{p}", None) if p != rank
                 else (p_addr, p_region, seg.name, None) for p in range(W)]
        handle.finish(table, STARTUP_S)
        seg.unlink()  # mapped by both processes now: nothing outlives them in /dev/shm
        if my_cpus:
            os.sched_setaffinity(0, my_cpus)
        flags = Flags(seg, lay)
        tables = seg.numpy(lay.write_table_offset_bytes, lay.write_table_bytes // 8, np.int64).reshape(
            int(WriteTable.NUM_TABLES), W, 4)
        routing = seg.numpy(lay.routing_offset_bytes, W * lay.num_experts, np.int32).reshape(W, lay.num_experts)
        trace = seg.numpy(lay.trace_offset_bytes, 2 * len(TRACE_EVENTS), np.int64).reshape(-1, 2)
        # The send buffer's rows the tables read: seeded bytes (checked where they land).
        send = seg.numpy(lay.send_offset_bytes, lay.send_bytes)
        rng = np.random.default_rng(seed + 2)
        d_end = max(int((t[[0, 1], :, 0] + t[[0, 1], :, 1]).max()) for t, _ in planned)
        c_end = max(int((t[2, :, 0] + t[2, :, 1]).max()) for t, _ in planned)
        send[:d_end] = rng.integers(0, 256, d_end, dtype=np.uint8)
        c0 = lay.combine_stage_offset_bytes
        send[c0:c_end] = rng.integers(0, 256, max(0, c_end - c0), dtype=np.uint8)
        flags[Flag.TRACE] = 1
        dead_proxy = lambda: handle.proc.poll() is not None

        def wait(flag: Flag, e: int, what: str) -> None:
            deadline, spins = time.monotonic() + timeout_s, 0
            while flags[flag] < e:
                if flags[Flag.ERROR]:
                    code, msg = flags[Flag.ERROR], read_error(seg, lay)
                    if helper.dead or not helper.alive():  # the peers stopped answering: whatever the
                        # proxy made of it (a timeout, or over tcp a broken connection), the peers timed out
                        raise TimeoutError(f"bench proxy, W={W}: the synthetic peers' process exited (code "
                                           f"{helper.proc.poll()}) and the proxy gave up at {flag.name} "
                                           f"(epoch {e}): {msg}")
                    raise (TimeoutError if code == ERROR_TIMEOUT else RuntimeError)(
                        f"bench proxy, W={W}: the proxy reported: {msg}")
                if dead_proxy():
                    raise RuntimeError(f"bench proxy, W={W}: the proxy process exited (code {handle.proc.returncode}) "
                                       f"while we waited for {flag.name} (epoch {e})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bench proxy, W={W}: {flag.name} (epoch {e}, {what}) not raised within "
                                       f"{timeout_s:g}s; synthetic peers {'dead' if helper.dead else 'alive'}")
                spins += 1
                if spins > 50:
                    time.sleep(2e-5)  # the peers share this core: poll, do not spin

        helper.conn.send(("start",))
        samples, writes, walls, missing = [], [], [], 0
        bar = progress(range(1, total + 1), desc=f"bench proxy W={W}", unit="call", disable=not show_progress)
        for e in bar:
            if _kill_peers_at == e:  # tests: a dead peer process must end the bench, not hang it
                helper.kill()
            helper.wait_posted(e, timeout_s)
            if gap_s:
                time.sleep(gap_s)  # the proxy drains the peers' early writes between calls
            t, n_rem = planned[e % sets]
            # What the route, private-plan and plan kernels leave: our count row, the tables of this epoch.
            table_e = t.copy()
            imm = table_e[..., 3]
            imm[imm != 0] |= e & EPOCH_MASK
            tables[:] = table_e
            routing[rank] = counts[e % sets][rank]
            for p in lay.remote_peers(rank):  # the plan kernel's count row: where each private range starts
                src = int(t[WriteTable.PRIVATE, p, 0])
                send[src:src + lay.routing_row_bytes] = counts[e % sets][rank].astype(np.int32).view(np.uint8)
            flags[Flag.REMAINDER_WRITES] = n_rem
            posted = flags[Flag.DISPATCH_WRITES_POSTED], flags[Flag.COMBINE_WRITES_POSTED]
            t0 = time.perf_counter()
            flags[Flag.ROUTE_READY] = e
            flags[Flag.SEND_READY] = e
            # The plan kernel's tables are written already (precomputed): no GPU round trip is timed.
            flags[Flag.REMAINDER_PLANNED] = e
            wait(Flag.DISPATCH_RECV_READY, e, "dispatch: the peers' rows")
            flags[Flag.COMBINE_SEND_READY] = e
            wait(Flag.COMBINE_RECV_READY, e, "combine: the peers' outputs")
            wait(Flag.COMBINE_WRITES_DONE, e, "combine: the proxy's writes")
            walls.append(time.perf_counter() - t0)
            raw = trace.copy()
            dw = flags[Flag.DISPATCH_WRITES_POSTED] - posted[0]
            cw = flags[Flag.COMBINE_WRITES_POSTED] - posted[1]
            writes.append((dw, cw, remote + n_rem, remote, n_rem))
            if e > warmup:
                if (raw[:, 0] != e).any():
                    missing += 1
                else:
                    samples.append(proxy_phase_us(raw))
        bar.close()
        result = _row(W, remote, provider, lay, cfg, epochs, warmup, samples, writes[warmup:], walls[warmup:],
                      missing, handle, peer_engines, gap_s)
        stats = helper.request(("stats",), "stats")
        result["checks"] = _check_peer_imms(stats["imm_counts"], rank, remote, planned, sets, total)
        result["checks"]["writes_posted_as_tables"] = all(dw == want_d and cw == want_c
                                                          for dw, cw, want_d, want_c, _ in writes)
        result["synthetic_peers"] = {"writes_posted": stats["writes_posted"], "eagain_retries": stats["eagain_retries"]}
        if check:
            result["checks"].update(_check_rows(helper, seg, lay, rank, counts, planned, sets, total, seed))
        return result
    finally:
        os.sched_setaffinity(0, old_affinity)
        if handle is not None:
            handle.stop(seg, lay)
        helper.close()
        if seg is not None:
            seg.close()


def _row(W, remote, provider, lay, cfg, epochs, warmup, samples, writes, walls, missing, handle, engines, gap_s):
    if not samples:
        raise RuntimeError(f"bench proxy, W={W}: no complete trace in {epochs} calls")
    parts = summarize(samples)
    pick = lambda k: {"median": parts[k]["median"], "p90": parts[k]["p90"]}
    n = len(writes)
    d_writes = sum(w[0] for w in writes) / n
    c_writes = sum(w[1] for w in writes) / n
    return {
        "world": W, "remote_peers": remote, "provider": provider, "epochs": epochs, "warmup": warmup,
        "dispatch_host_us": pick("dispatch_host_us"), "combine_host_us": pick("combine_host_us"),
        "goal_us": goal_us(remote), "goal": GOAL,
        "meets_goal": {"dispatch": parts["dispatch_host_us"]["median"] <= goal_us(remote),
                       "combine": parts["combine_host_us"]["median"] <= goal_us(remote)},
        "dispatch_writes_per_call": d_writes, "remainder_writes_per_call": sum(w[4] for w in writes) / n,
        "combine_writes_per_call": c_writes,
        "post_us_per_write": {"dispatch_private": parts["dispatch_post_us"]["median"] / max(1, remote),
                              "combine": parts["combine_post_us"]["median"] / max(1, remote)},
        "parts": parts, "calls_without_full_trace": missing,
        "call_wall_us": _quantiles([w * 1e6 for w in walls]),
        "config": {"max_num_tokens": cfg.max_num_tokens, "hidden_dim": cfg.hidden_dim,
                   "num_experts": cfg.num_experts, "experts_per_token": cfg.experts_per_token,
                   "in_dtype": str(cfg.in_dtype), "private_rows": lay.private_rows,
                   "dispatch_row_bytes": lay.dispatch_stride_bytes, "combine_row_bytes": lay.combine_stride_bytes},
        "proxy_cpus": handle.cpus, "proxy_cpus_reason": handle.cpus_reason, "peer_engines": engines, "gap_s": gap_s,
    }


def _check_peer_imms(counts: dict, rank: int, remote: int, planned, sets: int, total: int) -> dict:
    """The synthetic peers received, per call, one private write from rank per remote peer (DISPATCH_MORE
    exactly for those with a remainder), the remainders and a combine write per peer."""
    ok = True
    for e in range(1, total + 1):
        t, n_rem = planned[e % sets]
        got = {k: counts.get(encode_imm(k, rank, e & EPOCH_MASK), 0) for k in
               (Imm.DISPATCH, Imm.DISPATCH_MORE, Imm.DISPATCH_REMAINDER, Imm.COMBINE)}
        ok &= got == {Imm.DISPATCH: remote - n_rem, Imm.DISPATCH_MORE: n_rem, Imm.DISPATCH_REMAINDER: n_rem,
                      Imm.COMBINE: remote}
    return {"peer_imms_as_tables": bool(ok)}


def _check_rows(helper, seg, lay, rank, counts, planned, sets, total, seed) -> dict:
    """After the last call: rank's writes landed in each checked peer's region where its tables said
    (one range of its send buffer each, a private one starting with the count row), the peers' writes landed in rank's recv buffer where
    plan said, and every peer's count row is at the head of its private slot."""
    W, s = lay.world_size, total % sets
    t, _ = planned[s]
    send = seg.numpy(lay.send_offset_bytes, lay.send_bytes)
    recv = seg.numpy(lay.recv_offset_bytes, lay.recv_bytes)
    peers = [p for p in range(W) if p != rank]
    chosen = peers if len(peers) <= 16 else sorted(set(peers[:4] + peers[-4:] + [
        p for p in peers if t[WriteTable.REMAINDER, p, 1]][:8]))
    out_ok, out_bytes = True, 0
    for p in chosen:
        for tab in (WriteTable.PRIVATE, WriteTable.REMAINDER, WriteTable.COMBINE):
            src, length, dst, _ = t[tab, p].tolist()
            if tab == WriteTable.REMAINDER and not length:
                continue
            want = send[src:src + length].tobytes()  # a private write's range starts with the count row
            got = helper.request(("read", p, lay.recv_offset_bytes + dst, len(want)), "bytes")
            out_ok &= got == want
            out_bytes += len(want)
    source, writes = peer_writes(lay, rank, counts, seed + 1)
    in_ok, in_bytes = True, 0
    for p, _kind, src, length, dst in writes[s]:
        if p in chosen:
            in_ok &= recv[dst:dst + length].tobytes() == source[src:src + length].tobytes()
            in_bytes += length
    # the peers' count rows at the head of their private slots, where the plan kernel copies them from
    rows_ok = all(recv[h:h + lay.routing_row_bytes].view(np.int32).tolist() == counts[s][p].tolist()
                  for p in peers for h in [lay.private_header_offset_bytes(p)])
    return {"rank_writes_landed_as_tables": bool(out_ok), "rank_bytes_checked": out_bytes,
            "peer_writes_landed_as_plan": bool(in_ok), "peer_bytes_checked": in_bytes,
            "count_rows_landed": rows_ok, "peers_checked": chosen}


# ---- the command ----------------------------------------------------------------------------------------
def default_epochs(world: int) -> int:
    """Timed calls per world size: >= 100 up to 64 ranks, fewer where a call takes long."""
    return 100 if world <= 64 else 50 if world <= 128 else 30


def format_table(rows: list[dict]) -> str:
    head = (f"{'W':>4} {'peers':>5}  {'dispatch med / p90':>19}  {'combine med / p90':>18}  {'goal':>6}  "
            f"{'post priv':>9} {'imms+rows':>9} {'post comb':>9}  {'wait writes d / c':>17}  {'writes d / c':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r["parts"]
        d, c = r["dispatch_host_us"], r["combine_host_us"]
        mark = lambda ok: " " if ok else "!"
        lines.append(
            f"{r['world']:>4} {r['remote_peers']:>5}  {d['median']:>8.1f} / {d['p90']:>7.1f}{mark(r['meets_goal']['dispatch'])} "
            f"{c['median']:>8.1f} / {c['p90']:>7.1f}{mark(r['meets_goal']['combine'])} {r['goal_us']:>6.1f}  "
            f"{p['dispatch_post_us']['median']:>9.1f} {p['dispatch_imms_rows_us']['median']:>9.1f} "
            f"{p['combine_post_us']['median']:>9.1f}  {p['dispatch_writes_wait_us']['median']:>7.1f} / "
            f"{p['combine_writes_wait_us']['median']:>7.1f}  {r['dispatch_writes_per_call']:>5.1f} / "
            f"{r['combine_writes_per_call']:>4.0f}")
    lines.append(f"µs of proxy host time per phase (median / p90 over the timed calls); goal {GOAL}; "
                 "'!' = median over the goal")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--worlds", type=int_list(2), default=None,
                    help=f"world sizes, comma-separated (default {','.join(map(str, DEFAULT_WORLDS))}; --quick: 8,16)")
    ap.add_argument("--provider", default="tcp", choices=["tcp", "shm", "auto"],
                    help="libfabric provider of the proxy and the synthetic peers (default tcp)")
    ap.add_argument("--epochs", type=positive_int, default=None,
                    help="timed calls per world size (default 100 up to W=64, 50 at 128, 30 at 256; --quick: 20)")
    ap.add_argument("--warmup", type=nonneg_int, default=None,
                    help="untimed calls first (default 10; --quick: 3)")
    ap.add_argument("--quick", action="store_true", help="W=8,16 (unless --worlds), 20 timed calls, 3 warm-up")
    ap.add_argument("--tokens", type=positive_int, default=128, help="T, tokens per rank (default 128: decode)")
    ap.add_argument("--hidden", type=positive_int, default=7168,
                    help="H in fp8 with 128-element scales (default 7168: decode; the bytes tcp copies per write)")
    ap.add_argument("--experts", type=positive_int, default=256, help="E, divisible by every W (default 256)")
    ap.add_argument("--topk", type=positive_int, default=8, help="K (default 8)")
    ap.add_argument("--private-rows", type=nonneg_int, default=None,
                    help="P, rows of each sender's private slot (default: the library's, 2 T K / W rounded up to 8)")
    ap.add_argument("--gap-ms", type=nonneg_float, default=1.0,
                    help="pause before each call once the peers' writes are posted (default 1 ms)")
    ap.add_argument("--peer-engines", type=positive_int, default=1,
                    help="engines (endpoints) the synthetic peers spread over (default 1)")
    ap.add_argument("--proxy-cpu", default="auto",
                    help="CPU the proxy is pinned to, 'none', or 'auto' (default: the last CPU, the bench and the "
                         "peers on the others, when there are >= 2)")
    ap.add_argument("--timeout", type=positive_float, default=60.0, help="seconds before any wait gives up")
    ap.add_argument("--verify", action="store_true",
                    help="after the last call, compare bytes where the writes landed (both directions)")
    ap.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON")
    return ap


def run_args(args) -> int:
    from moe_a2a.proxy import libfabric as lf
    from moe_a2a.bench._util import has_cuda

    if not has_cuda():  # the plan kernels run once per routing set: in the interpreter without a GPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.provider != "auto" and lf.PROVIDER_NAMES[args.provider] not in lf.list_providers():
        raise ValueError(f"--provider {args.provider}: not offered by libfabric here ({lf.list_providers()})")
    worlds = args.worlds or ([8, 16] if args.quick else list(DEFAULT_WORLDS))
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    for w in worlds:
        if args.experts % w:
            args.error(f"--experts {args.experts} must be divisible by every world size (got {w})")
    rows = []
    for w in worlds:
        epochs = args.epochs or (20 if args.quick else default_epochs(w))
        rows.append(bench_world(w, args.provider, epochs, warmup, tokens=args.tokens, hidden=args.hidden,
                                experts=args.experts, topk=args.topk, private_rows=args.private_rows,
                                timeout_s=args.timeout,
                                gap_s=args.gap_ms / 1e3, peer_engines=args.peer_engines, proxy_cpu=args.proxy_cpu,
                                check=args.verify))
        print(f"W={w}: dispatch {rows[-1]['dispatch_host_us']['median']:.1f} µs, combine "
              f"{rows[-1]['combine_host_us']['median']:.1f} µs (goal {rows[-1]['goal_us']:.1f})",
              file=sys.stderr, flush=True)
    r0 = rows[0]
    print(f"proxy host cost, rank 0 of W ranks, one per node, provider {r0['provider']}, T={args.tokens} "
          f"H={args.hidden} fp8 K={args.topk} E={args.experts}; proxy {r0['proxy_cpus_reason']}")
    print(format_table(rows))
    bad = [r["world"] for r in rows if not all(r["checks"].values())]
    if bad:
        print(f"WARNING: checks failed at W={bad}: " + "; ".join(str(r["checks"]) for r in rows if r["world"] in bad))
    if args.json:
        from moe_a2a.bench._util import write_json as _write

        _write(args.json, {"bench": "proxy", "goal": GOAL, "provider": r0["provider"], "cpus": os.cpu_count(),
                           "results": rows})
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    from ._cli import main as cli_main

    return cli_main("proxy", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
