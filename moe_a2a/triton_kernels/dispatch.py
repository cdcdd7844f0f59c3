"""Dispatch data movement: pack tokens expert-major into the send buffer, unpack received rows.

Payloads are opaque bytes. Every tensor is viewed as *words* (int32, int16 or uint8: the widest
that divides every row length, stride and offset the launcher can see), so fp8, bf16, fp16 and fp32
payloads share one kernel and a copy is bitwise. Rows in the send/recv buffers start 16-byte aligned
(`A2AConfig` strides; buffer offsets are multiples of 16), so when the host can also prove that for the
other side the kernels hint `tl.multiple_of` and the compiler emits 16-byte accesses on GPU.

Buffers of several ranks (this rank's send/recv buffers, a same-node peer's buffer mapped into this
process) are addressed as int64 byte offsets from ONE uint8 tensor `base`: on GPU everything lives in
one UVA space, and under `TRITON_INTERPRET=1` raw host addresses work the same way.

- `pack_tokens_by_expert`: x[t] (+ its fp32 scales) -> `send + route_slot[t, k] * Sd` for every live k.
  Each token is read once and written K times. With `quantize` (`quant.Fp8Quantize`) the pack quantises
  instead of copying: bf16/fp16/fp32 rows in, into each slot's payload bytes the fp8 bytes and scales
  `quant.quantize_fp8` writes (the same `_details.py` helpers), so no separate quantisation pass runs.
- `unpack_tokens_by_expert`: the rows every source sent to this rank -> `out_expert_x` in the order of
  `reference.dispatch`. All offsets come from the `[W, E]` count matrix, on the device: no host sync,
  nothing computed on the host per call, so it can be captured in a CUDA graph.

The per-(source, local expert) tables and the row walk are helpers of `_details.py`, shared with
`combine.pack_combine_by_source`, so both directions agree on every row by construction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import A2AConfig, Layout, ceil_div, next_power_of_2
from ..protocol import device as protocol_device
from ..protocol.words import Flag, flag_word
from . import _checks as check
from . import _details as d
from . import _launch as launch
from .node_sync import NodeSync, launch_wait_apart
from .quant import Fp8Quantize, check_fused_quantize

# ================================================================================================
# Kernels
# ================================================================================================
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
def _unpack_dispatched_tokens_kernel(
    # outputs
    out_num_tokens_ptr,  # (L,) int32: rows per local expert
    out_x_ptr,           # (R, X_WORDS) words, row stride `stride_out_x_r`: expert-major rows
    out_scale_ptr,       # (R, S) int32 (fp32 bits), strides (stride_out_scale_r, stride_out_scale_s)
    # inputs
    counts_ptr,          # (W, E) int32: row s = source s's routes per expert
    base_ptr,            # uint8: byte address space of this rank's recv buffer and peers' send buffers
    peer_send_bytes_ptr,  # (W,) int64: peer s's send buffer - base (same node), -1 = remote source
    recv_bytes,          # int: this rank's recv buffer - base
    rank,
    num_out_rows,        # R: rows of out_expert_x (a row past it is dropped, never written)
    # strides, in elements
    stride_counts_w, stride_out_x_r, stride_out_scale_r, stride_out_scale_s,
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
):
    """Compiled as `moe_a2a::dispatch()` (`_launch.compiled_as`, for profilers that look for it).

    Grid: (G,) persistent programs; program g copies row tiles g, g+G, ... of the dense received
    rows (BLOCK_R rows x BLOCK_W-word chunks). Tiles ignore (source, expert) boundaries, so a skewed
    routing (every token to one expert) spreads over all programs like a uniform one.

    Each program first builds the per-pair tables from counts (W*L int32 + the node peers' row
    prefixes), then moves (x_bytes + 4*S) bytes per received row in and out. With NODE_SYNC every
    program first waits until each same-node source published this epoch (its count row and its
    packed send buffer); after a failed wait nothing is written."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    ok = pid >= 0
    if NODE_SYNC:
        ok = d.node_wait(base_ptr, sync_bytes + READY_BYTES, epoch_ptr, failed_ptr, flags_ptr, node_first,
                         timeout_ns, max_spins, NODE, NODE_PAD, HAS_PROXY, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD,
                         STATUS_WORD, USE_PTX, KERNEL_WAIT)
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

    if HAS_RANGES:  # begin = the earlier sources' rows of the expert (DeepEP's layout_range)
        l2 = tl.arange(0, L_PAD)[:, None]
        s2 = tl.arange(0, W_PAD)[None, :]
        tl.store(out_ranges_ptr + l2 * W + s2, ((tl.cumsum(cnt, axis=1) - cnt) << 32) | cnt,
                 mask=(l2 < tl.where((pid == 0) & ok, L, 0)) & (s2 < W))
    NPAIR: tl.constexpr = L_PAD * W_PAD
    cnt = tl.reshape(cnt, (NPAIR,))
    dense_start = tl.reshape(dense_start, (NPAIR,))
    out_start = tl.reshape(out_start, (NPAIR,))
    first_bytes = tl.reshape(first_bytes, (NPAIR,))
    rest_bytes = tl.reshape(rest_bytes, (NPAIR,))
    split = tl.reshape(split, (NPAIR,))
    fit = tl.reshape(fit, (NPAIR,))

    l_idx = tl.arange(0, L_PAD)
    tl.store(out_num_tokens_ptr + l_idx, tot.to(tl.int32), mask=l_idx < tl.where((pid == 0) & ok, L, 0))
    if NODE_SYNC:
        tl.store(flags_ptr + ABORT_WORD, protocol_device.encode_abort(tl.load(epoch_ptr), aborted),
                 mask=(pid == 0) & ok & (aborted < W))
    if CAPACITY > 0:
        if NODE_SYNC:
            over = tl.min(tl.where((l_idx < L) & (tot > CAPACITY), l_idx, L_PAD), axis=0)
            n_over = tl.sum(tl.where(l_idx == over, tot, 0), axis=0)
            hit = (pid == 0) & ok & (over < L)
            tl.store(flags_ptr + CAPACITY_WORD, protocol_device.encode_capacity(over, n_over, L), mask=hit)
            if ABORT_AT_COMBINE:  # the call is void: this rank's combine tells every peer (node and proxy)
                epoch = tl.load(epoch_ptr)
                tl.store(aborted_ptr, epoch, mask=hit)
                tl.store(flags_ptr + CALL_ABORTED_WORD, epoch, mask=hit)
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
        if HAS_SCALES:  # in the payload's tile shape (copy_row_columns says why)
            d.copy_row_columns(base_i32, (src_bytes + SCALE_OFFSET_BYTES) // 4, out_scale_ptr,
                               out_row * stride_out_scale_r, stride_out_scale_s, is_row, S, BLOCK_W)


# ================================================================================================
# Launchers
# ================================================================================================
def pack_tokens_by_expert(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    route_slot: torch.Tensor,
    send_base: torch.Tensor,
    send_offset_bytes: int,
    cfg: A2AConfig,
    bound_m: torch.Tensor | None = None,
    node: NodeSync | None = None,
    remote_send_offset_bytes: int | None = None,
    node_slots: torch.Tensor | None = None,
    quantize: "Fp8Quantize | dict | None" = None,
    max_slots: int | None = None,
) -> None:
    """Copy every live route's token into its expert-major slot of this rank's dispatch send buffer.

    Args:
        x: `[T, H]` cfg.in_dtype, last stride 1, T <= cfg.max_num_tokens.
        x_scale: `[T, num_scales]` float32 (any strides) when cfg.has_scales, else None.
        route_slot: `[T, K]` int32/int64: slot of route (t, k) in the send buffer, `-1` = no route
            (masked, or t >= bound_m); from `routing.py`.
        send_base: 1-D uint8 tensor, the base of the byte address space.
        send_offset_bytes: the send buffer's offset from `send_base.data_ptr()` (a multiple of 16).
        bound_m: optional `[1]` int32 on x's device: tokens t >= bound_m[0] are not read.
        node: same-node synchronisation (`node_sync.NodeSync`): when given, the kernel's last program
            publishes this rank's count row (already in the counts of its sync area) and the epoch to
            every same-node peer, and with remote peers raises SEND_READY for the proxy (after waiting
            for its writes of the previous call). It then launches even for T = 0 (peers wait for it).
        remote_send_offset_bytes, node_slots: only remote rows staged: slots j in
            `[node_slots[0], node_slots[1])` (`[2]` int32 on x's device, from `route_tokens`) go to the
            send buffer at `send_offset_bytes`, every other slot to the one at `remote_send_offset_bytes`
            (a multiple of 16). Both or neither.
        quantize: fused fp8 quantisation (`quant.Fp8Quantize` or a dict of its fields; cfg.in_dtype
            bf16/fp16/fp32): each slot's payload bytes get x[t]'s fp8 bytes at `[0, H)` and its scales
            from `quantize.scale_offset_bytes`, the bytes `quant.quantize_fp8` writes for the token (the
            rest of the payload bytes are not written), in place of the bytes of x[t]. None: a copy.
        max_slots: slots `route_slot` may name (a slot outside `[0, max_slots)` is dropped, never written);
            default `cfg.max_routes`. Send rows (`route_tokens(out_send_row=)`) also name the private
            staging rows after them: `layout.max_routes + layout.private_stage_rows`.

    Slot j is written at `send + j*Sd` (payload) and `send + j*Sd + cfg.dispatch_scale_offset_bytes`
    (scales); bytes between payload and scales are not touched. No host sync; CUDA-graph safe.
    """
    launch_wait_apart(node, "dispatch_send", send_base)  # a kernel of its own when the words are in host memory
    if isinstance(quantize, dict):  # hashable for the launch key (an Fp8Quantize is checked after a miss)
        quantize = check_fused_quantize("quantize", quantize, cfg)
    key = None
    if isinstance(x, torch.Tensor) and x.is_cuda:
        key = launch.key(x, x_scale, route_slot, send_base, send_offset_bytes, cfg, bound_m, node,
                         remote_send_offset_bytes, node_slots, quantize, max_slots)
        if _PACK.hit(key):
            return
    check.config(cfg)
    check.tensor("x", x, dtypes=(cfg.in_dtype,), shape=(None, cfg.hidden_dim))
    device = x.device
    T, K = x.shape[0], cfg.experts_per_token
    if T > cfg.max_num_tokens:
        check.fail("x", f"at most max_num_tokens={cfg.max_num_tokens} rows", str(T))
    if cfg.has_scales:
        check.tensor("x_scale", x_scale, dtypes=(torch.float32,), shape=(T, cfg.num_scales), device=device,
                     strides="any")
    elif x_scale is not None:
        check.fail("x_scale", "None (this config has no scales)", f"a tensor {tuple(x_scale.shape)}")
    check.tensor("route_slot", route_slot, dtypes=(torch.int32, torch.int64), shape=(T, K), device=device,
                 strides="any")
    check.tensor("send_base", send_base, dtypes=(torch.uint8,), shape=(None,), device=device)
    check.integer("send_offset_bytes", send_offset_bytes)
    check.bound_m(bound_m, device)
    split = check.split("remote_send_offset_bytes", remote_send_offset_bytes, node_slots, device)
    quantize = check_fused_quantize("quantize", quantize, cfg)
    if max_slots is None:
        max_slots = cfg.max_routes
    check.integer("max_slots", max_slots, cfg.max_routes)
    if T == 0 and node is None:
        return

    remote = remote_send_offset_bytes if split else send_offset_bytes
    block_t = launch.tokens_per_program(device, T)
    quant_args = {}
    if quantize is not None:
        # x is read in elements, the slots written in bytes; a chunk is whole scale groups (the tile
        # holds one row per (token, group)), as many bytes of x as a copy chunk (1024 bf16 elements).
        word_bytes, x_words, row_words = 1, x, cfg.hidden_dim
        align = launch.align_words(1, send_base.data_ptr(), send_offset_bytes, remote)
        block_w = max(quantize.block, launch.chunk_words(row_words, x.element_size()))
        quant_args = dict(QUANT=True, Q_BLOCK=quantize.block, Q_SCALES=quantize.num_scales(cfg.hidden_dim),
                          Q_SCALE_OFFSET_BYTES=quantize.scale_offset_bytes, ROUND_SCALE=quantize.round_scale,
                          UE8M0=quantize.ue8m0, FP8_VIA_BITS=device.type != "cuda")
        warps = launch.num_warps(block_t * block_w, x.element_size())
    else:
        x_row_bytes = x.stride(0) * x.element_size()
        word_bytes, word_dtype = launch.word_bytes(cfg.x_bytes, x.data_ptr(), x_row_bytes, send_base.data_ptr(),
                                                   send_offset_bytes, remote, cfg.dispatch_stride_bytes)
        # The hint is on the offset from base, so base and offset must each be 16-byte aligned.
        align = launch.align_words(word_bytes, x.data_ptr(), x_row_bytes, send_base.data_ptr(), send_offset_bytes,
                                   remote)
        x_words = launch.as_words(x, word_dtype)
        row_words = cfg.x_bytes // word_bytes
        block_w = launch.chunk_words(row_words, word_bytes)
        warps = launch.num_warps(block_t * block_w, word_bytes)
    S = cfg.num_scales
    scale_i32 = x_scale.view(torch.int32) if cfg.has_scales else x_words  # dummy pointer without scales
    stride_scale = x_scale.stride() if cfg.has_scales else (0, 0)
    grid = (max(1, ceil_div(T, block_t)), ceil_div(row_words, block_w))
    sync_args = {} if node is None else node.kernel_args("dispatch_send", device)
    if split:
        # With a proxy the remote rows are packed first (their own half of the grid), so the wire starts
        # while this node's rows are still being packed.
        remote_first = node is not None and node.with_proxy
        sync_args = {**sync_args, "node_slots_ptr": node_slots, "remote_send_bytes": remote_send_offset_bytes,
                     "SPLIT": True, "REMOTE_FIRST": remote_first}
        if remote_first:
            grid = (grid[0], 2 * grid[1])
    _PACK.launch(
        key, grid, x_words, scale_i32, route_slot, send_base, bound_m if bound_m is not None else route_slot,
        send_offset_bytes, T,
        x_words.stride(0), stride_scale[0], stride_scale[1], route_slot.stride(0), route_slot.stride(1),
        K=K, MAX_SLOTS=max_slots, X_WORDS=row_words, S=S, S_PAD=next_power_of_2(max(S, 1)),
        SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes, SD_BYTES=cfg.dispatch_stride_bytes,
        WORD_BYTES=word_bytes, ALIGN_WORDS=align, BLOCK_T=block_t, BLOCK_W=block_w,
        HAS_SCALES=cfg.has_scales, HAS_BOUND_M=bound_m is not None,
        num_warps=warps, **quant_args, **sync_args,
    )


def unpack_tokens_by_expert(
    out_expert_num_tokens: torch.Tensor,
    out_expert_x: torch.Tensor,
    out_expert_x_scale: torch.Tensor | None,
    counts: torch.Tensor,
    rank: int,
    base: torch.Tensor,
    peer_send_bytes: torch.Tensor,
    recv_bytes: int,
    cfg: A2AConfig,
    layout: Layout,
    node: NodeSync | None = None,
    copy_bytes: int | None = None,
    out_source_ranges: torch.Tensor | None = None,
) -> None:
    """Copy every row sent to this rank into the expert-major dispatch output (`reference.dispatch`).

    Args:
        out_expert_num_tokens: `[L]` int32, out: rows per local expert.
        out_expert_x: `[R, H]` cfg.in_dtype, last stride 1, out. Expert l's rows start at
            sum_{j<l} round_up(num_tokens[j], expert_padding), ordered by (source, token, k). Padding
            rows and rows past the received ones are not written; R >= layout.max_dispatch_rows
            guarantees room (a row past R is dropped, never written out of bounds).
        out_expert_x_scale: `[R, num_scales]` float32 (any strides) when cfg.has_scales, else None.
        counts: `[W, E]` int32, the routing matrix (row s = source s's routes per expert), on the
            device or pinned host memory. Must be validated (`plan.validate_counts`) beforehand.
        rank: this rank.
        base: 1-D uint8 tensor, base of the byte address space of all buffers below.
        peer_send_bytes: `[W]` int64: for a same-node source s (this rank included), the offset of s's
            send buffer from base; `-1` for a remote source. Offsets are multiples of 16.
        recv_bytes: offset of this rank's recv buffer from base (remote sources' rows are there, at
            the private region then the remainder region of `plan`).
        node: same-node synchronisation (`node_sync.NodeSync`): when given, every program first waits
            until each same-node source published this call's epoch, and with remote peers until the
            proxy raised DISPATCH_RECV_READY (then `counts` must be the counts of this rank's sync
            area, where those sources and the proxy put their rows).
        copy_bytes: copy only the first `copy_bytes` bytes of each row's payload (rounded up to the copy
            word; the rest of the output row is left as it was): the bytes a fused fp8 quantisation
            wrote (`AllToAll.dispatch(quantize=)`), half of a bf16 row. None: the whole payload.
        out_source_ranges: optional `[L, W]` int64, contiguous, out: `(begin << 32) | count` per (local
            expert l, source s): expert l's rows from s are its rows [begin, begin + count) (DeepEP's
            `layout_range`), begin = the rows of the sources before s.

    Every offset is computed on the device from `counts`: no host sync, CUDA-graph safe.
    """
    launch_wait_apart(node, "dispatch_recv", base)  # a kernel of its own when the words are in host memory
    key = None
    if isinstance(out_expert_x, torch.Tensor) and out_expert_x.is_cuda:
        key = launch.key(out_expert_num_tokens, out_expert_x, out_expert_x_scale, counts, rank, base, peer_send_bytes,
                         recv_bytes, cfg, layout, node, copy_bytes, out_source_ranges)
        if _UNPACK.hit(key):
            return
    check.config(cfg)
    check.layout(layout, cfg)
    W, L, E = layout.world_size, layout.num_local_experts, cfg.num_experts
    check.tensor("out_expert_x", out_expert_x, dtypes=(cfg.in_dtype,), shape=(None, cfg.hidden_dim))
    device = out_expert_x.device
    R = out_expert_x.shape[0]
    check.tensor("out_expert_num_tokens", out_expert_num_tokens, dtypes=(torch.int32,), shape=(L,),
                 device=device)
    if cfg.has_scales:
        check.tensor("out_expert_x_scale", out_expert_x_scale, dtypes=(torch.float32,),
                     shape=(R, cfg.num_scales), device=device, strides="any")
    elif out_expert_x_scale is not None:
        check.fail("out_expert_x_scale", "None (this config has no scales)", "a tensor")
    check.counts(counts, W, E, device)
    check.integer("rank", rank, 0, W)
    check.tensor("base", base, dtypes=(torch.uint8,), shape=(None,), device=device)
    check.peer_table("peer_send_bytes", peer_send_bytes, W, device)
    check.integer("recv_bytes", recv_bytes)
    if copy_bytes is not None:
        check.integer("copy_bytes", copy_bytes, 1, cfg.x_bytes + 1)
    if out_source_ranges is not None:
        check.tensor("out_source_ranges", out_source_ranges, dtypes=(torch.int64,), shape=(L, W), device=device,
                     strides="contiguous")

    out_row_bytes = out_expert_x.stride(0) * out_expert_x.element_size() if R else 0
    # Sources' rows start at base + (recv_bytes or peer_send_bytes[s]) + multiples of Sd (16-aligned);
    # the hint is on the offset from base, so base and recv_bytes must each be 16-byte aligned.
    word_bytes, word_dtype = launch.word_bytes(cfg.x_bytes, out_expert_x.data_ptr(), out_row_bytes, recv_bytes,
                                               base.data_ptr(), layout.private_offset_bytes,
                                               cfg.dispatch_stride_bytes)
    align = launch.align_words(word_bytes, out_expert_x.data_ptr(), out_row_bytes, recv_bytes, base.data_ptr())
    x_words = launch.as_words(out_expert_x, word_dtype)
    row_words = cfg.x_bytes // word_bytes
    copy_words = row_words if copy_bytes is None else min(row_words, ceil_div(copy_bytes, word_bytes))
    block_w = launch.chunk_words(copy_words, word_bytes)
    S = cfg.num_scales
    scale_i32 = out_expert_x_scale.view(torch.int32) if cfg.has_scales else x_words
    stride_scale = out_expert_x_scale.stride() if cfg.has_scales else (0, 0)
    grid, block_r = launch.persistent_grid(device, layout)
    sync_args = {} if node is None else node.kernel_args("dispatch_recv", device)
    _UNPACK.launch(
        key, grid, out_expert_num_tokens, x_words, scale_i32, counts, base, peer_send_bytes, recv_bytes, rank, R,
        counts.stride(0), x_words.stride(0) if R else row_words, stride_scale[0], stride_scale[1],
        W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L),
        PAD=cfg.expert_padding, P=layout.private_rows, PRIVATE_OFFSET_BYTES=layout.private_offset_bytes,
        HEADER_ROWS=layout.header_rows,
        X_WORDS=copy_words, S=S,
        SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes, SD_BYTES=cfg.dispatch_stride_bytes,
        WORD_BYTES=word_bytes, ALIGN_WORDS=align,
        BLOCK_R=block_r, BLOCK_W=block_w, BLOCK_E=min(next_power_of_2(E), 256),
        HAS_SCALES=cfg.has_scales, CAPACITY=layout.expert_capacity, CAPACITY_WORD=flag_word(Flag.CAPACITY_EXCEEDED),
        ABORT_WORD=flag_word(Flag.ABORTED),
        num_warps=launch.num_warps(block_r * block_w, word_bytes), out_ranges_ptr=out_source_ranges,
        HAS_RANGES=out_source_ranges is not None, **sync_args,
    )


_PACK = launch.LaunchCache(_pack_tokens_by_expert_kernel)
_UNPACK = launch.LaunchCache(_unpack_dispatched_tokens_kernel)

__all__ = ["pack_tokens_by_expert", "unpack_tokens_by_expert"]
