"""The `@triton.jit` helpers the public kernels share (private: kernel files import it as a module,
`from . import _details as d`, and call `d.node_wait(...)`).

- memory order and clock: system-scope fence, release store and acquire load, `%globaltimer`,
  nanosleep. On a GPU (`USE_PTX`) they are PTX; under `TRITON_INTERPRET=1` plain loads and atomics
  (x86 keeps stores in order) and no clock (a spin is capped by a count instead);
- same-node synchronisation: the prologue (`node_wait`) and epilogue (`node_arrive`,
  `node_copy_count_row`, `node_publish`) of the data kernels, and `publish_epoch` of the route kernel.
  What each word means and why the order is safe: `node_sync.py` and docs/protocol.md;
- the walk over received rows: dispatch unpack (rows in, expert-major out) and combine pack (the same
  rows back out, by source) walk exactly the same rows with `recv_pair_tables`, `node_peer_tables` and
  `tile_rows`, so both directions agree on every row by construction; `copy_row_words` moves them;
- fp8 block quantisation (`fp8_block_quantize`, `fp8_e4m3_store`, `ue8m0_code`): the one copy of the
  math of `quant.quantize_fp8`, which dispatch pack's fused quantisation uses too (same bytes by
  construction);
- `live_token_block`: the token ids of a pack / reduce program and which of them are live.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..protocol import device as protocol_device


# ================================================================================================
# Memory order and clock
# ================================================================================================
@triton.jit
def fence_sys(USE_PTX: tl.constexpr):
    if USE_PTX:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def store_release_sys(ptr, value, USE_PTX: tl.constexpr):
    if USE_PTX:
        # A store, not an atomic: a posted PCIe write when the word is in host memory.
        tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                                  [ptr, value], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def load_acquire_sys(ptr, USE_PTX: tl.constexpr):
    if USE_PTX:
        # A system-scope acquire: sees the host's (or the NIC's) store, and orders our later reads of
        # the data it guards after it. A plain load could be served from L1 forever.
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr],
                                         dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.load(ptr, volatile=True)


@triton.jit
def globaltimer_ns():
    """The GPU's nanosecond clock (GPU only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def nanosleep(ns):
    tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32,
                              is_pure=False, pack=1)


# ================================================================================================
# Same-node synchronisation: prologue and epilogue of the data kernels
# ================================================================================================
# Polls between two looks at the ERROR word by a wait on node peers alone (~1 µs a poll: ~0.25 ms).
ERROR_POLL_EVERY: tl.constexpr = tl.constexpr(256)


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
    mask_ptr=None,               # shrink mode: (W,) int32 masked ranks (1 = masked), device memory
    counts_bytes=0,              # shrink mode, dispatch: this rank's count rows - base (0: leave them)
    E: tl.constexpr = 1, E_PAD: tl.constexpr = 1,
    SHRINK: tl.constexpr = False,  # masked node peers are not awaited; at the deadline late ones are masked
):
    """Prologue: spin until ready[s] >= epoch for every s of this node (and the proxy's flag is up).
    Returns True when the caller may proceed (False after an earlier failure, a timeout or a proxy
    error, which it records: `protocol_device.encode_wait_status`).

    With SHRINK (one program: the separate wait) the deadline masks the late node peers instead of
    failing, and, with `counts_bytes`, every masked peer's count row here reads zero afterwards (a stopped
    or masked source sends nothing this call)."""
    ok = tl.load(failed_ptr, volatile=True) == 0
    if SPIN:
        if ok:
            i = tl.arange(0, NODE_PAD)
            words = base_ptr.to(tl.pointer_type(tl.int64)) + ready_bytes // 8 + node_first + tl.where(i < NODE, i, 0)
            target = tl.load(epoch_ptr)
            if USE_PTX:
                start = globaltimer_ns()
            else:
                start = tl.zeros([], dtype=tl.int64)
            spins = tl.zeros([], dtype=tl.int64)
            late = i < NODE
            proxy_late = tl.zeros([], dtype=tl.int1)
            state = tl.full([], -1, dtype=tl.int32)
            while state < 0:
                seen = load_acquire_sys(words, USE_PTX)
                late = (seen < target) & (i < NODE)
                if SHRINK:
                    late = late & (tl.load(mask_ptr + node_first + i, mask=i < NODE, other=0, volatile=True) == 0)
                n_late = tl.sum(late.to(tl.int32), axis=0)
                broken = tl.zeros([], dtype=tl.int1)
                if HAS_PROXY:
                    proxy_late = load_acquire_sys(flags_ptr + PROXY_WAIT_WORD, USE_PTX) < target + PROXY_DELTA
                    broken = load_acquire_sys(flags_ptr + ERROR_WORD, USE_PTX) != 0
                    n_late += proxy_late.to(tl.int32)
                else:
                    # A node peer's proxy that saw its rank die writes our ERROR word (host memory): looked
                    # at every ERROR_POLL_EVERY polls, so a waiting grid adds no steady PCIe traffic.
                    if (spins % ERROR_POLL_EVERY) == ERROR_POLL_EVERY - 1:
                        broken = load_acquire_sys(flags_ptr + ERROR_WORD, USE_PTX) != 0
                spins += 1
                if USE_PTX:
                    if BACKOFF_NS > 0:
                        if n_late > 0:
                            nanosleep(tl.full([], BACKOFF_NS, tl.int32))
                    elapsed = globaltimer_ns() - start
                else:
                    elapsed = tl.zeros([], dtype=tl.int64)
                timed_out = (elapsed > timeout_ns) | ((max_spins > 0) & (spins >= max_spins)) | broken
                state = tl.where(n_late == 0, 0, tl.where(timed_out, 1, -1))
                if SHRINK:
                    if state == 1:
                        if not broken:
                            if not proxy_late:  # only node peers are masked here; the proxy masks remote ones
                                tl.store(mask_ptr + node_first + i, tl.full([NODE_PAD], 1, tl.int32), mask=late)
                                state = tl.full([], 0, dtype=tl.int32)
            if SHRINK:
                if counts_bytes > 0:
                    gone = tl.load(mask_ptr + node_first + i, mask=i < NODE, other=0, volatile=True) != 0
                    e = tl.arange(0, E_PAD)
                    rows = base_ptr.to(tl.pointer_type(tl.int32)) + counts_bytes // 4 + (node_first + i[:, None]) * E
                    tl.store(rows + e[None, :], tl.zeros([NODE_PAD, E_PAD], dtype=tl.int32),
                             mask=gone[:, None] & (e[None, :] < E))
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
    # fence + relaxed atomic: a release pattern with one system fence a program (an acq_rel atomic adds a
    # second: 118 -> 99 µs for the reduce by source's 1848 programs, 8 ranks on one GPU, docs/perf-notes.md)
    fence_sys(USE_PTX)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="sys")
    last = arrived == num - 1
    if last:
        fence_sys(USE_PTX)  # the acquire half: the other programs' stores are ordered before what follows
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
    fence_sys(USE_PTX)
    tl.debug_barrier()
    epoch = tl.load(epoch_ptr)
    base_i64 = base_ptr.to(tl.pointer_type(tl.int64))
    for j in range(NODE):
        peer = tl.load(peer_sync_bytes_ptr + node_first + j)
        store_release_sys(base_i64 + (peer + ready_bytes) // 8 + rank, epoch, USE_PTX)
    if HAS_PROXY:
        store_release_sys(flags_ptr + PROXY_SIGNAL_WORD, epoch, USE_PTX)


@triton.jit
def node_mark_aborted(base_ptr, peer_sync_bytes_ptr, aborted_bytes, aborted_ptr, epoch_ptr, rank, node_first,
                      NODE: tl.constexpr):
    """Epilogue, before `node_publish` (whose fence orders these stores before the ready words): when this
    rank aborts the call at its combine (`aborted >= epoch`), aborted[rank] = epoch in every same-node
    rank's sync area."""
    epoch = tl.load(epoch_ptr)
    if tl.load(aborted_ptr, volatile=True) >= epoch:
        base_i64 = base_ptr.to(tl.pointer_type(tl.int64))
        for j in range(NODE):
            peer = tl.load(peer_sync_bytes_ptr + node_first + j)
            tl.store(base_i64 + (peer + aborted_bytes) // 8 + rank, epoch)


@triton.jit
def node_check_aborted(base_ptr, sync_bytes, aborted_bytes, epoch_ptr, flags_ptr, aborted_word, rank, node_first,
                       NODE: tl.constexpr, NODE_PAD: tl.constexpr):
    """After a consumer's wait (which acquired the ready words): Flag.ABORTED names the first node peer
    that aborted this call at its combine, if one did."""
    epoch = tl.load(epoch_ptr)
    i = tl.arange(0, NODE_PAD)
    base_i64 = base_ptr.to(tl.pointer_type(tl.int64))
    words = tl.load(base_i64 + (sync_bytes + aborted_bytes) // 8 + node_first + i, mask=i < NODE, other=0,
                    volatile=True)
    source = node_first + i
    first = tl.min(tl.where((i < NODE) & (words >= epoch) & (source != rank), source, 1 << 30), axis=0)
    if first < (1 << 30):
        tl.store(flags_ptr + aborted_word, protocol_device.encode_abort(epoch, first))


@triton.jit
def report_received(out_num_tokens_ptr, out_ranges_ptr, flags_ptr, epoch_ptr, aborted_ptr, cnt, tot, aborted, write,
                    W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr,
                    HAS_RANGES: tl.constexpr, NODE_SYNC: tl.constexpr, CAPACITY: tl.constexpr,
                    ABORT_WORD: tl.constexpr, CAPACITY_WORD: tl.constexpr, CALL_ABORTED_WORD: tl.constexpr,
                    ABORT_AT_COMBINE: tl.constexpr):
    """What a dispatch receive reports besides its rows, from `recv_pair_tables` (by one program: `write`):
    rows per local expert, DeepEP's `layout_range` (HAS_RANGES), the first source that aborted the call
    (Flag.ABORTED) and an expert over CAPACITY (Flag.CAPACITY_EXCEEDED; with ABORT_AT_COMBINE the call is
    then void, which this rank's combine tells every peer)."""
    l_idx = tl.arange(0, L_PAD)
    tl.store(out_num_tokens_ptr + l_idx, tot.to(tl.int32), mask=l_idx < tl.where(write, L, 0))
    if HAS_RANGES:  # begin = the earlier sources' rows of the expert
        l2 = tl.arange(0, L_PAD)[:, None]
        s2 = tl.arange(0, W_PAD)[None, :]
        tl.store(out_ranges_ptr + l2 * W + s2, ((tl.cumsum(cnt, axis=1) - cnt) << 32) | cnt,
                 mask=(l2 < tl.where(write, L, 0)) & (s2 < W))
    if NODE_SYNC:
        tl.store(flags_ptr + ABORT_WORD, protocol_device.encode_abort(tl.load(epoch_ptr), aborted),
                 mask=write & (aborted < W))
        if CAPACITY > 0:
            over = tl.min(tl.where((l_idx < L) & (tot > CAPACITY), l_idx, L_PAD), axis=0)
            n_over = tl.sum(tl.where(l_idx == over, tot, 0), axis=0)
            hit = write & (over < L)
            tl.store(flags_ptr + CAPACITY_WORD, protocol_device.encode_capacity(over, n_over, L), mask=hit)
            if ABORT_AT_COMBINE:
                epoch = tl.load(epoch_ptr)
                tl.store(aborted_ptr, epoch, mask=hit)
                tl.store(flags_ptr + CALL_ABORTED_WORD, epoch, mask=hit)


@triton.jit
def combine_send_epilogue(base_ptr, counter_ptr, failed_ptr, peer_sync_bytes_ptr, aborted_ptr, epoch_ptr, flags_ptr,
                          rank, node_first, READY_BYTES: tl.constexpr, ABORT_BYTES: tl.constexpr,
                          NODE: tl.constexpr, HAS_PROXY: tl.constexpr, PROXY_SIGNAL_WORD: tl.constexpr,
                          USE_PTX: tl.constexpr):
    """The combine send's epilogue: the last program to arrive (`node_arrive`), unless a wait failed, marks a
    call this rank aborts (`node_mark_aborted`) and publishes the epoch to the node and the proxy."""
    if node_arrive(counter_ptr, USE_PTX):
        if tl.load(failed_ptr, volatile=True) == 0:
            if ABORT_BYTES > 0:
                node_mark_aborted(base_ptr, peer_sync_bytes_ptr, ABORT_BYTES, aborted_ptr, epoch_ptr, rank,
                                  node_first, NODE)
            node_publish(base_ptr, peer_sync_bytes_ptr, READY_BYTES, epoch_ptr, flags_ptr, rank, node_first,
                         NODE, HAS_PROXY, PROXY_SIGNAL_WORD, USE_PTX)


@triton.jit
def publish_epoch(ready_ptr, epoch_ptr, USE_PTX: tl.constexpr):
    """ready = this call's epoch, released after everything this program wrote (one program only)."""
    fence_sys(USE_PTX)
    tl.debug_barrier()
    store_release_sys(ready_ptr, tl.load(epoch_ptr), USE_PTX)


# ================================================================================================
# The walk over received rows (dispatch unpack and combine pack)
# ================================================================================================
@triton.jit
def recv_pair_tables(
    counts_ptr,          # (W, E) int32, row stride `stride_counts_w`, last stride 1
    stride_counts_w,     # elements between rows of counts
    rank,                # this rank ("me"): its experts are [rank*L, rank*L + L)
    PAD: tl.constexpr,   # expert_padding
    W: tl.constexpr,
    L: tl.constexpr,
    W_PAD: tl.constexpr,  # next_pow2(W)
    L_PAD: tl.constexpr,  # next_pow2(L)
    CAPACITY: tl.constexpr,  # 0: compact output; C > 0: expert l's rows start at l * C (A2AConfig.expert_capacity)
):
    """Tables over the (local expert l, source s) pairs, as [L_PAD, W_PAD] int64 tiles.

    Received rows are numbered densely, l-major then s then the source's order: `q` = dense row.
    Returns
      cnt[l, s]          rows source s sends to local expert l (counts[s, rank*L + l])
      dense_start[l, s]  first dense row of the pair (exclusive prefix in (l, s) order)
      out_start[l, s]    first row of out_expert_x: sum_{j<l} round_up(tot_j, PAD) (or l * CAPACITY)
                         + sum_{s'<s} cnt[l, s']
      block_start[l, s]  position of the pair's first row in source s's block: sum_{j<l} cnt[j, s]
      n_src[s]           rows source s sends to this rank
      tot[l]             rows local expert l receives (out_expert_num_tokens)
      num_rows           total received rows
      fit[l, s]          rows of the pair that fit within CAPACITY (cnt without a capacity)
      aborted            the first source s != rank whose row is -1 (it aborted the call), else W_PAD
    Padding entries (l >= L or s >= W) have cnt == 0, so no dense row ever selects them.
    Reads W*L int32 (1 KB at E=256).
    """
    l_idx = tl.arange(0, L_PAD)[:, None]
    s_idx = tl.arange(0, W_PAD)[None, :]
    valid = (l_idx < L) & (s_idx < W)
    raw = tl.load(counts_ptr + s_idx.to(tl.int64) * stride_counts_w + rank * L + l_idx,
                  mask=valid, other=0).to(tl.int64)
    # A source that aborted the call sends a row of -1 (routing.route_tokens(abort=True)): it moves
    # nothing. The first such source other than this rank is reported (`aborted`, W_PAD when none).
    s_flat = tl.arange(0, W_PAD)
    neg = tl.max(tl.where(raw < 0, 1, 0), axis=0)                # [W_PAD]
    aborted = tl.min(tl.where((neg > 0) & (s_flat != rank), s_flat, W_PAD), axis=0)
    cnt = tl.maximum(raw, 0)
    tot = tl.sum(cnt, axis=1)                                   # [L_PAD]
    padded = (tot + PAD - 1) // PAD * PAD
    if CAPACITY > 0:
        seg_start = tl.arange(0, L_PAD).to(tl.int64) * CAPACITY  # fixed segments
    else:
        seg_start = tl.cumsum(padded, axis=0) - padded          # exclusive, padded segments
    expert_dense_start = tl.cumsum(tot, axis=0) - tot           # exclusive, unpadded
    before = tl.cumsum(cnt, axis=1) - cnt                       # earlier sources, same expert
    dense_start = expert_dense_start[:, None] + before
    out_start = seg_start[:, None] + before
    block_start = tl.cumsum(cnt, axis=0) - cnt                  # earlier experts, same source
    n_src = tl.sum(cnt, axis=0)                                 # [W_PAD]
    num_rows = tl.sum(tot, axis=0)
    if CAPACITY > 0:
        fit = tl.minimum(tl.maximum(CAPACITY - before, 0), cnt)
    else:
        fit = cnt
    return cnt, dense_start, out_start, block_start, n_src, tot, num_rows, fit, aborted


@triton.jit
def send_offsets_of(
    counts_ptr,          # (W, E) int32
    stride_counts_w,
    rank,
    is_peer,             # [W_PAD] int1: only these sources are summed (same-node ones)
    L: tl.constexpr,
    W_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """[W_PAD] int64: for each source s with is_peer[s], where its run of rows for this rank starts in
    its send buffer, sum_{e < rank*L} counts[s, e] (plan.send_offsets(counts[s])[rank]); 0 elsewhere.
    Masked loads fetch nothing, so only the node's <= 8 rows are read (8 KB at most for E=256)."""
    s_idx = tl.arange(0, W_PAD)
    acc = tl.zeros([W_PAD], dtype=tl.int64)
    end = rank * L
    for e0 in range(0, end, BLOCK_E):
        e_idx = e0 + tl.arange(0, BLOCK_E)
        mask = is_peer[:, None] & (e_idx[None, :] < end)
        part = tl.load(counts_ptr + s_idx[:, None].to(tl.int64) * stride_counts_w + e_idx[None, :],
                       mask=mask, other=0)
        acc += tl.sum(tl.maximum(part, 0).to(tl.int64), axis=1)  # an aborted source's row is -1
    return acc


@triton.jit
def node_peer_tables(peer_bytes_ptr, counts_ptr, stride_counts_w, rank,
                     W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, BLOCK_E: tl.constexpr):
    """([W_PAD] peer buffer - base in bytes or -1, [W_PAD] same-node flag, [W_PAD] `send_offsets_of`)
    from a (W,) int64 peer table: the sources (dispatch) or homes (combine) reached in memory."""
    s_idx = tl.arange(0, W_PAD)
    peer = tl.load(peer_bytes_ptr + s_idx, mask=s_idx < W, other=-1)
    is_peer = (peer >= 0) & (s_idx < W)
    return peer, is_peer, send_offsets_of(counts_ptr, stride_counts_w, rank, is_peer, L, W_PAD, BLOCK_E)


@triton.jit
def tile_rows(
    tile,                # int32: tile number; rows tile*BLOCK_R .. +BLOCK_R of the dense numbering
    num_rows,            # int64: received rows in total
    cnt, dense_start, out_start,  # [NPAIR] int64 pair tables of `recv_pair_tables`, flattened
    first_bytes,         # [NPAIR] int64: byte offset (from base) of the pair's row 0 in the other buffer
    rest_bytes,          # [NPAIR] int64: ... of a virtual row 0 for rows i >= split (only when HAS_SPLIT)
    split,               # [NPAIR] int64: rows i < split use first_bytes, the others rest_bytes
    STRIDE_BYTES: tl.constexpr,   # slot stride of the other buffer
    BLOCK_R: tl.constexpr,
    HAS_SPLIT: tl.constexpr,      # dispatch from a remote source: private region, then remainder
    fit=None,                     # [NPAIR] int64: rows i >= fit of a pair do not exist here (HAS_FIT)
    HAS_FIT: tl.constexpr = False,  # a fixed expert capacity: rows past it are dropped
):
    """For the BLOCK_R dense rows q of a tile: (is_row, row of the expert-major tensor, byte offset of
    the row's slot from base). The pair of each row is found by a one-hot [BLOCK_R, NPAIR] compare and
    the pair's table entries by masked sums: a register gather that needs no scratch memory, cheap
    because NPAIR = E is small (256) next to the BLOCK_R rows of kilobytes each tile moves."""
    q = tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # rows < W*T*K < 2**31: int32 tile is safe
    is_row = q < num_rows
    sel = (q[:, None] >= dense_start[None, :]) & (q[:, None] < dense_start[None, :] + cnt[None, :])
    i = q - tl.sum(tl.where(sel, dense_start[None, :], 0), axis=1)
    if HAS_FIT:
        is_row = is_row & (i < tl.sum(tl.where(sel, fit[None, :], 0), axis=1))
    row = tl.sum(tl.where(sel, out_start[None, :], 0), axis=1) + i
    addr = tl.sum(tl.where(sel, first_bytes[None, :], 0), axis=1)
    if HAS_SPLIT:
        use_first = i < tl.sum(tl.where(sel, split[None, :], 0), axis=1)
        addr = tl.where(use_first, addr, tl.sum(tl.where(sel, rest_bytes[None, :], 0), axis=1))
    return is_row, row, addr + i * STRIDE_BYTES


@triton.jit
def copy_row_words(src_ptr, src_words, dst_ptr, dst_words, is_row, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Copy WORDS words of every row i with is_row[i] from src_ptr + src_words[i] to dst_ptr + dst_words[i],
    BLOCK_W words at a time (the data movement of unpack and of combine pack, in opposite directions)."""
    for c0 in range(0, WORDS, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        mask = is_row[:, None] & (cols < WORDS)[None, :]
        v = tl.load(src_ptr + src_words[:, None] + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst_words[:, None] + cols[None, :], v, mask=mask)


@triton.jit
def copy_row_columns(src_ptr, src_words, dst_ptr, dst_words, dst_col_stride, is_row, COLS: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    """`copy_row_words` into columns `dst_col_stride` words apart (the scales of unpack). Give BLOCK_C the
    payload copy's BLOCK_W, not the next power of two of COLS: a narrow [BLOCK_R, COLS] tile makes the
    compiler lay the row vectors (and the one-hot lookup of `tile_rows` behind them) out with threads
    along the rows, which spills hundreds of registers (H200, unpack at 2-16 scales: 38-664 µs, not 15)."""
    for c0 in range(0, COLS, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = is_row[:, None] & (cols < COLS)[None, :]
        v = tl.load(src_ptr + src_words[:, None] + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst_words[:, None] + cols[None, :] * dst_col_stride, v, mask=mask)


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def expert_pair_row(l, cnt, first_bytes, rest_bytes, split, L_PAD: tl.constexpr):
    """Row l of the four `[L_PAD, W_PAD]` pair tables, as `[W_PAD]` vectors, in one reduction of four
    operands (one pass through shared memory instead of four)."""
    row_l = tl.arange(0, L_PAD)[:, None] == l
    return tl.reduce((tl.where(row_l, cnt, 0), tl.where(row_l, first_bytes, 0), tl.where(row_l, rest_bytes, 0),
                      tl.where(row_l, split, 0)), 0, _add4)


@triton.jit
def expert_rows_source(c, cnt_l, first_l, rest_l, split_l, STRIDE_BYTES: tl.constexpr):
    """Byte offset (from base) of the slot of one local expert's rows c ([B] int64, the expert's own order:
    source-major), from that expert's `[W_PAD]` rows of the pair tables (`expert_pair_row`) and the unpack's
    slot tables; the one-hot is over the W sources of one expert, not all L*W pairs (`tile_rows`)."""
    before = tl.cumsum(cnt_l, axis=0) - cnt_l
    sel = (c[:, None] >= before[None, :]) & (c[:, None] < (before + cnt_l)[None, :])
    i = c - tl.sum(tl.where(sel, before[None, :], 0), axis=1)
    first = tl.sum(tl.where(sel, first_l[None, :], 0), axis=1)
    rest = tl.sum(tl.where(sel, rest_l[None, :], 0), axis=1)
    cut = tl.sum(tl.where(sel, split_l[None, :], 0), axis=1)
    return tl.where(i < cut, first, rest) + i * STRIDE_BYTES


@triton.jit
def expert_row_words(out_row, stride_e, stride_r, CAPACITY: tl.constexpr):
    """Where output row `out_row` starts in a `[R, cols]` tensor (row stride `stride_r`) or, with CAPACITY C,
    in an `[L, C, cols]` one of any strides: `(row // C) * stride_e + (row % C) * stride_r` (a 2-D tensor
    passes stride_e = C * stride_r: the same address). For unpack's scale outputs (`copy_row_columns`)."""
    if CAPACITY > 0:
        return (out_row // CAPACITY) * stride_e + (out_row % CAPACITY) * stride_r
    return out_row * stride_r


# ================================================================================================
# fp8 e4m3 block quantisation (the formula and why each step: quant.py's overview)
# ================================================================================================
@triton.jit
def fp8_block_quantize(x, ROUND_SCALE: tl.constexpr, BY_RECIPROCAL: tl.constexpr = False):
    """x: [N, C] fp32, one scale block per row (masked elements 0). Returns (q [N, C] fp32 in [-448, 448],
    exactly representable after the fp8 cast's rounding, scale [N] fp32). BY_RECIPROCAL (the combine's fp8
    rows, `reference.quantize_fp8_blocks`): q = x * (1 / scale), one division a block instead of one an
    element (an IEEE division is a subroutine of ~10 instructions: it was the fp8 combine pack's cost)."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.div_rn(amax, 448.0)
    scale = tl.where(scale >= 1.1754943508222875e-38, scale, 1.0)  # 2**-126
    if ROUND_SCALE:
        # 2 ** ceil(log2(scale)) of a positive normal fp32: clear the mantissa, carrying into the
        # exponent when it was not zero (scale <= 3.4e38 / 448: the exponent cannot overflow).
        scale = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    if BY_RECIPROCAL:
        q = x * tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    else:
        q = tl.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return q, scale


@triton.jit
def fp8_e4m3_store(ptr, offs, q, mask, FP8_VIA_BITS: tl.constexpr):
    """Store `q` (fp32 in [-448, 448]) as e4m3fn bytes at `ptr + offs` (`ptr`: uint8). On a GPU the
    native cast (`cvt.rn.satfinite`); with FP8_VIA_BITS (the interpreter, whose fp8 cast flushes
    subnormals) the same RNE encoding in integer arithmetic."""
    if FP8_VIA_BITS:
        bits = q.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = tl.abs(q)
        abits = a.to(tl.int32, bitcast=True)
        # Normal e4m3 (|q| >= 2**-6): keep 3 of fp32's 23 mantissa bits with round-half-even on the
        # raw bits (a carry correctly bumps the exponent), then rebias the exponent from 127 to 7.
        rounded = abits + 0x7FFFF + ((abits >> 20) & 1)
        normal = (rounded >> 20) - (120 << 3)
        # Subnormal e4m3 (|q| < 2**-6, steps of 2**-9): the code is RNE(|q| * 512); adding and
        # removing 2**23 rounds to an integer with the FPU's round-half-even (|q| * 512 is exact).
        subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        code = sign | tl.where(a >= 0.015625, normal, subnormal)
        tl.store(ptr + offs, code.to(tl.uint8), mask=mask)
    else:
        tl.store(ptr.to(tl.pointer_type(tl.float8e4nv)) + offs, q.to(tl.float8e4nv), mask=mask)


@triton.jit
def ue8m0_code(scale):
    """The UE8M0 code of a power-of-two fp32 scale: its biased exponent byte (scale = 2 ** (code - 127))."""
    return ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)


# ================================================================================================
# Tokens of a pack / reduce program
# ================================================================================================
@triton.jit
def row_destination(q, sender, RELAY: tl.constexpr, NODE_SIZE: tl.constexpr):
    """The rank a per-rank row to rank q goes to: q, or with RELAY for q on another node than the sender the
    sender's relay there (the rank of q's node with the sender's local index: `reference.relay_rank`)."""
    if RELAY:
        q = tl.where(q // NODE_SIZE == sender // NODE_SIZE, q, (q // NODE_SIZE) * NODE_SIZE + sender % NODE_SIZE)
    return q


@triton.jit
def first_route_rank(indices_ptr, route, in_range, num_experts, K: tl.constexpr, K_PAD: tl.constexpr,
                     L: tl.constexpr, sender, RELAY: tl.constexpr, NODE_SIZE: tl.constexpr):
    """Per route r = t*K + k of a flat block: the rank its row goes to (`row_destination` of its expert's rank)
    when it is the token's first live route there (no live k' < k of t goes to the same rank), else -1. Reads
    the token's K indices (from L1: the block's own tokens), so the per-rank routing needs no pass of its own."""
    t = route // K
    k = route % K
    kk = tl.arange(0, K_PAD)
    m = in_range[:, None] & (kk[None, :] < K)
    raw = tl.load(indices_ptr + t[:, None] * K + kk[None, :], mask=m, other=-1)
    live = m & (raw >= 0) & (raw < num_experts)  # compared before the cast: an int64 past 2**31 stays dead
    dest = tl.where(live, row_destination(tl.where(live, raw, 0).to(tl.int32) // L, sender, RELAY, NODE_SIZE), -1)
    mine = tl.max(tl.where(kk[None, :] == k[:, None], dest, -1), axis=1)
    before = tl.max(tl.where((kk[None, :] < k[:, None]) & (dest == mine[:, None]), 1, 0), axis=1)
    return tl.where((mine >= 0) & (before == 0), mine, -1)


@triton.jit
def column_of(tile, kk, k):
    """Column k of a [N, K_PAD] int tile (-1 where absent): a masked max, no gather needed."""
    return tl.max(tl.where(kk[None, :] == k, tile, -1), axis=1)


@triton.jit
def stamp_row_meta(base_ptr, rows_ptr, stride_rows_t, stride_rows_k, indices_ptr, slot_ptr, counts_ptr, weights_ptr,
                   num_tokens, num_experts, stride_counts, stride_w_t, stride_w_k, sender, send_bytes,
                   remote_send_bytes, node_slot_lo, node_slot_hi, node_half, K: tl.constexpr, K_PAD: tl.constexpr,
                   L: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, MAX_SLOTS: tl.constexpr,
                   SD_BYTES: tl.constexpr, META_OFFSET_BYTES: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                   SPLIT: tl.constexpr, HALF: tl.constexpr, RELAY: tl.constexpr, NODE_SIZE: tl.constexpr):
    """The metadata of every per-rank row this program's BLOCK_T tokens open (`rows_ptr`: the row of (t, rank
    r) at its opening route, -1 elsewhere), after the row's scales: for each k, the local expert of route k when
    it goes to r (else -1), its position among this rank's routes to that expert (its expert-major slot minus
    the expert's first slot, from the routing's counts), and with HAS_WEIGHTS the K weights. With RELAY a row to
    a relay r (another node) names, per k, the node-local expert (expert - first expert of r's node) of each
    route to that node. SPLIT as the pack: rows of this node at send_bytes, the others at remote_send_bytes;
    with HALF only the rows of the half `node_half`."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    kk = tl.arange(0, K_PAD)
    m = (tokens[:, None] < num_tokens) & (kk[None, :] < K)
    raw = tl.load(indices_ptr + tokens[:, None] * K + kk[None, :], mask=m, other=-1)
    live = m & (raw >= 0) & (raw < num_experts)  # compared before the cast: an int64 past 2**31 stays dead
    expert = tl.where(live, raw, 0).to(tl.int32)
    slot = tl.load(slot_ptr + tokens[:, None] * K + kk[None, :], mask=m, other=-1)
    live = live & (slot >= 0)  # bound_m and bad indices: the routing decided
    e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e.to(tl.int64) * stride_counts, mask=e < num_experts, other=0)
    first = tl.cumsum(counts, axis=0) - counts
    flat = tl.reshape(tl.where(live, expert, 0), (BLOCK_T * K_PAD,))
    pos = slot - tl.reshape(tl.gather(first, flat, 0), (BLOCK_T, K_PAD))
    dest = tl.where(live, row_destination(expert // L, sender, RELAY, NODE_SIZE), -1)
    local = expert - (expert // L) * L
    if RELAY:  # a relay forwards the row to every rank of its node a route hits: ids relative to the node
        local = tl.where(dest // NODE_SIZE != sender // NODE_SIZE, expert - (dest // NODE_SIZE) * NODE_SIZE * L, local)
    opens = tl.load(rows_ptr + tokens[:, None] * stride_rows_t + kk[None, :] * stride_rows_k, mask=m, other=-1)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + tokens[:, None] * stride_w_t + kk[None, :] * stride_w_k, mask=m, other=0.0)
    base_i32 = base_ptr.to(tl.pointer_type(tl.int32))
    base_f32 = base_ptr.to(tl.pointer_type(tl.float32))
    for k in range(K):
        row = column_of(opens, kk, k).to(tl.int64)
        dk = column_of(dest, kk, k)
        ok = (row >= 0) & (row < MAX_SLOTS)
        at = send_bytes
        if SPLIT:  # as the pack: this node's rows stay in device memory, the others are staged
            in_node = (row >= node_slot_lo) & (row < node_slot_hi)
            at = tl.where(in_node, send_bytes, remote_send_bytes)
            if HALF:
                ok = ok & (in_node == node_half)
        meta = (at + row * SD_BYTES + META_OFFSET_BYTES) // 4
        mask = ok[:, None] & (kk[None, :] < K)
        mine = live & (dest == dk[:, None])
        tl.store(base_i32 + meta[:, None] + kk[None, :], tl.where(mine, local, -1), mask=mask)
        tl.store(base_i32 + meta[:, None] + K + kk[None, :], tl.where(mine, pos, 0), mask=mask)
        if HAS_WEIGHTS:
            tl.store(base_f32 + meta[:, None] + 2 * K + kk[None, :], w, mask=mask)


@triton.jit
def live_token_block(num_tokens, bound_m_ptr, BLOCK_T: tl.constexpr, HAS_BOUND_M: tl.constexpr,
                     REPEAT: tl.constexpr = 1):
    """(this program's BLOCK_T token ids along grid axis 0, which of them are < min(T, bound_m)).
    With REPEAT > 1, BLOCK_T * REPEAT entries: each token id REPEAT times in a row (one per group of
    a row the program handles: the fused quantisation of dispatch pack)."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T * REPEAT) // REPEAT
    num_live = num_tokens
    if HAS_BOUND_M:
        num_live = tl.minimum(tl.load(bound_m_ptr).to(tl.int64), num_tokens)
    return tokens, tokens < num_live


@triton.jit
def consumer_prologue(base_ptr, ready_bytes, epoch_ptr, failed_ptr, flags_ptr, node_first, timeout_ns, max_spins,
                      NODE: tl.constexpr, NODE_PAD: tl.constexpr, HAS_PROXY: tl.constexpr, PROXY_WAIT_WORD: tl.constexpr,
                      PROXY_DELTA: tl.constexpr, ERROR_WORD: tl.constexpr, STATUS_WORD: tl.constexpr,
                      USE_PTX: tl.constexpr, KERNEL_WAIT: tl.constexpr, NODE_SYNC: tl.constexpr):
    """A receiving kernel's first step: with NODE_SYNC `node_wait` for its node peers' words (and the proxy's
    flag), else nothing to wait for. True when the program may go on."""
    ok = tl.program_id(0) >= 0
    if NODE_SYNC:
        ok = node_wait(base_ptr, ready_bytes, epoch_ptr, failed_ptr, flags_ptr, node_first, timeout_ns, max_spins,
                       NODE, NODE_PAD, HAS_PROXY, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD, STATUS_WORD, USE_PTX,
                       KERNEL_WAIT)
    return ok


@triton.jit
def token_sum_start(out_tokens_ptr, tokens, is_live, stride_out_t, chunk, H: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr, ACCUMULATE: tl.constexpr):
    """A combine receive's tile of tokens x one hidden chunk: (columns, mask, output pointers, fp32 accumulator,
    starting from the old value with ACCUMULATE, else +0)."""
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = is_live[:, None] & (cols < H)[None, :]
    out_ptrs = out_tokens_ptr + tokens[:, None] * stride_out_t + cols[None, :]
    if ACCUMULATE:
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    return cols, mask, out_ptrs, acc


@triton.jit
def combine_row_bytes(slot, recv_bytes, remote_recv_bytes, node_slots_ptr, SC_BYTES: tl.constexpr,
                      SPLIT: tl.constexpr):
    """Where the combine row of each `slot` landed: the recv buffer's combine region, or with only remote rows
    staged (SPLIT) the staging one for slots outside this node's range `node_slots_ptr[0:2]` (docs/protocol.md,
    3.6; not `node_first`, which names the node's first rank)."""
    if SPLIT:
        lo = tl.load(node_slots_ptr)
        hi = tl.load(node_slots_ptr + 1)
        return tl.where((slot >= lo) & (slot < hi), recv_bytes, remote_recv_bytes) + slot * SC_BYTES
    return recv_bytes + slot * SC_BYTES


# ================================================================================================
# fp8 combine rows (A2AConfig.combine_fp8): quantise rows into slots, load and dequantise chunks
#
# A slot holds H fp8 e4m3 bytes at [0, H) and ceil(H / Q_BLOCK) fp32 scales from SCALE_OFFSET_BYTES
# (`A2AConfig.combine_scale_offset_bytes`); the math is `reference.quantize_fp8_blocks` /
# `dequantize_fp8_blocks` (`fp8_block_quantize` BY_RECIPROCAL, no power-of-two scales). Combine pack and
# reduce use these; so may any kernel that writes or reads such slots (a sender-side reduce).
# ================================================================================================
@triton.jit
def fp8_e4m3_load(ptr, offs, mask, FP8_VIA_BITS: tl.constexpr):
    """The e4m3fn bytes at `ptr + offs` (`ptr`: uint8) as fp32 (exact; masked elements 0). The decode
    twin of `fp8_e4m3_store`: on a GPU the native conversion; with FP8_VIA_BITS (the interpreter, whose
    fp8 casts are not to be trusted with subnormals) the same values from integer arithmetic."""
    if FP8_VIA_BITS:
        c = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint32)
        sign = (c & 0x80) << 24
        e = (c >> 3) & 0xF
        m = c & 0x7
        # Normal (e > 0): 2**(e - 7) * (1 + m/8): rebias the exponent from 7 to 127, mantissa on top.
        normal = sign | ((e + 120) << 23) | (m << 20)
        bits = tl.where((c & 0x7F) == 0x7F, sign | 0x7FC00000, normal)  # e4m3fn has no inf: S.1111.111 is NaN
        value = bits.to(tl.float32, bitcast=True)
        # Subnormal (e == 0): m * 2**-9, exact in fp32; the sign kept (0x80 is -0.0).
        sub = m.to(tl.float32) * 0.001953125
        sub = tl.where(sign != 0, -sub, sub)
        return tl.where(e == 0, sub, value)
    else:
        return tl.load(ptr.to(tl.pointer_type(tl.float8e4nv)) + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def fp8_quantize_rows(
    src_ptr,             # (R, H) element pointer (bf16 / fp16 / fp32): the rows to quantise
    src_elems,           # [BLOCK_R] int64: where each row starts, elements from src_ptr
    dst_ptr,             # uint8: byte address space of the slots
    dst_bytes,           # [BLOCK_R] int64: where each row's slot starts, bytes from dst_ptr (a multiple of 4)
    is_row,              # [BLOCK_R] int1: rows to write (the others are neither read nor written)
    H: tl.constexpr,
    SCALE_OFFSET_BYTES: tl.constexpr,  # where a slot's fp32 scales start (a multiple of 4)
    BLOCK_R: tl.constexpr,
    G: tl.constexpr,                   # scale groups per step (a power of two): the tile is [BLOCK_R, G * Q_BLOCK]
    Q_BLOCK: tl.constexpr,             # elements per scale (a power of two; 128 for the combine)
    FP8_VIA_BITS: tl.constexpr,
    ALIGN_BYTES: tl.constexpr = 1,     # every dst_bytes is a multiple of this (16: 16-byte fp8 stores)
):
    """Quantise H elements of every row i with is_row[i] into its slot: fp8 bytes at dst_bytes[i] + [0, H),
    one fp32 scale per Q_BLOCK elements at dst_bytes[i] + SCALE_OFFSET_BYTES (`fp8_block_quantize` without
    ROUND_SCALE: bitwise `reference.quantize_fp8_blocks`). The tile keeps a row's G groups side by side, so
    the callers' alignment hints on src_elems and dst_bytes reach the loads and the fp8 stores (16-byte
    vectors; in a [rows * groups, Q_BLOCK] tile every fp8 byte was stored alone: 4x the copy's time at
    prefill on the H200); a reshape makes each group's amax one row reduction. Reads H * itemsize and writes
    H + 4 * ceil(H / Q_BLOCK) bytes per row; the padding bytes of the slot are not written."""
    NUM_SCALES: tl.constexpr = (H + Q_BLOCK - 1) // Q_BLOCK
    BLOCK_H: tl.constexpr = G * Q_BLOCK
    scale_ptr = dst_ptr.to(tl.pointer_type(tl.float32))
    scale_words = (dst_bytes + SCALE_OFFSET_BYTES) // 4
    for chunk in range(0, (H + BLOCK_H - 1) // BLOCK_H):
        h0 = chunk * BLOCK_H  # (not a range step: the compiler then knows h0's alignment)
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = is_row[:, None] & (cols < H)[None, :]
        x = tl.load(src_ptr + src_elems[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q, scale = fp8_block_quantize(tl.reshape(x, (BLOCK_R * G, Q_BLOCK)), False, True)
        # (the hint here, at the store: one on dst_bytes is lost when the compiler copies their arithmetic)
        dst = tl.multiple_of(dst_bytes[:, None] + cols[None, :], [1, ALIGN_BYTES])
        fp8_e4m3_store(dst_ptr, dst, tl.reshape(q, (BLOCK_R, BLOCK_H)), mask, FP8_VIA_BITS)
        group = h0 // Q_BLOCK + tl.arange(0, G)
        tl.store(scale_ptr + scale_words[:, None] + group[None, :], tl.reshape(scale, (BLOCK_R, G)),
                 mask=is_row[:, None] & (group < NUM_SCALES)[None, :])


@triton.jit
def fp8_load_dequantized(
    base_ptr,            # uint8: byte address space of the slots
    row_bytes,           # [N] int64: where each slot starts, bytes from base_ptr (a multiple of 4)
    h0,                  # the chunk's first element (a multiple of BLOCK_H)
    rows_ok,             # [N] int1: slots to read (the others' elements are 0)
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,             # elements of the chunk (a power of two)
    SCALE_OFFSET_BYTES: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    FP8_VIA_BITS: tl.constexpr,
):
    """[N, BLOCK_H] fp32: elements [h0, h0 + BLOCK_H) (those < H; the others 0) of the fp8 slots at
    base_ptr + row_bytes, dequantised as `reference.dequantize_fp8_blocks` does: fp32(q) * scale of the
    element's block (one fp32 rounding). Reads BLOCK_H fp8 bytes per row and one scale per block in the
    chunk (a scale gathered per element was one 4-byte load per element)."""
    cols = h0 + tl.arange(0, BLOCK_H)
    mask = rows_ok[:, None] & (cols < H)[None, :]
    q = fp8_e4m3_load(base_ptr, row_bytes[:, None] + cols[None, :], mask, FP8_VIA_BITS)
    scales = base_ptr.to(tl.pointer_type(tl.float32))
    scale_words = (row_bytes + SCALE_OFFSET_BYTES) // 4
    if BLOCK_H >= Q_BLOCK:  # whole blocks: one scale each, broadcast over its Q_BLOCK elements
        NB: tl.constexpr = BLOCK_H // Q_BLOCK
        N: tl.constexpr = row_bytes.shape[0]
        block = h0 // Q_BLOCK + tl.arange(0, NB)
        scale = tl.load(scales + scale_words[:, None] + block[None, :],
                        mask=rows_ok[:, None] & (block < (H + Q_BLOCK - 1) // Q_BLOCK)[None, :], other=0.0)
        return tl.reshape(tl.reshape(q, (N, NB, Q_BLOCK)) * scale[:, :, None], (N, BLOCK_H))
    else:  # the chunk lies in one block
        scale = tl.load(scales + scale_words + h0 // Q_BLOCK, mask=rows_ok, other=0.0)
        return q * scale[:, None]
