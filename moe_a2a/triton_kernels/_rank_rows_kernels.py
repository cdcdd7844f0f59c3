"""The `@triton.jit` bodies of `rank_rows.py` (private: launched only by its launchers, which hold the
overview, the checks and the block sizes).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _details as d
from . import _launch as launch
from ._combine_kernels import _f32_to_bf16_rtne

_NO_SLOT: tl.constexpr = tl.constexpr(1 << 30)  # sorts after every real slot (< T*K < 2**30)
UNROLL_K: tl.constexpr = tl.constexpr(16)  # the reduce by source unrolls its top-k loop up to this K


# ================================================================================================
# Helpers: the walk over received per-rank rows
# ================================================================================================
@triton.jit
def _rank_row_sources(rank_rows_ptr, stride_rank_rows_w, rank, W: tl.constexpr, W_PAD: tl.constexpr, P: tl.constexpr,
                      RELAY: tl.constexpr = False, NODE_SIZE: tl.constexpr = 1):
    """Per source s, [W_PAD] int64: (n[s] rows s sends rank col[s], off[s] where they start in s's rank-major
    send order = sum_{r < col[s]} rows s sends r, dense[s] = sum_{s' < s} n[s'], before[s] = rows of the
    remainder region before s's run in col[s]'s recv buffer, col[s]). col[s] is this rank, or with RELAY for a
    source on another node its relay on this node (whose recv buffer holds its rows); the remainder then counts
    only remote sources (relay geometry, `plan.relay_remainder_offsets`). An aborting source's row of -1
    counts as 0."""
    s = tl.arange(0, W_PAD)[:, None]
    r = tl.arange(0, W_PAD)[None, :]
    rows = tl.load(rank_rows_ptr + s.to(tl.int64) * stride_rank_rows_w + r, mask=(s < W) & (r < W), other=0)
    rows = tl.maximum(rows, 0).to(tl.int64)
    col = tl.zeros([W_PAD, 1], dtype=tl.int64) + rank
    rest = tl.maximum(rows - P, 0)
    if RELAY:
        remote = (s // NODE_SIZE) != rank // NODE_SIZE
        col = tl.where(remote, (rank // NODE_SIZE) * NODE_SIZE + s % NODE_SIZE, col)
        rest = tl.where(remote, rest, 0)
    n = tl.sum(tl.where(r == col, rows, 0), axis=1)
    off = tl.sum(tl.where(r < col, rows, 0), axis=1)
    before = tl.sum(tl.where(r == col, tl.cumsum(rest, axis=0) - rest, 0), axis=1)
    return n, off, tl.cumsum(n, axis=0) - n, before, tl.reshape(col, (W_PAD,))


@triton.jit
def _rank_row_tile(tile, num_rows, n, dense, W_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """For the BLOCK_R received rows q of a tile (numbered source-major): (is_row, source, index j of the
    row among its source's rows for this rank)."""
    q = tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    is_row = q < num_rows
    sel = (q[:, None] >= dense[None, :]) & (q[:, None] < dense[None, :] + n[None, :])
    src = tl.sum(tl.where(sel, tl.arange(0, W_PAD)[None, :], 0), axis=1)
    j = q - tl.sum(tl.where(sel, dense[None, :], 0), axis=1)
    return is_row, src, j


@triton.jit
def _rank_row_places(peer_send_bytes_ptr, recv_bytes, n, off, before, W: tl.constexpr, W_PAD: tl.constexpr,
                     P: tl.constexpr, HEADER_ROWS: tl.constexpr, PRIVATE_OFFSET_BYTES: tl.constexpr,
                     SD_BYTES: tl.constexpr, peer_recv_bytes_ptr, col, RELAY: tl.constexpr = False):
    """Where source s's rows for this rank are, [W_PAD] int64 each: row j at first[s] + j*Sd for j < split[s],
    else at rest[s] + j*Sd. A node peer's are in its send buffer (from its rank-major offset off[s]); a remote
    one's in this rank's recv buffer, its private slot then its remainder run (`unpack_tokens_by_expert`'s
    geometry, with rows per (token, rank) in place of routes), or with RELAY in the recv buffer of its relay
    col[s] (`peer_recv_bytes_ptr`, the node peers' recv buffers)."""
    s_idx = tl.arange(0, W_PAD)
    peer = tl.load(peer_send_bytes_ptr + s_idx, mask=s_idx < W, other=-1)
    pull = peer >= 0
    recv = recv_bytes + tl.zeros([W_PAD], dtype=tl.int64)
    if RELAY:
        recv = tl.load(peer_recv_bytes_ptr + col, mask=(s_idx < W) & ~pull, other=0)
    first = tl.where(pull, peer + off * SD_BYTES,
                     recv + PRIVATE_OFFSET_BYTES + (s_idx.to(tl.int64) * (HEADER_ROWS + P) + HEADER_ROWS) * SD_BYTES)
    return first, recv + (W * (HEADER_ROWS + P) + before - P) * SD_BYTES, tl.where(pull, 1 << 62, P)


@triton.jit
def _tile_rows(tile, num_rows, n, dense, first, rest, split, W_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
               SD_BYTES: tl.constexpr):
    """The rows of a tile of the walk (`_rank_row_tile`) and where each is (`_row_bytes`): (is_row, source, j,
    byte offset from base)."""
    is_row, src, j = _rank_row_tile(tile, num_rows, n, dense, W_PAD, BLOCK_R)
    return is_row, src, j, _row_bytes(src, j, first, rest, split, W_PAD, SD_BYTES)


@triton.jit
def _tile_meta(tile, num_rows, n, dense, first, rest, split, W_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
               SD_BYTES: tl.constexpr, META_OFFSET_BYTES: tl.constexpr):
    """As `_tile_rows`, with the int32 word of each row's metadata (the reduces read no payload)."""
    is_row, src, j, at = _tile_rows(tile, num_rows, n, dense, first, rest, split, W_PAD, BLOCK_R, SD_BYTES)
    return is_row, src, j, (at + META_OFFSET_BYTES) // 4


@triton.jit
def _row_bytes(src, j, first, rest, split, W_PAD: tl.constexpr, SD_BYTES: tl.constexpr):
    """[BLOCK_R] int64: where row j of source src is (`_rank_row_places`)."""
    at = tl.where(j < _pick(split, src, W_PAD), _pick(first, src, W_PAD), _pick(rest, src, W_PAD))
    return at + j * SD_BYTES


@triton.jit
def _pick(table, src, W_PAD: tl.constexpr):
    """table[src] for a [BLOCK_R] vector of sources (a one-hot sum over the W_PAD entries)."""
    return tl.sum(tl.where(src[:, None] == tl.arange(0, W_PAD)[None, :], table[None, :], 0), axis=1)


@triton.jit
def _relay_partial_bases(n, remote):
    """[W_PAD] int64: partial-region row of each remote source's row 0 (`plan.relay_partial_bases`): the
    rows of the remote sources before it (n[s'] = rows s' sent its relay on this node), dense."""
    into_node = tl.where(remote > 0, n, 0)
    return tl.cumsum(into_node, axis=0) - into_node


@triton.jit
def _store_combine_rows(base_ptr, dst_b, h0, acc, row_ok, Y_TY: tl.constexpr, H: tl.constexpr, ITEM_BYTES: tl.constexpr,
                        ALIGN_BYTES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
                        Q_BLOCK: tl.constexpr, SCALE_OFFSET_BYTES: tl.constexpr, FP8_VIA_BITS: tl.constexpr):
    """Columns [h0, h0 + BLOCK_H) of the fp32 rows `acc` rounded once into combine rows at byte `dst_b` [BLOCK_R]
    (rows where `row_ok`): fp8 e4m3 blocks of Q_BLOCK with their fp32 scales (BLOCK_H is whole blocks), bf16
    to nearest even, or a cast to Y_TY."""
    # (without the hint every element is stored alone: 2-byte, or 1-byte fp8, stores)
    dst_b = tl.multiple_of(dst_b, ALIGN_BYTES)
    cols = h0 + tl.arange(0, BLOCK_H)
    mask = row_ok[:, None] & (cols < H)[None, :]
    if FP8:
        G: tl.constexpr = BLOCK_H // Q_BLOCK
        q, scale = d.fp8_block_quantize(tl.reshape(acc, (BLOCK_R * G, Q_BLOCK)), False, True)
        d.fp8_e4m3_store(base_ptr, dst_b[:, None] + cols[None, :], tl.reshape(q, (BLOCK_R, BLOCK_H)), mask,
                         FP8_VIA_BITS)
        group = h0 // Q_BLOCK + tl.arange(0, G)
        tl.store(base_ptr.to(tl.pointer_type(tl.float32)) + ((dst_b + SCALE_OFFSET_BYTES) // 4)[:, None] + group[None, :],
                 tl.reshape(scale, (BLOCK_R, G)), mask=row_ok[:, None] & (group < (H + Q_BLOCK - 1) // Q_BLOCK)[None, :])
    else:
        base_y = base_ptr.to(tl.pointer_type(Y_TY))
        dst = tl.multiple_of(dst_b // ITEM_BYTES, ALIGN_BYTES // ITEM_BYTES if ALIGN_BYTES > ITEM_BYTES else 1)
        if Y_TY == tl.bfloat16:
            tl.store(base_y + dst[:, None] + cols[None, :], _f32_to_bf16_rtne(acc), mask=mask)
        else:
            tl.store(base_y + dst[:, None] + cols[None, :], acc.to(Y_TY), mask=mask)


@triton.jit
def _add_weighted_route(acc, rows, w, kk, k, expert_y_ptr, stride_y_r, cols, mask):
    """acc + w_k * y[row of route k] for the tile's rows whose route k is here (k order, one product and one add,
    each rounded to fp32: the reference's sum)."""
    y_row = d.column_of(rows, kk, k)
    wk = tl.sum(tl.where(kk[None, :] == k, w, 0.0), axis=1)
    y = tl.load(expert_y_ptr + y_row[:, None] * stride_y_r + cols[None, :], mask=mask & (y_row >= 0)[:, None],
                other=0.0)
    return tl.where((y_row >= 0)[:, None], acc + wk[:, None] * y.to(tl.float32), acc)


@triton.jit
def _store_row_plan(row_plan_ptr, tile, is_row, kk, rows, K: tl.constexpr, BLOCK_R: tl.constexpr):
    """The expand's output rows of a tile's received rows (dense row q = tile * BLOCK_R + i), [q, K] int32."""
    q = tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    tl.store(row_plan_ptr + q[:, None] * K + kk[None, :], rows.to(tl.int32), mask=is_row[:, None] & (kk[None, :] < K))


@triton.jit
def _load_row_plan(row_plan_ptr, tile, is_row, kk, K: tl.constexpr, BLOCK_R: tl.constexpr):
    """[BLOCK_R, K_PAD] int64: the output rows the expand wrote for the tile's rows (-1 where none)."""
    q = tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    return tl.load(row_plan_ptr + q[:, None] * K + kk[None, :], mask=is_row[:, None] & (kk[None, :] < K),
                   other=-1).to(tl.int64)


@triton.jit
def _route_ids(base_i32, meta_words, is_row, kk, K: tl.constexpr):
    """[BLOCK_R, K_PAD] int64: the K expert ids of each row's metadata (-1 outside the rows and k < K)."""
    km = is_row[:, None] & (kk[None, :] < K)
    return tl.load(base_i32 + meta_words[:, None] + kk[None, :], mask=km, other=-1).to(tl.int64)


@triton.jit
def _node_holder(ids, L: tl.constexpr, NODE_SIZE: tl.constexpr):
    """Per node-local expert id of a relayed row (in [0, NODE_SIZE * L)): the index on the node of the rank
    holding it, -1 for -1 and anything out of range."""
    return tl.where((ids >= 0) & (ids < NODE_SIZE * L), ids // L, -1)


@triton.jit
def _expert_rows(base_i32, meta_words, is_row, src, kk, out_start, fit, K: tl.constexpr, L: tl.constexpr,
                 W_PAD: tl.constexpr, BLOCK_R: tl.constexpr, K_PAD: tl.constexpr, relayed, local_index,
                 RELAY: tl.constexpr = False, NODE_SIZE: tl.constexpr = 1):
    """[BLOCK_R, K_PAD] int64: the expert-major output row of each (received row, k) from the row's metadata
    (local expert l, position pos among the source's routes to it): out_start[l, s] + pos; -1 where route k
    is not for this rank, or past the pair's rows that fit (its count, or the expert capacity). A metadata
    value out of range is dropped, never written through. With RELAY, the rows with `relayed` [BLOCK_R] set
    carry node-local ids: route k is this rank's when its id // L is this rank's `local_index` on the node."""
    km = is_row[:, None] & (kk[None, :] < K)
    lk = _route_ids(base_i32, meta_words, is_row, kk, K)
    if RELAY:
        holder = _node_holder(lk, L, NODE_SIZE)
        lk = tl.where(relayed[:, None], tl.where(holder == local_index, lk - holder * L, -1), lk)
    pk = tl.load(base_i32 + meta_words[:, None] + K + kk[None, :], mask=km, other=0).to(tl.int64)
    valid = km & (lk >= 0) & (lk < L)
    pair = tl.reshape(tl.where(valid, lk * W_PAD + src[:, None], 0), (BLOCK_R * K_PAD,))
    start = tl.reshape(tl.gather(out_start, pair, 0), (BLOCK_R, K_PAD))
    room = tl.reshape(tl.gather(fit, pair, 0), (BLOCK_R, K_PAD))
    valid = valid & (pk >= 0) & (pk < room)
    return tl.where(valid, start + pk, -1)


# ================================================================================================
# Dispatch recv: expand each received row into its experts' rows
# ================================================================================================
@triton.jit(do_not_specialize=["num_out_rows"], repr=launch.compiled_as(launch.DISPATCH_SYMBOL))
def _expand_rank_rows_kernel(
    out_num_tokens_ptr,  # (L,) int32: rows per local expert
    out_x_ptr,           # (R, X_WORDS) words, row stride `stride_out_x_r`
    out_scale_ptr,       # (R, S) int32 (fp32 bits), strides (stride_out_scale_r, stride_out_scale_s)
    counts_ptr,          # (W, E) int32, row stride stride_counts_w: per-expert route counts
    rank_rows_ptr,       # (W, W) int32, row stride stride_rank_rows_w: rows per destination rank
    base_ptr,            # uint8: byte address space of the node peers' send buffers
    peer_send_bytes_ptr,  # (W,) int64: peer s's send buffer - base (same node), -1 = remote source
    recv_bytes,          # this rank's recv buffer - base (remote sources' rows: private slots, remainder runs)
    rank, num_out_rows,
    stride_counts_w, stride_rank_rows_w, stride_out_x_r, stride_out_scale_r, stride_out_scale_s,
    W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr, K: tl.constexpr,
    K_PAD: tl.constexpr, PAD: tl.constexpr, X_WORDS: tl.constexpr, S: tl.constexpr,
    P: tl.constexpr, HEADER_ROWS: tl.constexpr, PRIVATE_OFFSET_BYTES: tl.constexpr,
    SCALE_OFFSET_BYTES: tl.constexpr, META_OFFSET_BYTES: tl.constexpr, SD_BYTES: tl.constexpr,
    WORD_BYTES: tl.constexpr, ALIGN_WORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_SCALES: tl.constexpr, CAPACITY: tl.constexpr, CAPACITY_WORD: tl.constexpr, ABORT_WORD: tl.constexpr,
    # Same-node synchronisation (node_sync.py, NodeSync.kernel_args("dispatch_recv")), only with NODE_SYNC:
    failed_ptr=None, epoch_ptr=None, flags_ptr=None, peer_sync_bytes_ptr=None, sync_bytes=0, node_first=0,
    timeout_ns=0, max_spins=0,
    READY_BYTES: tl.constexpr = 0, NODE: tl.constexpr = 1, NODE_PAD: tl.constexpr = 1,
    NODE_SYNC: tl.constexpr = False, HAS_PROXY: tl.constexpr = False, USE_PTX: tl.constexpr = False,
    STATUS_WORD: tl.constexpr = 0, PROXY_WAIT_WORD: tl.constexpr = 0, PROXY_DELTA: tl.constexpr = 0,
    ERROR_WORD: tl.constexpr = 0, KERNEL_WAIT: tl.constexpr = True,
    aborted_ptr=None, CALL_ABORTED_WORD: tl.constexpr = 0, ABORT_AT_COMBINE: tl.constexpr = False,
    out_ranges_ptr=None, HAS_RANGES: tl.constexpr = False,
    # The relay: a remote source's rows are in its relay's recv buffer (a node peer's: peer_recv_bytes_ptr)
    peer_recv_bytes_ptr=None, RELAY: tl.constexpr = False, NODE_SIZE: tl.constexpr = 1,
    # With Q_WORDS > 0 a fused quantisation's scale words (Q_WORDS from word Q_SCALE_WORD of the payload) also go
    # to out_qscale_ptr, (R, Q_WORDS) or with CAPACITY (L, CAPACITY, Q_WORDS) 4-byte words of any strides (as unpack)
    out_qscale_ptr=None, stride_out_qscale_r=0, stride_out_qscale_s=0, stride_out_qscale_e=0,
    Q_SCALE_WORD: tl.constexpr = 0, Q_WORDS: tl.constexpr = 0,
    # With HAS_PLAN each received row's K output rows (-1: none) also to row_plan_ptr, [rows, K] int32, for the
    # combine's reduce by source (which then builds no pair tables of its own)
    row_plan_ptr=None, HAS_PLAN: tl.constexpr = False,
):
    """Compiled as `moe_a2a::dispatch()`. Grid: (G,) persistent programs over tiles of BLOCK_R received rows
    (numbered source-major). Each row is read once and written to the output row of every k its metadata
    names (`_expert_rows`): the expert-major output of `unpack_tokens_by_expert`, same rows, same order. With
    RELAY a remote source's rows are all the rows it sent its relay on this node (node-local ids); the payload
    of a row none of whose routes is this rank's is not read."""
    pid = tl.program_id(0)
    ok = d.consumer_prologue(base_ptr, sync_bytes + READY_BYTES, epoch_ptr, failed_ptr, flags_ptr, node_first, timeout_ns,
                             max_spins, NODE, NODE_PAD, HAS_PROXY, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD,
                             STATUS_WORD, USE_PTX, KERNEL_WAIT, NODE_SYNC)
    cnt, _, out_start, _, _, tot, _, fit, aborted = d.recv_pair_tables(
        counts_ptr, stride_counts_w, rank, PAD, W, L, W_PAD, L_PAD, CAPACITY)
    d.report_received(out_num_tokens_ptr, out_ranges_ptr, flags_ptr, epoch_ptr, aborted_ptr, cnt, tot, aborted,
                      (pid == 0) & ok, W, L, W_PAD, L_PAD, HAS_RANGES, NODE_SYNC, CAPACITY, ABORT_WORD, CAPACITY_WORD,
                      CALL_ABORTED_WORD, ABORT_AT_COMBINE)
    NPAIR: tl.constexpr = L_PAD * W_PAD
    out_start = tl.reshape(out_start, (NPAIR,))
    fit = tl.reshape(fit, (NPAIR,))
    n, off, dense, before, col = _rank_row_sources(rank_rows_ptr, stride_rank_rows_w, rank, W, W_PAD, P, RELAY,
                                                   NODE_SIZE)
    first, rest, split = _rank_row_places(peer_send_bytes_ptr, recv_bytes, n, off, before, W, W_PAD, P, HEADER_ROWS,
                                          PRIVATE_OFFSET_BYTES, SD_BYTES, peer_recv_bytes_ptr, col, RELAY)
    remote = ((tl.arange(0, W_PAD) // NODE_SIZE) != rank // NODE_SIZE).to(tl.int32)
    num_rows = tl.where(ok, tl.sum(n, axis=0), 0)

    word_ty: tl.constexpr = out_x_ptr.dtype.element_ty
    base_words = base_ptr.to(tl.pointer_type(word_ty))
    base_i32 = base_ptr.to(tl.pointer_type(tl.int32))
    kk = tl.arange(0, K_PAD)
    for tile in range(pid, tl.cdiv(num_rows, BLOCK_R).to(tl.int32), tl.num_programs(0)):
        is_row, src, j, src_bytes = _tile_rows(tile, num_rows, n, dense, first, rest, split, W_PAD, BLOCK_R, SD_BYTES)
        rows = _expert_rows(base_i32, (src_bytes + META_OFFSET_BYTES) // 4, is_row, src, kk, out_start, fit, K, L,
                            W_PAD, BLOCK_R, K_PAD, _pick(remote, src, W_PAD) > 0, rank % NODE_SIZE, RELAY, NODE_SIZE)
        rows = tl.where(rows < num_out_rows, rows, -1)
        if HAS_PLAN:
            _store_row_plan(row_plan_ptr, tile, is_row, kk, rows, K, BLOCK_R)
        src_words = tl.multiple_of(src_bytes // WORD_BYTES, ALIGN_WORDS)
        needed = is_row
        if RELAY:  # a relayed row for node peers only: its payload stays where it is
            needed = is_row & (tl.max(rows, axis=1) >= 0)
        for c0 in range(0, X_WORDS, BLOCK_W):  # each chunk read once, written to every expert row of the row
            cols = c0 + tl.arange(0, BLOCK_W)
            mask = needed[:, None] & (cols < X_WORDS)[None, :]
            v = tl.load(base_words + src_words[:, None] + cols[None, :], mask=mask)
            for k in range(K):
                out_row = d.column_of(rows, kk, k)
                tl.store(out_x_ptr + out_row[:, None] * stride_out_x_r + cols[None, :], v,
                         mask=mask & (out_row >= 0)[:, None])
        if HAS_SCALES:  # chunks of BLOCK_W columns, as the payload (copy_row_columns says why)
            for c0 in range(0, S, BLOCK_W):
                cols = c0 + tl.arange(0, BLOCK_W)
                mask = needed[:, None] & (cols < S)[None, :]
                v = tl.load(base_i32 + ((src_bytes + SCALE_OFFSET_BYTES) // 4)[:, None] + cols[None, :], mask=mask)
                for k in range(K):
                    out_row = d.column_of(rows, kk, k)
                    tl.store(out_scale_ptr + out_row[:, None] * stride_out_scale_r + cols[None, :] * stride_out_scale_s,
                             v, mask=mask & (out_row >= 0)[:, None])
        if Q_WORDS > 0:  # the quantisation's scale words into a tensor of their own, at each expert row of the row
            for k in range(K):
                out_row = d.column_of(rows, kk, k)
                d.copy_row_columns(base_i32, src_bytes // 4 + Q_SCALE_WORD, out_qscale_ptr,
                                   d.expert_row_words(out_row, stride_out_qscale_e, stride_out_qscale_r, CAPACITY),
                                   stride_out_qscale_s, needed & (out_row >= 0), Q_WORDS, BLOCK_W)


# ================================================================================================
# Combine send: reduce each received row's expert outputs, send one row back
# ================================================================================================
@triton.jit(do_not_specialize=["num_y_rows"], repr=launch.compiled_as(launch.COMBINE_SYMBOL))
def _reduce_rank_rows_by_source_kernel(
    expert_y_ptr,        # (R, H) out_dtype, row stride stride_y_r: expert outputs, dispatch output rows
    counts_ptr,          # (W, E) int32
    rank_rows_ptr,       # (W, W) int32
    base_ptr,            # uint8: byte address space of the node peers' send and recv buffers
    peer_send_bytes_ptr,  # (W,) int64: peer s's send buffer - base (the rows' metadata and weights), -1 = remote
    peer_recv_bytes_ptr,  # (W,) int64: peer s's recv buffer - base (where its reduced rows land), -1 = remote
    recv_bytes,          # this rank's recv buffer - base: remote sources' rows (their metadata) are there
    stage_bytes,         # this rank's combine staging area - base: rows for remote homes, source-major
    rank, num_y_rows,
    stride_counts_w, stride_rank_rows_w, stride_y_r,
    W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr, K: tl.constexpr,
    K_PAD: tl.constexpr, PAD: tl.constexpr, H: tl.constexpr, META_OFFSET_BYTES: tl.constexpr,
    P: tl.constexpr, HEADER_ROWS: tl.constexpr, PRIVATE_OFFSET_BYTES: tl.constexpr,
    SD_BYTES: tl.constexpr, SC_BYTES: tl.constexpr, COMBINE_RECV_BYTES: tl.constexpr, ITEM_BYTES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, CAPACITY: tl.constexpr,
    ALIGN_BYTES: tl.constexpr = 1,  # every destination row starts at a multiple of it (16: vector stores)
    H_CHUNKS: tl.constexpr = 1,  # BLOCK_H chunks of the hidden dimension a program walks (`reduce_launch_shape`)
    FP8: tl.constexpr = False,  # A2AConfig.combine_fp8: rows as fp8 e4m3 + fp32 scales per Q_BLOCK
    Q_BLOCK: tl.constexpr = 128, SCALE_OFFSET_BYTES: tl.constexpr = 0, FP8_VIA_BITS: tl.constexpr = False,
    # Same-node synchronisation (NodeSync.kernel_args("combine_send")), only with NODE_SYNC:
    failed_ptr=None, counter_ptr=None, epoch_ptr=None, flags_ptr=None, peer_sync_bytes_ptr=None,
    sync_bytes=0, node_first=0, timeout_ns=0, max_spins=0,
    READY_BYTES: tl.constexpr = 0, NODE: tl.constexpr = 1, NODE_SYNC: tl.constexpr = False,
    HAS_PROXY: tl.constexpr = False, USE_PTX: tl.constexpr = False, STATUS_WORD: tl.constexpr = 0,
    PROXY_WAIT_WORD: tl.constexpr = 0, PROXY_DELTA: tl.constexpr = 0, ERROR_WORD: tl.constexpr = 0,
    PROXY_SIGNAL_WORD: tl.constexpr = 0, KERNEL_WAIT: tl.constexpr = True,
    aborted_ptr=None, ABORT_BYTES: tl.constexpr = 0,
    # The relay: remote sources' rows walked as the expand's RELAY, their partials kept fp32 at partial_bytes
    partial_bytes=0, RELAY: tl.constexpr = False, NODE_SIZE: tl.constexpr = 1, PARTIAL_STRIDE_BYTES: tl.constexpr = 0,
    relay_recv_bytes_ptr=None,  # (W,) int64: where node peers receive other nodes' rows (the relayed rows)
    # FROM_PLAN: each row's K expert rows as this call's expand wrote them (row_plan_ptr), no pair tables
    row_plan_ptr=None, FROM_PLAN: tl.constexpr = False,
):
    """Compiled as `moe_a2a::combine()`. Grid: (G, cdiv(H, BLOCK_H * H_CHUNKS)): G persistent programs over tiles
    of BLOCK_R received rows (as the expand) for each H_CHUNKS BLOCK_H-element chunks of the hidden dimension. Row j of
    source s: partial = sum_k w_k * y[row_k] over the k whose expert is here, in fp32
    in k order, rounded once to out_dtype and stored in s's recv buffer at the slot of its dispatch row
    (combine region + (off[s] + j) * Sc). With RELAY, row j of a remote source s (in its relay's recv buffer)
    with a route here: the partial unrounded, at row base[s] + j of this rank's partial region
    (`plan.relay_partial_bases`), for the relay's `_reduce_relayed_rows_kernel`. With NODE_SYNC the last
    program tells every node peer (as the route-row combine pack does)."""
    pid = tl.program_id(0)
    if not FROM_PLAN:  # the pair tables in every program (1848 at decode: most of its set-up, docs/perf-notes.md)
        _, _, out_start, _, _, _, _, fit, _ = d.recv_pair_tables(
            counts_ptr, stride_counts_w, rank, PAD, W, L, W_PAD, L_PAD, CAPACITY)
        NPAIR: tl.constexpr = L_PAD * W_PAD
        out_start = tl.reshape(out_start, (NPAIR,))
        fit = tl.reshape(fit, (NPAIR,))
    n, off, dense, before, col = _rank_row_sources(rank_rows_ptr, stride_rank_rows_w, rank, W, W_PAD, P, RELAY,
                                                   NODE_SIZE)
    num_rows = tl.sum(n, axis=0)
    if NODE_SYNC:
        num_rows = tl.where(tl.load(failed_ptr, volatile=True) == 0, num_rows, 0)
    first, rest, split = _rank_row_places(peer_send_bytes_ptr, recv_bytes, n, off, before, W, W_PAD, P, HEADER_ROWS,
                                          PRIVATE_OFFSET_BYTES, SD_BYTES, relay_recv_bytes_ptr, col, RELAY)
    s_idx = tl.arange(0, W_PAD)
    remote = ((s_idx // NODE_SIZE) != rank // NODE_SIZE).to(tl.int32)
    pbase = _relay_partial_bases(n, remote)
    home = tl.load(peer_recv_bytes_ptr + s_idx, mask=s_idx < W, other=-1)
    # A node home's reduced rows go to its combine region at its rows' slots; a remote home's are staged
    # source-major for the proxy's combine write (`plan.combine_stage_offsets`, rows per (token, rank)).
    back = tl.where(home >= 0, home + COMBINE_RECV_BYTES + off * SC_BYTES, stage_bytes + dense * SC_BYTES)
    if HAS_PROXY:  # the proxy's combine writes of the previous call are out of the staging area
        num_rows = tl.where(d.node_wait(base_ptr, 0, epoch_ptr, failed_ptr, flags_ptr, 0, timeout_ns, max_spins, 0,
                                        1, True, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD, STATUS_WORD, USE_PTX,
                                        KERNEL_WAIT), num_rows, 0)

    y_ty: tl.constexpr = expert_y_ptr.dtype.element_ty
    base_i32 = base_ptr.to(tl.pointer_type(tl.int32))
    base_f32 = base_ptr.to(tl.pointer_type(tl.float32))
    kk = tl.arange(0, K_PAD)
    for tile in range(pid, tl.cdiv(num_rows, BLOCK_R).to(tl.int32), tl.num_programs(0)):
        is_row, src, j, meta = _tile_meta(tile, num_rows, n, dense, first, rest, split, W_PAD, BLOCK_R, SD_BYTES,
                                          META_OFFSET_BYTES)
        relayed = _pick(remote, src, W_PAD) > 0
        if FROM_PLAN:
            rows = _load_row_plan(row_plan_ptr, tile, is_row, kk, K, BLOCK_R)
        else:
            rows = _expert_rows(base_i32, meta, is_row, src, kk, out_start, fit, K, L, W_PAD, BLOCK_R, K_PAD, relayed,
                                rank % NODE_SIZE, RELAY, NODE_SIZE)
        rows = tl.where(rows < num_y_rows, rows, -1)
        w = tl.load(base_f32 + meta[:, None] + 2 * K + kk[None, :], mask=is_row[:, None] & (kk[None, :] < K),
                    other=0.0)
        rounded = is_row
        if RELAY:  # a remote source's row with a route here: the fp32 partial, for its relay on this node
            holder = _node_holder(_route_ids(base_i32, meta, is_row, kk, K), L, NODE_SIZE)
            has = tl.max(tl.where(holder == rank % NODE_SIZE, 1, 0), axis=1) > 0
            at = (partial_bytes + (_pick(pbase, src, W_PAD) + j) * PARTIAL_STRIDE_BYTES) // 4
            rounded = is_row & ~relayed
        # H_CHUNKS chunks of the hidden dimension a program (grid axis 1 has the rest): the tile's rows, weights
        # and tables found once for all of them; few chunks, many programs: more loads in flight
        for c in range(H_CHUNKS):
            h0 = (tl.program_id(1) * H_CHUNKS + c) * BLOCK_H
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = is_row[:, None] & (cols < H)[None, :]
            acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
            if K <= UNROLL_K:  # unrolled: the K loads in flight together (72 -> 41 µs at decode on the H200)
                for k in tl.static_range(K):
                    acc = _add_weighted_route(acc, rows, w, kk, k, expert_y_ptr, stride_y_r, cols, mask)
            else:  # a long top-k: a loop, not K copies of the body
                for k in range(K):
                    acc = _add_weighted_route(acc, rows, w, kk, k, expert_y_ptr, stride_y_r, cols, mask)
            if RELAY:
                tl.store(base_f32 + at[:, None] + cols[None, :], acc,
                         mask=(relayed & has)[:, None] & (cols < H)[None, :])
            _store_combine_rows(base_ptr, _pick(back, src, W_PAD) + j * SC_BYTES, h0, acc, rounded, y_ty, H,
                                ITEM_BYTES, ALIGN_BYTES, BLOCK_R, BLOCK_H, FP8, Q_BLOCK, SCALE_OFFSET_BYTES,
                                FP8_VIA_BITS)
    if NODE_SYNC:
        d.combine_send_epilogue(base_ptr, counter_ptr, failed_ptr, peer_sync_bytes_ptr, aborted_ptr, epoch_ptr, flags_ptr,
                                rank, node_first, READY_BYTES, ABORT_BYTES, NODE, HAS_PROXY, PROXY_SIGNAL_WORD, USE_PTX)


# ================================================================================================
# Combine recv: sum each token's rows over ranks
# ================================================================================================
@triton.jit(do_not_specialize=["num_tokens"], repr=launch.compiled_as(launch.COMBINE_SYMBOL))
def _reduce_rank_rows_by_token_kernel(
    out_tokens_ptr,      # out: (T, H) out_dtype, row stride stride_out_t (also in when ACCUMULATE)
    rank_slot_ptr,       # (T, K) int32, contiguous: the row each route opened (-1: none)
    base_ptr,            # uint8: byte address space of the recv buffer
    bound_m_ptr,         # (1,) int32 live tokens; read only when HAS_BOUND_M
    recv_bytes,          # this rank's combine region - base
    num_tokens, stride_out_t,
    K: tl.constexpr, K_PAD: tl.constexpr, MAX_SLOTS: tl.constexpr, H: tl.constexpr, SC_BYTES: tl.constexpr,
    ITEM_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BOUND_M: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    FP8: tl.constexpr = False, Q_BLOCK: tl.constexpr = 128, SCALE_OFFSET_BYTES: tl.constexpr = 0,
    FP8_VIA_BITS: tl.constexpr = False,  # A2AConfig.combine_fp8: dequantise the rows
    # Only remote rows staged (SPLIT): rows outside [node_slots[0], node_slots[1]) are read at remote_recv_bytes.
    node_slots_ptr=None, remote_recv_bytes=0, SPLIT: tl.constexpr = False,
    # Same-node synchronisation (NodeSync.kernel_args("combine_recv")), only with NODE_SYNC:
    failed_ptr=None, epoch_ptr=None, flags_ptr=None, peer_sync_bytes_ptr=None, sync_bytes=0, node_first=0,
    timeout_ns=0, max_spins=0,
    READY_BYTES: tl.constexpr = 0, NODE: tl.constexpr = 1, NODE_PAD: tl.constexpr = 1,
    NODE_SYNC: tl.constexpr = False, HAS_PROXY: tl.constexpr = False, USE_PTX: tl.constexpr = False,
    STATUS_WORD: tl.constexpr = 0, PROXY_WAIT_WORD: tl.constexpr = 0, PROXY_DELTA: tl.constexpr = 0,
    ERROR_WORD: tl.constexpr = 0, KERNEL_WAIT: tl.constexpr = True,
    rank=0, ABORT_BYTES: tl.constexpr = 0, ABORTED_WORD: tl.constexpr = 0,
):
    """Compiled as `moe_a2a::combine()`. Grid: (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H)). out[t] = (old out[t] +)
    the sum of the token's rows, one per rank it was sent to, in ascending rank (rows are rank-major, so in
    ascending slot: a sort of the token's K slots), in fp32, cast once."""
    if NODE_SYNC:
        ok = d.node_wait(base_ptr, sync_bytes + READY_BYTES, epoch_ptr, failed_ptr, flags_ptr, node_first,
                         timeout_ns, max_spins, NODE, NODE_PAD, HAS_PROXY, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD,
                         STATUS_WORD, USE_PTX, KERNEL_WAIT)
        num_tokens = tl.where(ok, num_tokens, 0)
        if ABORT_BYTES > 0:
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & ok:
                d.node_check_aborted(base_ptr, sync_bytes, ABORT_BYTES, epoch_ptr, flags_ptr, ABORTED_WORD, rank,
                                     node_first, NODE, NODE_PAD)
    tokens, is_live = d.live_token_block(num_tokens, bound_m_ptr, BLOCK_T, HAS_BOUND_M)
    kk = tl.arange(0, K_PAD)
    slot = tl.load(rank_slot_ptr + tokens[:, None] * K + kk[None, :], mask=is_live[:, None] & (kk[None, :] < K),
                   other=-1)
    slot = tl.sort(tl.where((slot >= 0) & (slot < MAX_SLOTS), slot, _NO_SLOT), dim=1)
    y_ty: tl.constexpr = out_tokens_ptr.dtype.element_ty
    base_y = base_ptr.to(tl.pointer_type(y_ty))
    cols, mask, out_ptrs, acc = d.token_sum_start(out_tokens_ptr, tokens, is_live, stride_out_t, tl.program_id(1), H,
                                                  BLOCK_T, BLOCK_H, ACCUMULATE)
    for i in range(K):
        s = tl.min(tl.where(kk[None, :] == i, slot, _NO_SLOT), axis=1).to(tl.int64)
        has = s < _NO_SLOT
        at = d.combine_row_bytes(s, recv_bytes, remote_recv_bytes, node_slots_ptr, SC_BYTES, SPLIT)
        if FP8:
            y = d.fp8_load_dequantized(base_ptr, at, tl.program_id(1) * BLOCK_H, is_live & has, H, BLOCK_H,
                                       SCALE_OFFSET_BYTES, Q_BLOCK, FP8_VIA_BITS)
        else:
            row = at // ITEM_BYTES
            y = tl.load(base_y + row[:, None] + cols[None, :], mask=mask & has[:, None], other=0.0).to(tl.float32)
        acc = tl.where(has[:, None], acc + y, acc)
    if y_ty == tl.bfloat16:
        tl.store(out_ptrs, _f32_to_bf16_rtne(acc), mask=mask)
    else:
        tl.store(out_ptrs, acc.to(y_ty), mask=mask)
