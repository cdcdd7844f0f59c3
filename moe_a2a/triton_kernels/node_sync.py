"""Synchronisation inside the data kernels: with same-node peers always, with the proxy for remote ones.

Ranks of one node reach each other's memory through mappings (CUDA IPC or registered shared memory on
a GPU, shared memory on CPU). Each rank has a *sync area* (`Layout.*_offset_bytes`, docs/protocol.md):

    dispatch_ready [W] int64     word s: last epoch whose count row and dispatch rows node peer s published
    combine_ready  [W] int64     word s: last epoch whose expert outputs node peer s pushed into this rank
    counts         [W, E] int32  row s: source s's per-expert counts (this rank's own row: route kernel;
                                 a node peer's: its pack epilogue; a remote peer's: its proxy)

It is at the end of the recv buffer when every rank is on one node and waits in kernels
(`AllToAll.device_sync`: device memory), else in the shared segment, where its count rows are the
routing area the proxy writes into and the host and the proxy can read it. Every word and row has one
writer; epochs only grow and a wait passes at `>= e`, so nothing is cleared.

Producers (dispatch pack, combine pack) end with an *epilogue*: every program fences (`fence.acq_rel.sys`)
and arrives on a counter (`node_arrive`); the last one copies the count row to the node peers (dispatch
only, `node_copy_count_row`), then release-stores the epoch into its word of every node rank's area and,
with remote peers, into the proxy's flag (SEND_READY / COMBINE_SEND_READY, `node_publish`). Consumers
(unpack, reduce) start with a *prologue* (`node_wait`): spin with system-scope acquire loads until every
node rank's word reaches the epoch and, with remote peers, the proxy's flag does (DISPATCH_RECV_READY /
COMBINE_RECV_READY). With remote peers the producers' prologues also wait until the proxy's writes out of
their region for the previous call completed (DISPATCH/COMBINE_WRITES_DONE >= e-1); `HALF_FLAGS` lists
each half's flags. No barrier: why each reuse of a region is safe is in docs/protocol.md, section 4.
With only remote rows staged (`"staged"`) and remote peers, the dispatch pack has two halves of programs,
each arriving on its own counter word (`node_arrive_of`): the remote half's last program raises SEND_READY
only, the node half's last program copies the count row and publishes to the node (docs/protocol.md, 3.6).

Failure: a wait that times out (`%globaltimer`, `timeout_s`), or sees the proxy's ERROR flag, stores
`1 + 2 * (bitmask of the late node ranks)` (+ PROXY_MISSING when the proxy's flag was late) in its
`Flag.STATUS_*` word and sets a sticky device word; every later synchronised kernel of the rank then
moves nothing and publishes nothing, so peers time out too instead of computing on stale data. The host
raises a TimeoutError naming them at its next call (`protocol.words.decode_wait_status`); no sync.

Host waits (CPU; GPU ranks sharing a GPU): the host polls the same words and flags before each launch,
so the kernel's own wait passes at its first poll. Under `TRITON_INTERPRET=1` loads and stores are plain
(x86 keeps stores in order), fences are skipped and a spin is capped by a count, not a clock.
Measured on 2 x H200: a GPU<->GPU flag round trip through peer memory takes 2.7 µs, against 5.6 µs for
GPU -> proxy -> GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import next_power_of_2
from ..protocol import device as protocol_device
from ..protocol.words import HALF_FLAGS, Flag, flag_word
from .rows import LaunchCache
from .sync import _globaltimer_ns, _load_acquire_sys

# Polls of a prologue spin under the interpreter (it has no clock; the host already waited).
INTERPRETER_MAX_SPINS = 1 << 16


@dataclass(frozen=True, eq=False)  # identity: it is a key of remembered launches, and holds tensors
class NodeSync:
    """What the kernels of one rank need to synchronise with its same-node peers and its proxy.

    Attributes:
        epoch: `[1]` int64 on the device, this call's epoch (advanced on the stream by `route_tokens`,
            so a CUDA graph replay publishes and awaits the replay's epoch).
        failed: `[1]` int64 on the device, sticky: nonzero after any failed wait of this rank.
        counter: `[2]` int32 on the device, zero between launches: programs arrived in an epilogue (the
            second word: the node half of a pack that packs remote rows first, `dispatch.py`).
        flags: `[N]` int64, this rank's flags area (`config.Flag`) as the kernels reach it (pinned host
            memory seen through UVA on a GPU): the proxy flags and the status words of failed waits.
        peer_sync_bytes: `[W]` int64, each same-node rank's sync area as an offset from `base` (-1 for
            other ranks); `sync_bytes`: this rank's.
        rank, node_first, node_size: this rank and its node's ranks `[node_first, node_first + node_size)`.
        dispatch_ready_bytes, combine_ready_bytes, counts_bytes: offsets of the area's parts in a sync area.
        num_experts: E (length of a count row).
        timeout_s: how long a prologue spins before giving up (GPU).
        with_proxy: remote peers exist: the kernels also wait for / raise the proxy's flags.
        kernel_waits: False when the host polls every word before it launches a kernel (CPU, or ranks
            sharing one GPU, which must not spin in a kernel): the prologues then only check `failed`.
        wait_apart: the words live in pinned host memory (with remote peers, or host-staged buffers):
            one single-warp kernel (`launch_wait_apart`) spins before each data kernel, whose prologue
            then only checks `failed`. Every program of a data kernel polling host memory kept ~500
            PCIe reads in flight per GPU and slowed everything else on the bus (measured 2026-11-30,
            2 x H200, one rank per node: 14 ms per dispatch + combine, docs/perf-notes.md).
        interpreter_spins: how many polls before giving up under the interpreter (no clock there).
    """

    epoch: torch.Tensor
    failed: torch.Tensor
    counter: torch.Tensor
    flags: torch.Tensor
    peer_sync_bytes: torch.Tensor
    sync_bytes: int
    rank: int
    node_first: int
    node_size: int
    dispatch_ready_bytes: int
    combine_ready_bytes: int
    counts_bytes: int
    num_experts: int
    timeout_s: float
    with_proxy: bool = False
    kernel_waits: bool = True
    wait_apart: bool = False
    interpreter_spins: int = INTERPRETER_MAX_SPINS

    def kernel_args(self, half: str, device: torch.device) -> dict:
        """Keyword arguments of the synchronising prologue/epilogue of one half's kernel."""
        on_gpu = device.type == "cuda"
        wait_flag, delta, signal_flag, status, _ = HALF_FLAGS[half]
        ready = self.dispatch_ready_bytes if half.startswith("dispatch") else self.combine_ready_bytes
        args = dict(failed_ptr=self.failed, epoch_ptr=self.epoch, flags_ptr=self.flags,
                    peer_sync_bytes_ptr=self.peer_sync_bytes, sync_bytes=self.sync_bytes, node_first=self.node_first,
                    READY_BYTES=ready, NODE=self.node_size, NODE_SYNC=True, HAS_PROXY=self.with_proxy,
                    USE_PTX=on_gpu, STATUS_WORD=flag_word(status), PROXY_WAIT_WORD=flag_word(wait_flag),
                    PROXY_DELTA=delta, ERROR_WORD=flag_word(Flag.ERROR),
                    KERNEL_WAIT=self.kernel_waits and not self.wait_apart,
                    timeout_ns=int(self.timeout_s * 1e9) if on_gpu else 0,
                    max_spins=0 if on_gpu else self.interpreter_spins)
        if signal_flag is not None:
            args.update(counter_ptr=self.counter, PROXY_SIGNAL_WORD=flag_word(signal_flag))
        if half == "dispatch_send":
            args.update(rank=self.rank, COUNTS_BYTES=self.counts_bytes, E=self.num_experts, E_PAD=next_power_of_2(self.num_experts))
        if half in ("dispatch_recv", "combine_recv"):
            args.update(NODE_PAD=next_power_of_2(self.node_size))
        return args


@triton.jit
def _fence_sys(USE_PTX: tl.constexpr):
    if USE_PTX:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _store_release_sys(ptr, value, USE_PTX: tl.constexpr):
    if USE_PTX:
        tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                                  [ptr, value], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def _nanosleep(ns):
    tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def node_wait(
    base_ptr,            # uint8: byte address space of this rank's sync area
    ready_bytes,         # int64: this rank's ready words (sync area + dispatch/combine_ready) - base
    epoch_ptr,           # (1,) int64: the epoch to wait for
    failed_ptr,          # (1,) int64 sticky failure word (device)
    flags_ptr,           # (N,) int64 this rank's flags area: the proxy's flags and the status words
    node_first,          # first rank of this node
    timeout_ns,          # int64, GPU: give up after this long
    max_spins,           # int64, interpreter: give up after this many polls (0: no cap)
    NODE: tl.constexpr,  # same-node ranks to wait for (0: none, only the proxy)
    NODE_PAD: tl.constexpr,
    HAS_PROXY: tl.constexpr,     # also wait until flags[PROXY_WAIT_WORD] >= epoch + PROXY_DELTA
    PROXY_WAIT_WORD: tl.constexpr, PROXY_DELTA: tl.constexpr, ERROR_WORD: tl.constexpr,
    STATUS_WORD: tl.constexpr,   # flags word that records a failed wait
    USE_PTX: tl.constexpr,
    SPIN: tl.constexpr = True,   # False: the host already waited for all of it (host waits): no spin
    BACKOFF_NS: tl.constexpr = 0,  # GPU: sleep this long between polls (host memory: each poll crosses PCIe)
):
    """Prologue: spin until ready[s] >= epoch for every s of this node (and the proxy's flag is up).
    Returns True when the caller may proceed (False after an earlier failure, a timeout or a proxy
    error, which it records: `1 + 2 * missing-peers bitmask`, plus PROXY_MISSING for the proxy)."""
    ok = tl.load(failed_ptr, volatile=True) == 0
    if SPIN:
        if ok:
            i = tl.arange(0, NODE_PAD)
            words = base_ptr.to(tl.pointer_type(tl.int64)) + ready_bytes // 8 + node_first + tl.where(i < NODE, i, 0)
            target = tl.load(epoch_ptr)
            if USE_PTX:
                start = _globaltimer_ns()
            else:
                start = tl.zeros([], dtype=tl.int64)
            spins = tl.zeros([], dtype=tl.int64)
            late = i < NODE
            proxy_late = tl.zeros([], dtype=tl.int1)
            state = tl.full([], -1, dtype=tl.int32)
            while state < 0:
                seen = _load_acquire_sys(words, USE_PTX)
                late = (seen < target) & (i < NODE)
                n_late = tl.sum(late.to(tl.int32), axis=0)
                broken = tl.zeros([], dtype=tl.int1)
                if HAS_PROXY:
                    proxy_late = _load_acquire_sys(flags_ptr + PROXY_WAIT_WORD, USE_PTX) < target + PROXY_DELTA
                    broken = _load_acquire_sys(flags_ptr + ERROR_WORD, USE_PTX) != 0
                    n_late += proxy_late.to(tl.int32)
                spins += 1
                if USE_PTX:
                    if BACKOFF_NS > 0:
                        if n_late > 0:
                            _nanosleep(tl.full([], BACKOFF_NS, tl.int32))
                    elapsed = _globaltimer_ns() - start
                else:
                    elapsed = tl.zeros([], dtype=tl.int64)
                timed_out = (elapsed > timeout_ns) | ((max_spins > 0) & (spins >= max_spins)) | broken
                state = tl.where(n_late == 0, 0, tl.where(timed_out, 1, -1))
            if state != 0:
                missing = tl.sum(tl.where(late, tl.full([NODE_PAD], 1, tl.int64) << i.to(tl.int64), 0), axis=0)
                tl.store(flags_ptr + STATUS_WORD, protocol_device.encode_wait_status(missing, proxy_late))
                tl.store(failed_ptr, 1)
            ok = ok & (state == 0)
            # Every thread reads what the peers wrote; the acquire was done per element (per thread).
            tl.debug_barrier()
    return ok


@triton.jit
def node_arrive(counter_ptr, USE_PTX: tl.constexpr):
    """Epilogue, first half: fence this program's writes and arrive. True in the last program to arrive
    (every program's writes are then done and visible system-wide); it resets the counter."""
    return node_arrive_of(counter_ptr, tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2), USE_PTX)


@triton.jit
def node_arrive_of(counter_ptr, num, USE_PTX: tl.constexpr):
    """`node_arrive` among `num` programs of the grid (those that arrive on this counter)."""
    _fence_sys(USE_PTX)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    last = arrived == num - 1
    if last:
        tl.store(counter_ptr, 0)  # the next launch on this stream starts after this one ends
    return last


@triton.jit
def node_copy_count_row(
    base_ptr, peer_sync_bytes_ptr, counts_bytes, rank, node_first,
    E: tl.constexpr, E_PAD: tl.constexpr, NODE: tl.constexpr,
):
    """Epilogue of dispatch pack (last program only): this rank's count row, already in its own sync
    area (route_tokens wrote it there), into the same row of every same-node peer's sync area."""
    base_i32 = base_ptr.to(tl.pointer_type(tl.int32))
    e = tl.arange(0, E_PAD)
    own = tl.load(peer_sync_bytes_ptr + rank)
    row = tl.load(base_i32 + (own + counts_bytes) // 4 + rank * E + e, mask=e < E)
    for j in range(NODE):
        p = node_first + j
        peer = tl.load(peer_sync_bytes_ptr + p)
        tl.store(base_i32 + (peer + counts_bytes) // 4 + rank * E + e, row, mask=e < tl.where(p != rank, E, 0))


@triton.jit
def node_publish(
    base_ptr, peer_sync_bytes_ptr, ready_bytes, epoch_ptr, flags_ptr, rank, node_first,
    NODE: tl.constexpr, HAS_PROXY: tl.constexpr, PROXY_SIGNAL_WORD: tl.constexpr, USE_PTX: tl.constexpr,
):
    """Epilogue, second half (last program only): ready[rank] = epoch in every same-node rank's sync
    area (this one too), and the proxy's flag, each a system-scope release after everything this
    program wrote or saw arrive."""
    _fence_sys(USE_PTX)
    tl.debug_barrier()
    epoch = tl.load(epoch_ptr)
    base_i64 = base_ptr.to(tl.pointer_type(tl.int64))
    for j in range(NODE):
        peer = tl.load(peer_sync_bytes_ptr + node_first + j)
        _store_release_sys(base_i64 + (peer + ready_bytes) // 8 + rank, epoch, USE_PTX)
    if HAS_PROXY:
        _store_release_sys(flags_ptr + PROXY_SIGNAL_WORD, epoch, USE_PTX)


@triton.jit
def _wait_apart_kernel(
    base_ptr, failed_ptr, epoch_ptr, flags_ptr, sync_bytes, node_first, timeout_ns, max_spins,
    READY_BYTES: tl.constexpr, NODE: tl.constexpr, NODE_PAD: tl.constexpr, HAS_PROXY: tl.constexpr,
    PROXY_WAIT_WORD: tl.constexpr, PROXY_DELTA: tl.constexpr, ERROR_WORD: tl.constexpr,
    STATUS_WORD: tl.constexpr, USE_PTX: tl.constexpr, BACKOFF_NS: tl.constexpr,
):
    """Grid (1,), one warp: the wait of one half (`node_wait`) ahead of its data kernel, which then
    starts after it on the stream. A failure is recorded (status word, sticky `failed`) as in the prologue."""
    node_wait(base_ptr, sync_bytes + READY_BYTES, epoch_ptr, failed_ptr, flags_ptr, node_first, timeout_ns,
              max_spins, NODE, NODE_PAD, HAS_PROXY, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD, STATUS_WORD,
              USE_PTX, True, BACKOFF_NS)


# Between two polls of host memory: a flag hand-off through the proxy takes ~5.6 µs, a PCIe read ~1 µs.
WAIT_APART_BACKOFF_NS = 200


def launch_wait_apart(node: NodeSync | None, half: str, base: torch.Tensor) -> None:
    """Launch the separate wait of `half` when `node.wait_apart` (else nothing): consumers wait for their
    node peers' words and the proxy's flag; producers, with remote peers, for the proxy's previous writes."""
    if node is None or not node.wait_apart:
        return
    consumer = half.endswith("recv")
    if not consumer and not node.with_proxy:
        return
    key = (node, half, base.data_ptr())
    if _WAIT_APART.hit(key):
        return
    a = node.kernel_args(half, base.device)
    _WAIT_APART.launch(
        key, (1,), base, a["failed_ptr"], a["epoch_ptr"], a["flags_ptr"], node.sync_bytes if consumer else 0,
        node.node_first if consumer else 0, a["timeout_ns"], a["max_spins"],
        READY_BYTES=a["READY_BYTES"] if consumer else 0, NODE=node.node_size if consumer else 0,
        NODE_PAD=next_power_of_2(node.node_size) if consumer else 1, HAS_PROXY=node.with_proxy,
        PROXY_WAIT_WORD=a["PROXY_WAIT_WORD"], PROXY_DELTA=a["PROXY_DELTA"], ERROR_WORD=a["ERROR_WORD"],
        STATUS_WORD=a["STATUS_WORD"], USE_PTX=a["USE_PTX"], BACKOFF_NS=WAIT_APART_BACKOFF_NS, num_warps=1)


_WAIT_APART = LaunchCache(_wait_apart_kernel)

__all__ = ["NodeSync", "node_wait", "launch_wait_apart", "node_arrive", "node_copy_count_row", "node_publish"]
