"""The `@triton.jit` body of `relay.py` (private: launched only by its launcher, which holds the overview, the
checks and the block sizes). The row walk, the metadata and the rounding are `_rank_rows_kernels.py`'s.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _details as d
from . import _launch as launch
from ._rank_rows_kernels import (_node_holder, _pick, _rank_row_places, _rank_row_sources, _relay_partial_bases,
                                 _route_ids, _store_combine_rows, _tile_meta)


@triton.jit(repr=launch.compiled_as(launch.COMBINE_SYMBOL))
def _reduce_relayed_rows_kernel(
    rank_rows_ptr,          # (W, W) int32, row stride stride_rank_rows_w: rows per destination rank
    base_ptr,               # uint8: byte address space of the node peers' buffers
    peer_partial_bytes_ptr,  # (W,) int64: node peer d's partial region - base, -1 = remote
    recv_bytes,             # this rank's recv buffer - base: its relayed sources' rows (their metadata)
    stage_bytes,            # this rank's combine staging area - base: the rows for the relayed homes
    rank, stride_rank_rows_w,
    W: tl.constexpr, W_PAD: tl.constexpr, L: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, H: tl.constexpr,
    NODE_SIZE: tl.constexpr, P: tl.constexpr, HEADER_ROWS: tl.constexpr, PRIVATE_OFFSET_BYTES: tl.constexpr,
    SD_BYTES: tl.constexpr, META_OFFSET_BYTES: tl.constexpr, SC_BYTES: tl.constexpr,
    PARTIAL_STRIDE_BYTES: tl.constexpr, ITEM_BYTES: tl.constexpr, Y_TY: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGN_BYTES: tl.constexpr = 1,  # every staged row starts at a multiple of it (16: vector stores)
    H_CHUNKS: tl.constexpr = 1,  # BLOCK_H chunks of the hidden dimension a program walks (`reduce_launch_shape`)
    FP8: tl.constexpr = False,  # A2AConfig.combine_fp8: rows as fp8 e4m3 + fp32 scales per Q_BLOCK
    Q_BLOCK: tl.constexpr = 128, SCALE_OFFSET_BYTES: tl.constexpr = 0, FP8_VIA_BITS: tl.constexpr = False,
    # Same-node synchronisation (NodeSync.kernel_args("combine_relay")), only with NODE_SYNC:
    failed_ptr=None, counter_ptr=None, epoch_ptr=None, flags_ptr=None, peer_sync_bytes_ptr=None,
    sync_bytes=0, node_first=0, timeout_ns=0, max_spins=0,
    READY_BYTES: tl.constexpr = 0, NODE: tl.constexpr = 1, NODE_PAD: tl.constexpr = 1,
    NODE_SYNC: tl.constexpr = False, HAS_PROXY: tl.constexpr = False, USE_PTX: tl.constexpr = False,
    STATUS_WORD: tl.constexpr = 0, PROXY_WAIT_WORD: tl.constexpr = 0, PROXY_DELTA: tl.constexpr = 0,
    ERROR_WORD: tl.constexpr = 0, PROXY_SIGNAL_WORD: tl.constexpr = 0, KERNEL_WAIT: tl.constexpr = True,
    ABORT_BYTES: tl.constexpr = 0, CALL_ABORTED_WORD: tl.constexpr = 0,  # a node peer's abort, forwarded
):
    """Compiled as `moe_a2a::combine()`. Grid: (G, cdiv(H, BLOCK_H * H_CHUNKS)): G persistent programs over tiles
    of BLOCK_R rows of the sources this rank relays for (remote, on its rail), numbered source-major, for each
    H_CHUNKS BLOCK_H-element chunks. Row j of source s (in this recv buffer, the relay geometry): the sum, in fp32 from
    +0, of the partials at row base[s] + j of the node ranks its routes hit, in ascending rank, rounded once
    into the staging area at row `combine_stage_offsets(rows into this rank)[s] + j`. With NODE_SYNC the
    prologue waits for the node peers' combine_ready (their partials are written) and, with HAS_PROXY, the
    proxy's previous combine writes; the last program to arrive then raises the proxy's flag."""
    pid = tl.program_id(0)
    # Staged rows are source-major over every source's rows to this rank (`plan.combine_writes`' sources).
    _, _, stage_row, _, _ = _rank_row_sources(rank_rows_ptr, stride_rank_rows_w, rank, W, W_PAD, P)
    n, off, _, before, col = _rank_row_sources(rank_rows_ptr, stride_rank_rows_w, rank, W, W_PAD, P, True, NODE_SIZE)
    s_idx = tl.arange(0, W_PAD)
    remote = ((s_idx // NODE_SIZE) != rank // NODE_SIZE).to(tl.int32)
    pbase = _relay_partial_bases(n, remote)
    n = tl.where((remote > 0) & (col == rank), n, 0)  # the sources relayed through this rank only
    dense = tl.cumsum(n, axis=0) - n
    num_rows = tl.sum(n, axis=0)
    if NODE_SYNC:
        ok = d.node_wait(base_ptr, sync_bytes + READY_BYTES, epoch_ptr, failed_ptr, flags_ptr, node_first,
                         timeout_ns, max_spins, NODE, NODE_PAD, HAS_PROXY, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD,
                         STATUS_WORD, USE_PTX, KERNEL_WAIT)
        num_rows = tl.where(ok, num_rows, 0)
    # (the partial table doubles as the pull table: -1 for every remote source, so none is pulled)
    first, rest, split = _rank_row_places(peer_partial_bytes_ptr, recv_bytes, n, off, before, W, W_PAD, P,
                                          HEADER_ROWS, PRIVATE_OFFSET_BYTES, SD_BYTES, peer_partial_bytes_ptr, col)
    node0 = (rank // NODE_SIZE) * NODE_SIZE
    base_i32 = base_ptr.to(tl.pointer_type(tl.int32))
    base_f32 = base_ptr.to(tl.pointer_type(tl.float32))
    kk = tl.arange(0, K_PAD)
    for tile in range(pid, tl.cdiv(num_rows, BLOCK_R).to(tl.int32), tl.num_programs(0)):
        is_row, src, j, meta = _tile_meta(tile, num_rows, n, dense, first, rest, split, W_PAD, BLOCK_R, SD_BYTES,
                                          META_OFFSET_BYTES)
        holder = _node_holder(_route_ids(base_i32, meta, is_row, kk, K), L, NODE_SIZE)
        prow = _pick(pbase, src, W_PAD) + j
        for c in range(H_CHUNKS):  # as the reduce by source: chunks of the hidden dimension a program
            h0 = (tl.program_id(1) * H_CHUNKS + c) * BLOCK_H
            cols = h0 + tl.arange(0, BLOCK_H)
            acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
            for i in range(NODE_SIZE):  # ascending rank: the reference's order of the node's partials
                hit = is_row & (tl.max(tl.where(holder == i, 1, 0), axis=1) > 0)
                at = (tl.load(peer_partial_bytes_ptr + node0 + i) + prow * PARTIAL_STRIDE_BYTES) // 4
                p = tl.load(base_f32 + at[:, None] + cols[None, :], mask=hit[:, None] & (cols < H)[None, :],
                            other=0.0)
                acc = tl.where(hit[:, None], acc + p, acc)
            _store_combine_rows(base_ptr, stage_bytes + (_pick(stage_row, src, W_PAD) + j) * SC_BYTES, h0, acc,
                                is_row, Y_TY, H, ITEM_BYTES, ALIGN_BYTES, BLOCK_R, BLOCK_H, FP8, Q_BLOCK,
                                SCALE_OFFSET_BYTES, FP8_VIA_BITS)
    if NODE_SYNC:
        if HAS_PROXY:  # every program's staged rows are visible before the proxy is told to post them
            if d.node_arrive(counter_ptr, USE_PTX):
                if ABORT_BYTES > 0:  # a node peer aborted the call at its combine: our homes learn it from us
                    _forward_node_abort(base_ptr, sync_bytes, epoch_ptr, flags_ptr, node_first, ABORT_BYTES,
                                        CALL_ABORTED_WORD, NODE, NODE_PAD)
                if tl.load(failed_ptr, volatile=True) == 0:
                    d.node_publish(base_ptr, peer_sync_bytes_ptr, READY_BYTES, epoch_ptr, flags_ptr, rank, node_first,
                                   0, True, PROXY_SIGNAL_WORD, USE_PTX)


@triton.jit
def _forward_node_abort(base_ptr, sync_bytes, epoch_ptr, flags_ptr, node_first, ABORT_BYTES: tl.constexpr,
                        CALL_ABORTED_WORD: tl.constexpr, NODE: tl.constexpr, NODE_PAD: tl.constexpr):
    """Flag.CALL_ABORTED = e when a node peer's combine_aborted word (written before its combine_ready, which
    the prologue acquired) says it aborted call e: the proxy then sends this rank's homes COMBINE_ABORTED, as it
    does for an abort of its own (its rows carry that peer's partials, which it never wrote)."""
    epoch = tl.load(epoch_ptr)
    i = tl.arange(0, NODE_PAD)
    words = tl.load(base_ptr.to(tl.pointer_type(tl.int64)) + (sync_bytes + ABORT_BYTES) // 8 + node_first + i,
                    mask=i < NODE, other=0, volatile=True)
    if tl.max(tl.where(words >= epoch, 1, 0), axis=0) > 0:
        tl.store(flags_ptr + CALL_ABORTED_WORD, epoch)
