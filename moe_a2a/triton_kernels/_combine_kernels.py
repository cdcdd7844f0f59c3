"""The `@triton.jit` bodies of `combine.py` (private: launched only by its launchers, which hold the
overview, the checks and the block sizes).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _details as d
from . import _launch as launch


@triton.jit
def _f32_to_bf16_rtne(x):
    """fp32 -> bf16, round to nearest even, with integer ops. Exactly what the GPU's `cvt.rn.bf16.f32`
    (and torch) do; written out because the interpreter's fp32 -> bf16 cast truncates, which would
    make CPU tests disagree with the reference by one ulp."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays a (quiet) NaN, never rounds to inf
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


# As in dispatch.py: counts not specialised, so an aborted call compiles nothing new.
@triton.jit(do_not_specialize=["num_y_rows"], repr=launch.compiled_as(launch.COMBINE_SYMBOL))
def _pack_combine_by_source_kernel(
    expert_y_ptr,        # in: (R, Y_WORDS) words, row stride `stride_y_r`: expert outputs, dispatch rows
                         #     (FP8: (R, H) out_dtype elements)
    counts_ptr,          # in: (W, E) int32: the routing matrix of this call's dispatch
    base_ptr,            # out: uint8, byte address space of the staging area and peers' recv buffers
    peer_recv_bytes_ptr,  # in: (W,) int64: home s's recv buffer - base (same node), -1 = remote home
    stage_bytes,         # int: staging area of this rank (send buffer + combine_stage_offset) - base
    rank,
    num_y_rows,          # R: rows of expert_y (a row past it is never read)
    # strides, in elements
    stride_counts_w, stride_y_r,
    # meta-parameters
    W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr,
    PAD: tl.constexpr,
    Y_WORDS: tl.constexpr,          # payload words per row (H * out_itemsize / WORD_BYTES)
    SC_BYTES: tl.constexpr,         # combine slot stride (multiple of 16)
    WORD_BYTES: tl.constexpr, ALIGN_WORDS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr,
    COMBINE_RECV_BYTES: tl.constexpr,   # where a home's recv buffer keeps combine rows
    CAPACITY: tl.constexpr,             # A2AConfig.expert_capacity (0: compact rows)
    # fp8 rows (A2AConfig.combine_fp8): expert_y_ptr is then out_dtype elements, Y_WORDS = H, WORD_BYTES = 1,
    # ALIGN_WORDS in bytes; each row is quantised into its slot (`_details.fp8_quantize_rows`), G groups of
    # Q_BLOCK elements per step, the scales at SCALE_OFFSET_BYTES.
    FP8: tl.constexpr = False, G: tl.constexpr = 1, Q_BLOCK: tl.constexpr = 128, SCALE_OFFSET_BYTES: tl.constexpr = 0,
    FP8_VIA_BITS: tl.constexpr = False,  # the interpreter: fp8 bytes by integer encoding
    # Same-node synchronisation and proxy flags (node_sync.py, NodeSync.kernel_args), only with NODE_SYNC:
    failed_ptr=None, counter_ptr=None, epoch_ptr=None, flags_ptr=None, peer_sync_bytes_ptr=None,
    sync_bytes=0, node_first=0, timeout_ns=0, max_spins=0,
    READY_BYTES: tl.constexpr = 0, NODE: tl.constexpr = 1, NODE_SYNC: tl.constexpr = False,
    HAS_PROXY: tl.constexpr = False, USE_PTX: tl.constexpr = False, STATUS_WORD: tl.constexpr = 0,
    PROXY_WAIT_WORD: tl.constexpr = 0, PROXY_DELTA: tl.constexpr = 0, ERROR_WORD: tl.constexpr = 0,
    PROXY_SIGNAL_WORD: tl.constexpr = 0, KERNEL_WAIT: tl.constexpr = True,
    aborted_ptr=None, ABORT_BYTES: tl.constexpr = 0,  # a call this rank aborts: told to the node (NODE_SYNC)
):
    """Compiled as `moe_a2a::combine()` (`_launch.compiled_as`, for profilers that look for it).

    Grid: (G,) persistent programs over tiles of BLOCK_R received rows (as in the unpack kernel).

    Row i of pair (local expert l, source s) has block index b = sum_{j<l} counts[s, rank*L+j] + i in
    source s's block and goes to
      same-node s: peer_recv[s] + COMBINE_RECV_BYTES + (send_offsets_s[rank] + b) * Sc   (the slot of its
                   dispatch send, in the combine region of its recv buffer)
      remote s:    stage + (psum_excl(n)[s] + b) * Sc               (plan.combine_stage_offsets)
    Moves y_bytes in and out per received row (FP8: reads y_bytes, writes H + 4 * ceil(H / Q_BLOCK)).
    With NODE_SYNC the last program to finish tells every
    same-node home that its rows of this epoch are in place (after a failed wait: nothing moves) and,
    with remote peers, raises COMBINE_SEND_READY for the proxy, after waiting (prologue) until the
    proxy's writes out of the staging area for the previous call completed."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cnt, dense_start, out_start, block_start, n_src, tot, num_rows, fit, _ = d.recv_pair_tables(
        counts_ptr, stride_counts_w, rank, PAD, W, L, W_PAD, L_PAD, CAPACITY)
    if NODE_SYNC:
        go = tl.load(failed_ptr, volatile=True) == 0
        if HAS_PROXY:
            go = d.node_wait(base_ptr, 0, epoch_ptr, failed_ptr, flags_ptr, 0, timeout_ns, max_spins, 0, 1, True,
                             PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD, STATUS_WORD, USE_PTX, KERNEL_WAIT)
        num_rows = tl.where(go, num_rows, 0)

    peer_recv, is_push, send_off = d.node_peer_tables(peer_recv_bytes_ptr, counts_ptr, stride_counts_w, rank,
                                                      W, L, W_PAD, BLOCK_E)
    stage_row = tl.cumsum(n_src, axis=0) - n_src
    first_bytes = tl.where(is_push[None, :],
                           peer_recv[None, :] + COMBINE_RECV_BYTES + (send_off[None, :] + block_start) * SC_BYTES,
                           stage_bytes + (stage_row[None, :] + block_start) * SC_BYTES)

    NPAIR: tl.constexpr = L_PAD * W_PAD
    cnt = tl.reshape(cnt, (NPAIR,))
    dense_start = tl.reshape(dense_start, (NPAIR,))
    out_start = tl.reshape(out_start, (NPAIR,))
    first_bytes = tl.reshape(first_bytes, (NPAIR,))
    fit = tl.reshape(fit, (NPAIR,))

    word_ty: tl.constexpr = expert_y_ptr.dtype.element_ty
    base_words = base_ptr.to(tl.pointer_type(word_ty))
    num_tiles = tl.cdiv(num_rows, BLOCK_R).to(tl.int32)
    for tile in range(pid, num_tiles, num_programs):
        is_row, y_row, dst_bytes = d.tile_rows(tile, num_rows, cnt, dense_start, out_start, first_bytes,
                                               first_bytes, cnt, SC_BYTES, BLOCK_R, False, fit, CAPACITY > 0)
        is_row = is_row & (y_row < num_y_rows)
        dst_words = tl.multiple_of(dst_bytes // WORD_BYTES, ALIGN_WORDS)
        src_words = y_row * stride_y_r
        if FP8:  # words are bytes
            d.fp8_quantize_rows(expert_y_ptr, src_words, base_ptr, dst_words, is_row, Y_WORDS, SCALE_OFFSET_BYTES,
                                BLOCK_R, G, Q_BLOCK, FP8_VIA_BITS, ALIGN_WORDS)
        else:
            d.copy_row_words(expert_y_ptr, src_words, base_words, dst_words, is_row, Y_WORDS, BLOCK_W)
    if NODE_SYNC:
        d.combine_send_epilogue(base_ptr, counter_ptr, failed_ptr, peer_sync_bytes_ptr, aborted_ptr, epoch_ptr, flags_ptr,
                                rank, node_first, READY_BYTES, ABORT_BYTES, NODE, HAS_PROXY, PROXY_SIGNAL_WORD, USE_PTX)


@triton.jit(do_not_specialize=["num_tokens"], repr=launch.compiled_as(launch.COMBINE_SYMBOL))
def _reduce_combined_tokens_kernel(
    out_tokens_ptr,      # out: (T, H) out_dtype, row stride `stride_out_t` (also in when ACCUMULATE)
    # inputs
    route_slot_ptr,      # (T, K) int32/int64, strides (stride_slot_t, stride_slot_k); -1 = no route
    weights_ptr,         # (T, K) float32, strides (stride_w_t, stride_w_k)
    base_ptr,            # uint8: byte address space of the recv buffer
    bound_m_ptr,         # (1,) int32 live tokens; read only when HAS_BOUND_M
    recv_bytes,          # int: this rank's recv buffer - base
    num_tokens,          # T
    # strides, in elements
    stride_out_t, stride_slot_t, stride_slot_k, stride_w_t, stride_w_k,
    # meta-parameters
    K: tl.constexpr,
    MAX_SLOTS: tl.constexpr,       # T*K slots in the recv buffer: a bad slot is skipped, never read
    H: tl.constexpr,               # constexpr: the tail mask of the last chunk is then provable
    SC_BYTES: tl.constexpr,
    ITEM_BYTES: tl.constexpr,      # out_dtype itemsize (FP8: 1, offsets in bytes)
    ALIGN_ELEMS: tl.constexpr,     # row starts are multiples of this many elements (16 B when proven)
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_BOUND_M: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    # fp8 rows (A2AConfig.combine_fp8): slots hold fp8 bytes and fp32 scales (at SCALE_OFFSET_BYTES), read
    # and dequantised by `_details.fp8_load_dequantized` before the weighted sum.
    FP8: tl.constexpr = False, Q_BLOCK: tl.constexpr = 128, SCALE_OFFSET_BYTES: tl.constexpr = 0,
    FP8_VIA_BITS: tl.constexpr = False,
    # Same-node synchronisation and proxy flags (node_sync.py, NodeSync.kernel_args), only with NODE_SYNC:
    failed_ptr=None, epoch_ptr=None, flags_ptr=None, peer_sync_bytes_ptr=None, sync_bytes=0, node_first=0,
    timeout_ns=0, max_spins=0,
    READY_BYTES: tl.constexpr = 0, NODE: tl.constexpr = 1, NODE_PAD: tl.constexpr = 1,
    NODE_SYNC: tl.constexpr = False, HAS_PROXY: tl.constexpr = False, USE_PTX: tl.constexpr = False,
    STATUS_WORD: tl.constexpr = 0, PROXY_WAIT_WORD: tl.constexpr = 0, PROXY_DELTA: tl.constexpr = 0,
    ERROR_WORD: tl.constexpr = 0, KERNEL_WAIT: tl.constexpr = True,
    rank=0, ABORT_BYTES: tl.constexpr = 0, ABORTED_WORD: tl.constexpr = 0,  # node peers' aborts (NODE_SYNC)
    # Only remote rows staged (SPLIT): slots outside [node_slots[0], node_slots[1]) are read at remote_recv_bytes.
    node_slots_ptr=None, remote_recv_bytes=0, SPLIT: tl.constexpr = False,
):
    """Compiled as `moe_a2a::combine()` (`_launch.compiled_as`, for profilers that look for it).

    Grid: (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H)): one program per BLOCK_T tokens x BLOCK_H hidden
    elements.

    Reads up to K rows of BLOCK_H*itemsize bytes per token (its expert outputs; FP8: BLOCK_H bytes and
    their scales) and writes one.
    Tokens t >= bound_m are not touched; masked routes (slot -1) are skipped, their weight unread."""
    if NODE_SYNC:
        ok = d.node_wait(base_ptr, sync_bytes + READY_BYTES, epoch_ptr, failed_ptr, flags_ptr, node_first,
                         timeout_ns, max_spins, NODE, NODE_PAD, HAS_PROXY, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD,
                         STATUS_WORD, USE_PTX, KERNEL_WAIT)
        num_tokens = tl.where(ok, num_tokens, 0)  # (a scalar folded into the bound, not into a mask)
        if ABORT_BYTES > 0:
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & ok:
                d.node_check_aborted(base_ptr, sync_bytes, ABORT_BYTES, epoch_ptr, flags_ptr, ABORTED_WORD, rank,
                                     node_first, NODE, NODE_PAD)
    tokens, is_live = d.live_token_block(num_tokens, bound_m_ptr, BLOCK_T, HAS_BOUND_M)
    chunk = tl.program_id(1)

    y_ty: tl.constexpr = out_tokens_ptr.dtype.element_ty
    base_y = base_ptr.to(tl.pointer_type(y_ty))
    cols, mask, out_ptrs, acc = d.token_sum_start(out_tokens_ptr, tokens, is_live, stride_out_t, chunk, H, BLOCK_T,
                                                  BLOCK_H, ACCUMULATE)
    for k in range(K):  # k order: the fp32 sum is rounded exactly as in the reference
        slot = tl.load(route_slot_ptr + tokens * stride_slot_t + k * stride_slot_k,
                       mask=is_live, other=-1).to(tl.int64)
        has_slot = (slot >= 0) & (slot < MAX_SLOTS)
        w = tl.load(weights_ptr + tokens * stride_w_t + k * stride_w_k, mask=has_slot, other=0.0)
        row_bytes = d.combine_row_bytes(slot, recv_bytes, remote_recv_bytes, node_slots_ptr, SC_BYTES, SPLIT)
        row = tl.multiple_of(row_bytes // ITEM_BYTES, ALIGN_ELEMS)
        if FP8:  # fp32(q) * scale, one rounding, as reference.combine_fp8
            y = d.fp8_load_dequantized(base_ptr, row, chunk * BLOCK_H, is_live & has_slot, H, BLOCK_H,
                                       SCALE_OFFSET_BYTES, Q_BLOCK, FP8_VIA_BITS)
        else:
            y = tl.load(base_y + row[:, None] + cols[None, :], mask=mask & has_slot[:, None], other=0.0)
        acc = tl.where(has_slot[:, None], acc + w[:, None] * y.to(tl.float32), acc)
    if y_ty == tl.bfloat16:
        tl.store(out_ptrs, _f32_to_bf16_rtne(acc), mask=mask)
    else:
        tl.store(out_ptrs, acc.to(y_ty), mask=mask)  # fp16: rtne on GPU and in the interpreter

