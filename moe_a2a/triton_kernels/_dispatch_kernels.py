"""The `@triton.jit` bodies of `dispatch.py` (private: launched only by its launchers, which hold the
overview, the checks and the block sizes).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _details as d
from . import _launch as launch


# Row and token counts are not specialised: an aborted call (no tokens in, one scratch row out) must not
# compile new variants while its peers wait for it.
@triton.jit(do_not_specialize=["num_tokens"], repr=launch.compiled_as(launch.DISPATCH_SYMBOL))
def _pack_tokens_by_expert_kernel(
    x_ptr,               # in: (T, X_WORDS) words, row stride `stride_x_t`: the payload bytes of x
    x_scale_ptr,         # in: (T, S) int32 (fp32 bits), strides (stride_scale_t, stride_scale_s)
    route_slot_ptr,      # in: (T, K) int32/int64, strides (stride_slot_t, stride_slot_k); -1 = no route
    base_ptr,            # out: uint8, the byte address space of the send buffer
    bound_m_ptr,         # in: (1,) int32 live tokens; read only when HAS_BOUND_M
    send_bytes,          # int: send buffer - base, in bytes
    num_tokens,          # T
    # strides, in elements
    stride_x_t, stride_scale_t, stride_scale_s, stride_slot_t, stride_slot_k,
    # meta-parameters
    K: tl.constexpr,
    MAX_SLOTS: tl.constexpr,       # slots in the send buffer (T*K, + the private staging rows): a bad one is dropped
    X_WORDS: tl.constexpr,         # payload words per row; constexpr so tail masks are provable
    S: tl.constexpr,               # fp32 scales per row (0: none)
    S_PAD: tl.constexpr,
    SCALE_OFFSET_BYTES: tl.constexpr,
    SD_BYTES: tl.constexpr,        # dispatch slot stride (multiple of 16)
    WORD_BYTES: tl.constexpr,
    ALIGN_WORDS: tl.constexpr,     # row starts are multiples of this many words (16 bytes when proven)
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_BOUND_M: tl.constexpr,
    # Fused fp8 quantisation (quant.Fp8Quantize): x_ptr is then x's elements (bf16/fp16/fp32), X_WORDS = H,
    # BLOCK_W the elements of a chunk (whole Q_BLOCK groups), WORD_BYTES = 1 and ALIGN_WORDS in bytes.
    QUANT: tl.constexpr = False,
    Q_BLOCK: tl.constexpr = 128,             # elements per scale, a power of two
    Q_SCALES: tl.constexpr = 0,              # scale groups per row, ceil(H / Q_BLOCK)
    Q_SCALE_OFFSET_BYTES: tl.constexpr = 0,  # where a row's scales start (a multiple of 4)
    ROUND_SCALE: tl.constexpr = False, UE8M0: tl.constexpr = False,
    FP8_VIA_BITS: tl.constexpr = False,      # the interpreter: fp8 bytes by integer encoding
    # Same-node synchronisation and proxy flags (node_sync.py, NodeSync.kernel_args), only with NODE_SYNC:
    failed_ptr=None, counter_ptr=None, epoch_ptr=None, flags_ptr=None, peer_sync_bytes_ptr=None,
    sync_bytes=0, node_first=0, timeout_ns=0, max_spins=0,
    READY_BYTES: tl.constexpr = 0, NODE: tl.constexpr = 1, NODE_SYNC: tl.constexpr = False,
    HAS_PROXY: tl.constexpr = False, USE_PTX: tl.constexpr = False, STATUS_WORD: tl.constexpr = 0,
    PROXY_WAIT_WORD: tl.constexpr = 0, PROXY_DELTA: tl.constexpr = 0, ERROR_WORD: tl.constexpr = 0,
    PROXY_SIGNAL_WORD: tl.constexpr = 0, KERNEL_WAIT: tl.constexpr = True,
    rank=0, COUNTS_BYTES: tl.constexpr = 0, E: tl.constexpr = 1, E_PAD: tl.constexpr = 1,
    # Only remote rows staged (SPLIT): slots outside [node_slots[0], node_slots[1]) go to remote_send_bytes.
    node_slots_ptr=None, remote_send_bytes=0, SPLIT: tl.constexpr = False,
    # With SPLIT and HAS_PROXY: the first half of the chunk axis packs the remote rows and raises SEND_READY,
    # the second half this node's rows and publishes to the node (the wire starts before packing ends).
    REMOTE_FIRST: tl.constexpr = False,
    # RANK_META (per-rank rows, `rank_rows.row_meta_args`): the chunk-0 programs also write the metadata of
    # every row their tokens open (`_details.stamp_row_meta`), before the epilogue publishes the rows.
    meta_indices_ptr=None, meta_slot_ptr=None, meta_counts_ptr=None, meta_weights_ptr=None, meta_num_experts=0,
    meta_stride_counts=0, meta_stride_w_t=0, meta_stride_w_k=0, meta_sender=0,
    META_OFFSET_BYTES: tl.constexpr = 0, META_K_PAD: tl.constexpr = 1, META_L: tl.constexpr = 1,
    META_E_PAD: tl.constexpr = 1, META_WEIGHTS: tl.constexpr = False, META_RELAY: tl.constexpr = False,
    META_NODE: tl.constexpr = 1, RANK_META: tl.constexpr = False,
):
    """Compiled as `moe_a2a::dispatch()` (`_launch.compiled_as`, for profilers that look for it).

    Grid: (cdiv(T, BLOCK_T), cdiv(X_WORDS, BLOCK_W)): one program per BLOCK_T tokens x BLOCK_W-word
    chunk of their payload.

    Reads the chunk once and writes it to the K slots of each token: T*x_bytes read, up to K*T*x_bytes
    written. The chunk-0 programs also copy the tokens' S scales (4*S bytes per slot).
    With QUANT a chunk is BLOCK_W elements of x, whole Q_BLOCK groups, held as one tile row per (token,
    group): each group is quantised once (`_details.fp8_block_quantize`, quantize_fp8's math) and its fp8
    bytes and scale written to the K slots: T*H*itemsize read, up to K*T*(H + scale bytes) written.
    With NODE_SYNC the last program to finish publishes this rank's count row and epoch to every
    same-node peer (they then pull the packed rows from this send buffer) and, with remote peers,
    raises SEND_READY for the proxy, after waiting (prologue) until the proxy's writes out of this send
    buffer for the previous call completed."""
    if NODE_SYNC:  # folded into the bound: the interpreter mishandles a scalar broadcast into a mask
        go = tl.load(failed_ptr, volatile=True) == 0
        if HAS_PROXY:
            go = d.node_wait(base_ptr, 0, epoch_ptr, failed_ptr, flags_ptr, 0, timeout_ns, max_spins, 0, 1, True,
                             PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD, STATUS_WORD, USE_PTX, KERNEL_WAIT)
        num_tokens = tl.where(go, num_tokens, 0)
    G: tl.constexpr = BLOCK_W // Q_BLOCK  # QUANT: scale groups per chunk, tile rows per token
    if QUANT:  # token ids and liveness per tile row: each token G times
        tokens, is_live = d.live_token_block(num_tokens, bound_m_ptr, BLOCK_T, HAS_BOUND_M, G)
    else:
        tokens, is_live = d.live_token_block(num_tokens, bound_m_ptr, BLOCK_T, HAS_BOUND_M)
    chunk = tl.program_id(1)
    node_half = False
    if REMOTE_FIRST:
        # Axis 1 is the slowest in the launch order: programs of the first half (remote rows) start first.
        n_chunks = tl.num_programs(1) // 2
        node_half = chunk >= n_chunks
        chunk = chunk % n_chunks

    word_ty: tl.constexpr = x_ptr.dtype.element_ty
    base_words = base_ptr.to(tl.pointer_type(word_ty))
    base_i32 = base_ptr.to(tl.pointer_type(tl.int32))

    if QUANT:
        # Tile row i is token i // G, scale group chunk*G + i % G of its row: Q_BLOCK elements.
        group = chunk * G + tl.arange(0, BLOCK_T * G) % G
        cols = group[:, None] * Q_BLOCK + tl.arange(0, Q_BLOCK)[None, :]        # elements of x
        x_mask = is_live[:, None] & (cols < X_WORDS)
        xq = tl.load(x_ptr + tokens[:, None] * stride_x_t + cols, mask=x_mask, other=0.0).to(tl.float32)
        q, q_scale = d.fp8_block_quantize(xq, ROUND_SCALE)
        group_ok = is_live & (group < Q_SCALES)
    else:
        cols = chunk * BLOCK_W + tl.arange(0, BLOCK_W)
        x_mask = is_live[:, None] & (cols < X_WORDS)[None, :]
        rows = tl.load(x_ptr + tokens[:, None] * stride_x_t + cols[None, :], mask=x_mask)
    if HAS_SCALES:
        s_cols = tl.arange(0, S_PAD)
        s_live = is_live
        if QUANT:  # the first of a token's G tile rows copies its scales
            s_live = is_live & (tl.arange(0, BLOCK_T * G) % G == 0)
        # Only chunk 0 copies scales: fold `chunk == 0` into the column bound (a scalar condition
        # broadcast into a block mask is also what the interpreter mishandles).
        s_mask = s_live[:, None] & (s_cols < tl.where(chunk == 0, S, 0))[None, :]
        scales = tl.load(x_scale_ptr + tokens[:, None] * stride_scale_t + s_cols[None, :] * stride_scale_s,
                         mask=s_mask)

    node_slot_lo = 0
    node_slot_hi = 0
    if SPLIT:
        node_slot_lo = tl.load(node_slots_ptr)  # (not `node_first`: that names the node's first rank)
        node_slot_hi = tl.load(node_slots_ptr + 1)
    for k in range(K):
        slot = tl.load(route_slot_ptr + tokens * stride_slot_t + k * stride_slot_k,
                       mask=is_live, other=-1).to(tl.int64)
        has_slot = (slot >= 0) & (slot < MAX_SLOTS)
        if SPLIT:  # rows for this node stay in device memory; only rows for other nodes cross PCIe
            in_node = (slot >= node_slot_lo) & (slot < node_slot_hi)
            dst_bytes = tl.where(in_node, send_bytes, remote_send_bytes) + slot * SD_BYTES
            if REMOTE_FIRST:
                has_slot = has_slot & (in_node == node_half)
        else:
            dst_bytes = send_bytes + slot * SD_BYTES
        dst_words = tl.multiple_of(dst_bytes // WORD_BYTES, ALIGN_WORDS)
        if QUANT:  # words are bytes: the fp8 payload at [0, H), the scales from Q_SCALE_OFFSET_BYTES
            d.fp8_e4m3_store(base_ptr, dst_words[:, None] + cols, q, x_mask & has_slot[:, None], FP8_VIA_BITS)
            q_ok = group_ok & has_slot
            scale_bytes = dst_bytes + Q_SCALE_OFFSET_BYTES
            if UE8M0:  # one code byte per group (byte j = group j), as quantize_fp8 packs them
                tl.store(base_ptr + scale_bytes + group, d.ue8m0_code(q_scale), mask=q_ok)
                if Q_SCALES % 4 != 0:  # the last group's tile row zeroes the padding bytes of the last int32
                    pad = Q_SCALES + tl.arange(0, 4)
                    pad_mask = (q_ok & (group == Q_SCALES - 1))[:, None] & (pad < (Q_SCALES + 3) // 4 * 4)[None, :]
                    tl.store(base_ptr + scale_bytes[:, None] + pad[None, :],
                             tl.zeros([BLOCK_T * G, 4], dtype=tl.uint8), mask=pad_mask)
            else:
                tl.store(base_ptr.to(tl.pointer_type(tl.float32)) + scale_bytes // 4 + group, q_scale, mask=q_ok)
        else:
            tl.store(base_words + dst_words[:, None] + cols[None, :], rows, mask=x_mask & has_slot[:, None])
        if HAS_SCALES:
            dst_scale = (dst_bytes + SCALE_OFFSET_BYTES) // 4
            tl.store(base_i32 + dst_scale[:, None] + s_cols[None, :], scales, mask=s_mask & has_slot[:, None])
    if RANK_META:
        if chunk == 0:
            d.stamp_row_meta(base_ptr, route_slot_ptr, stride_slot_t, stride_slot_k, meta_indices_ptr, meta_slot_ptr,
                             meta_counts_ptr, meta_weights_ptr, num_tokens, meta_num_experts, meta_stride_counts,
                             meta_stride_w_t, meta_stride_w_k, meta_sender, send_bytes, remote_send_bytes,
                             node_slot_lo, node_slot_hi, node_half, K, META_K_PAD, META_L,
                             META_E_PAD, BLOCK_T, MAX_SLOTS, SD_BYTES, META_OFFSET_BYTES, META_WEIGHTS, SPLIT,
                             REMOTE_FIRST, META_RELAY, META_NODE)
    if REMOTE_FIRST:
        # Two epilogues, one counter each: the remote half's last program hands the staged rows to the
        # proxy, the node half's publishes to the node peers (as below, without the proxy's flag).
        half_programs = tl.num_programs(0) * n_chunks
        if node_half:
            if d.node_arrive_of(counter_ptr + 1, half_programs, USE_PTX):
                if tl.load(failed_ptr, volatile=True) == 0:
                    d.node_copy_count_row(base_ptr, peer_sync_bytes_ptr, COUNTS_BYTES, rank, node_first, E, E_PAD,
                                          NODE)
                    d.node_publish(base_ptr, peer_sync_bytes_ptr, READY_BYTES, epoch_ptr, flags_ptr, rank,
                                   node_first, NODE, False, PROXY_SIGNAL_WORD, USE_PTX)
        else:
            if d.node_arrive_of(counter_ptr, half_programs, USE_PTX):
                if tl.load(failed_ptr, volatile=True) == 0:
                    d.node_publish(base_ptr, peer_sync_bytes_ptr, READY_BYTES, epoch_ptr, flags_ptr, rank,
                                   node_first, 0, True, PROXY_SIGNAL_WORD, USE_PTX)
    elif NODE_SYNC:
        if d.node_arrive(counter_ptr, USE_PTX):
            if tl.load(failed_ptr, volatile=True) == 0:
                d.node_copy_count_row(base_ptr, peer_sync_bytes_ptr, COUNTS_BYTES, rank, node_first, E, E_PAD, NODE)
                d.node_publish(base_ptr, peer_sync_bytes_ptr, READY_BYTES, epoch_ptr, flags_ptr, rank, node_first,
                               NODE, HAS_PROXY, PROXY_SIGNAL_WORD, USE_PTX)


@triton.jit(do_not_specialize=["num_out_rows"], repr=launch.compiled_as(launch.DISPATCH_SYMBOL))
def _unpack_tokens_by_expert_kernel(
    # outputs
    out_num_tokens_ptr,  # (L,) int32: rows per local expert
    out_x_ptr,           # (R, X_WORDS) words, row stride `stride_out_x_r`: expert-major rows
    out_scale_ptr,       # (R, S) int32 (fp32 bits), strides (stride_out_scale_r, stride_out_scale_s); with
                         # CAPACITY also (L, CAPACITY, S), strides (stride_out_scale_e, _r, _s): any layout
    # inputs
    counts_ptr,          # (W, E) int32: row s = source s's routes per expert
    base_ptr,            # uint8: byte address space of this rank's recv buffer and peers' send buffers
    peer_send_bytes_ptr,  # (W,) int64: peer s's send buffer - base (same node), -1 = remote source
    recv_bytes,          # int: this rank's recv buffer - base
    rank,
    num_out_rows,        # R: rows of out_expert_x (a row past it is dropped, never written)
    # strides, in elements
    stride_counts_w, stride_out_x_r, stride_out_scale_r, stride_out_scale_s, stride_out_scale_e,
    # meta-parameters
    W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr,
    PAD: tl.constexpr,                  # expert_padding
    P: tl.constexpr,                    # private rows per source
    PRIVATE_OFFSET_BYTES: tl.constexpr,
    HEADER_ROWS: tl.constexpr,          # rows before each source's private rows (its count row)
    X_WORDS: tl.constexpr, S: tl.constexpr,
    SCALE_OFFSET_BYTES: tl.constexpr, SD_BYTES: tl.constexpr,
    WORD_BYTES: tl.constexpr, ALIGN_WORDS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    # Same-node synchronisation and proxy flags (node_sync.py, NodeSync.kernel_args), only with NODE_SYNC:
    failed_ptr=None, epoch_ptr=None, flags_ptr=None, peer_sync_bytes_ptr=None, sync_bytes=0, node_first=0,
    timeout_ns=0, max_spins=0,
    READY_BYTES: tl.constexpr = 0, NODE: tl.constexpr = 1, NODE_PAD: tl.constexpr = 1,
    NODE_SYNC: tl.constexpr = False, HAS_PROXY: tl.constexpr = False, USE_PTX: tl.constexpr = False,
    STATUS_WORD: tl.constexpr = 0, PROXY_WAIT_WORD: tl.constexpr = 0, PROXY_DELTA: tl.constexpr = 0,
    ERROR_WORD: tl.constexpr = 0, KERNEL_WAIT: tl.constexpr = True,
    CAPACITY: tl.constexpr = 0,      # A2AConfig.expert_capacity (0: compact output)
    CAPACITY_WORD: tl.constexpr = 0,  # flags word for an overflow report (with NODE_SYNC)
    ABORT_WORD: tl.constexpr = 0,     # flags word naming a source that aborted the call (with NODE_SYNC)
    aborted_ptr=None, CALL_ABORTED_WORD: tl.constexpr = 0,  # over capacity: this rank aborts the call
    ABORT_AT_COMBINE: tl.constexpr = False,
    out_ranges_ptr=None,  # (L, W) int64, with HAS_RANGES: (begin << 32) | count per (local expert, source)
    HAS_RANGES: tl.constexpr = False,
    # With Q_WORDS > 0: each row's payload words [Q_SCALE_WORD, Q_SCALE_WORD + Q_WORDS) (a fused fp8
    # quantisation's scales, fp32 or UE8M0 words) also go to out_qscale_ptr, addressed as out_scale_ptr.
    out_qscale_ptr=None,  # (R, Q_WORDS) or with CAPACITY (L, CAPACITY, Q_WORDS) 4-byte words, any strides
    stride_out_qscale_r=0, stride_out_qscale_s=0, stride_out_qscale_e=0,
    Q_SCALE_WORD: tl.constexpr = 0, Q_WORDS: tl.constexpr = 0,
    # A scale output whose rows are adjacent words (row stride 1: DeepEP's column-major scales, a single
    # column) with CAPACITY: copied after the rows, expert by expert in tiles of BLOCK_S of its rows, so
    # that its stores coalesce along the rows; BLOCK_SC / BLOCK_QC columns at a time.
    SCALES_BY_EXPERT: tl.constexpr = False, QSCALES_BY_EXPERT: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 8, BLOCK_SC: tl.constexpr = 1, BLOCK_QC: tl.constexpr = 1,
):
    """Compiled as `moe_a2a::dispatch()` (`_launch.compiled_as`, for profilers that look for it).

    Grid: (G,) persistent programs; program g copies row tiles g, g+G, ... of the dense received
    rows (BLOCK_R rows x BLOCK_W-word chunks). Tiles ignore (source, expert) boundaries, so a skewed
    routing (every token to one expert) spreads over all programs like a uniform one.

    Each program first builds the per-pair tables from counts (W*L int32 + the node peers' row
    prefixes), then moves (x_bytes + 4*S) bytes per received row in and out (+ 4*Q_WORDS with a quantised
    scales' output; they are payload words, also copied with the row unless copy_bytes stops short of them).
    With NODE_SYNC every program first waits until each same-node source published this epoch (its count
    row and its packed send buffer); after a failed wait nothing is written."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    ok = d.consumer_prologue(base_ptr, sync_bytes + READY_BYTES, epoch_ptr, failed_ptr, flags_ptr, node_first, timeout_ns,
                             max_spins, NODE, NODE_PAD, HAS_PROXY, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD,
                             STATUS_WORD, USE_PTX, KERNEL_WAIT, NODE_SYNC)
    cnt, dense_start, out_start, block_start, n_src, tot, num_rows, fit, aborted = d.recv_pair_tables(
        counts_ptr, stride_counts_w, rank, PAD, W, L, W_PAD, L_PAD, CAPACITY)

    # Where the pair's rows are: a same-node source is pulled from its send buffer (rows contiguous);
    # a remote one sits in this rank's private slot (rows < P of its block) then in its remainder run.
    peer_send, is_pull, send_off = d.node_peer_tables(peer_send_bytes_ptr, counts_ptr, stride_counts_w, rank,
                                                      W, L, W_PAD, BLOCK_E)
    rest = tl.maximum(n_src - P, 0)
    remainder_row = W * (HEADER_ROWS + P) + tl.cumsum(rest, axis=0) - rest     # plan.remainder_offsets
    s_row = tl.arange(0, W_PAD)[None, :].to(tl.int64)
    first_bytes = tl.where(                                      # row i < split: first_bytes + i*Sd
        is_pull[None, :],
        peer_send[None, :] + (send_off[None, :] + block_start) * SD_BYTES,
        recv_bytes + PRIVATE_OFFSET_BYTES + (s_row * (HEADER_ROWS + P) + HEADER_ROWS + block_start) * SD_BYTES)
    rest_bytes = recv_bytes + (remainder_row[None, :] + block_start - P) * SD_BYTES
    split = tl.where(is_pull[None, :], 1 << 62, P - block_start)

    d.report_received(out_num_tokens_ptr, out_ranges_ptr, flags_ptr, epoch_ptr, aborted_ptr, cnt, tot, aborted,
                      (pid == 0) & ok, W, L, W_PAD, L_PAD, HAS_RANGES, NODE_SYNC, CAPACITY, ABORT_WORD, CAPACITY_WORD,
                      CALL_ABORTED_WORD, ABORT_AT_COMBINE)
    NPAIR: tl.constexpr = L_PAD * W_PAD
    cnt_2d, first_2d, rest_2d, split_2d = cnt, first_bytes, rest_bytes, split  # the scale tiles' tables
    cnt = tl.reshape(cnt, (NPAIR,))
    dense_start = tl.reshape(dense_start, (NPAIR,))
    out_start = tl.reshape(out_start, (NPAIR,))
    first_bytes = tl.reshape(first_bytes, (NPAIR,))
    rest_bytes = tl.reshape(rest_bytes, (NPAIR,))
    split = tl.reshape(split, (NPAIR,))
    fit = tl.reshape(fit, (NPAIR,))

    num_rows = tl.where(ok, num_rows, 0)

    word_ty: tl.constexpr = out_x_ptr.dtype.element_ty
    base_words = base_ptr.to(tl.pointer_type(word_ty))
    base_i32 = base_ptr.to(tl.pointer_type(tl.int32))
    num_tiles = tl.cdiv(num_rows, BLOCK_R).to(tl.int32)
    for tile in range(pid, num_tiles, num_programs):
        is_row, out_row, src_bytes = d.tile_rows(tile, num_rows, cnt, dense_start, out_start, first_bytes,
                                                 rest_bytes, split, SD_BYTES, BLOCK_R, True, fit, CAPACITY > 0)
        is_row = is_row & (out_row < num_out_rows)
        src_words = tl.multiple_of(src_bytes // WORD_BYTES, ALIGN_WORDS)
        dst_words = out_row * stride_out_x_r
        d.copy_row_words(base_words, src_words, out_x_ptr, dst_words, is_row, X_WORDS, BLOCK_W)
        if HAS_SCALES and not SCALES_BY_EXPERT:  # in the payload's tile shape (copy_row_columns says why)
            d.copy_row_columns(base_i32, (src_bytes + SCALE_OFFSET_BYTES) // 4, out_scale_ptr,
                               d.expert_row_words(out_row, stride_out_scale_e, stride_out_scale_r, CAPACITY),
                               stride_out_scale_s, is_row, S, BLOCK_W)
        if Q_WORDS > 0 and not QSCALES_BY_EXPERT:  # a fused quantisation's scale words, into a tensor of their own
            d.copy_row_columns(base_i32, src_bytes // 4 + Q_SCALE_WORD, out_qscale_ptr,
                               d.expert_row_words(out_row, stride_out_qscale_e, stride_out_qscale_r, CAPACITY),
                               stride_out_qscale_s, is_row, Q_WORDS, BLOCK_W)

    if SCALES_BY_EXPERT or QSCALES_BY_EXPERT:
        # One local expert at a time (l = pid, pid + G, ...): its rows c < min(tot[l], CAPACITY) sit at
        # l * C + c, so a tile of them stores adjacent words; its four table rows in one reduction.
        for l in range(pid, L, num_programs):
            cnt_l, first_l, rest_l, split_l = d.expert_pair_row(l, cnt_2d, first_2d, rest_2d, split_2d, L_PAD)
            n_l = tl.where(ok, tl.minimum(tl.sum(cnt_l, axis=0), CAPACITY), 0)
            for c0 in range(0, n_l, BLOCK_S):
                c = c0 + tl.arange(0, BLOCK_S).to(tl.int64)
                is_row = (c < n_l) & (l * CAPACITY + c < num_out_rows)
                src_bytes = d.expert_rows_source(c, cnt_l, first_l, rest_l, split_l, SD_BYTES)
                if SCALES_BY_EXPERT:
                    d.copy_row_columns(base_i32, (src_bytes + SCALE_OFFSET_BYTES) // 4, out_scale_ptr,
                                       l * stride_out_scale_e + c, stride_out_scale_s, is_row, S, BLOCK_SC)
                if QSCALES_BY_EXPERT:
                    d.copy_row_columns(base_i32, src_bytes // 4 + Q_SCALE_WORD, out_qscale_ptr,
                                       l * stride_out_qscale_e + c, stride_out_qscale_s, is_row, Q_WORDS, BLOCK_QC)
