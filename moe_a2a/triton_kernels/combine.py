"""Combine data movement: send expert outputs back by source, then the weighted sum per token.

- `pack_combine_by_source` (expert side): the reverse of `dispatch.unpack_tokens_by_expert`. Every row
  this rank received in dispatch is read from `expert_y` (the same row unpack wrote) and written, as
  opaque bytes, to where its home rank expects it: a same-node home's recv buffer directly, at the
  slot its dispatch send used; for a remote home, this rank's staging area, grouped by source, from
  which the proxy sends one block per peer (`plan.combine_writes`). The walk over rows and every
  offset come from the helpers unpack uses too (`_details.py`), on the device (no sync, CUDA-graph
  safe).
- `reduce_combined_tokens` (home side): out[t] = sum_k weights[t, k] * row(route_slot[t, k]),
  accumulated in fp32 in k order (the old out[t] first when accumulating) and cast once, like
  `reference.combine`. Deterministic: each output element is owned by one program, no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import A2AConfig, Layout, ceil_div, next_power_of_2
from . import _checks as check
from . import _details as d
from . import _launch as launch
from .node_sync import NodeSync, launch_wait_apart

# Hidden elements per program of the reduce: 1024 bf16 = 2 KB per route row per program.
MAX_REDUCE_BLOCK_H = 1024


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
def _pack_expert_outputs_by_source_kernel(
    expert_y_ptr,        # in: (R, Y_WORDS) words, row stride `stride_y_r`: expert outputs, dispatch rows
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
    Moves y_bytes in and out per received row. With NODE_SYNC the last program to finish tells every
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
        d.copy_row_words(expert_y_ptr, src_words, base_words, dst_words, is_row, Y_WORDS, BLOCK_W)
    if NODE_SYNC:
        if d.node_arrive(counter_ptr, USE_PTX):
            if tl.load(failed_ptr, volatile=True) == 0:
                if ABORT_BYTES > 0:
                    d.node_mark_aborted(base_ptr, peer_sync_bytes_ptr, ABORT_BYTES, aborted_ptr, epoch_ptr, rank,
                                        node_first, NODE)
                d.node_publish(base_ptr, peer_sync_bytes_ptr, READY_BYTES, epoch_ptr, flags_ptr, rank, node_first,
                               NODE, HAS_PROXY, PROXY_SIGNAL_WORD, USE_PTX)


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
    ITEM_BYTES: tl.constexpr,      # out_dtype itemsize
    ALIGN_ELEMS: tl.constexpr,     # row starts are multiples of this many elements (16 B when proven)
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_BOUND_M: tl.constexpr,
    ACCUMULATE: tl.constexpr,
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

    Reads up to K rows of BLOCK_H*itemsize bytes per token (its expert outputs) and writes one.
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
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = is_live[:, None] & (cols < H)[None, :]
    out_ptrs = out_tokens_ptr + tokens[:, None] * stride_out_t + cols[None, :]
    if ACCUMULATE:
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    if SPLIT:
        node_slot_lo = tl.load(node_slots_ptr)  # (not `node_first`: that names the node's first rank)
        node_slot_hi = tl.load(node_slots_ptr + 1)
    for k in range(K):  # k order: the fp32 sum is rounded exactly as in the reference
        slot = tl.load(route_slot_ptr + tokens * stride_slot_t + k * stride_slot_k,
                       mask=is_live, other=-1).to(tl.int64)
        has_slot = (slot >= 0) & (slot < MAX_SLOTS)
        w = tl.load(weights_ptr + tokens * stride_w_t + k * stride_w_k, mask=has_slot, other=0.0)
        if SPLIT:  # outputs of this node's experts were pushed into device memory, the others' staged
            row_bytes = tl.where((slot >= node_slot_lo) & (slot < node_slot_hi), recv_bytes, remote_recv_bytes) \
                + slot * SC_BYTES
        else:
            row_bytes = recv_bytes + slot * SC_BYTES
        row = tl.multiple_of(row_bytes // ITEM_BYTES, ALIGN_ELEMS)
        y = tl.load(base_y + row[:, None] + cols[None, :], mask=mask & has_slot[:, None], other=0.0)
        acc = tl.where(has_slot[:, None], acc + w[:, None] * y.to(tl.float32), acc)
    if y_ty == tl.bfloat16:
        tl.store(out_ptrs, _f32_to_bf16_rtne(acc), mask=mask)
    else:
        tl.store(out_ptrs, acc.to(y_ty), mask=mask)  # fp16: rtne on GPU and in the interpreter


def pack_combine_by_source(
    expert_y: torch.Tensor,
    counts: torch.Tensor,
    rank: int,
    base: torch.Tensor,
    peer_recv_bytes: torch.Tensor,
    stage_bytes: int,
    cfg: A2AConfig,
    layout: Layout,
    node: NodeSync | None = None,
) -> None:
    """Send every expert output row this rank computed back towards its home rank.

    Args:
        expert_y: `[R, H]` cfg.out_dtype, last stride 1, rows as `unpack_tokens_by_expert` laid them out
            (padding rows are not read).
        counts: `[W, E]` int32, the same routing matrix as the dispatch of this call (device or
            pinned host memory).
        rank: this rank.
        base: 1-D uint8 tensor, base of the byte address space of everything below.
        peer_recv_bytes: `[W]` int64: for a same-node home s (this rank included), the offset of s's
            recv buffer from base; `-1` for a remote home. Offsets are multiples of 16.
        stage_bytes: offset from base of this rank's combine staging area (its send buffer +
            `layout.combine_stage_offset_bytes`); rows for remote home s are staged contiguously at
            row `plan.combine_stage_offsets(n)[s]`, ready for `plan.combine_writes`.
        node: same-node synchronisation (`node_sync.NodeSync`): when given, the last program tells
            every same-node home (combine_ready = epoch) that its rows are in place.

    No host sync; CUDA-graph safe.
    """
    launch_wait_apart(node, "combine_send", base)  # a kernel of its own when the words are in host memory
    key = None
    if isinstance(expert_y, torch.Tensor) and expert_y.is_cuda:
        key = launch.key(expert_y, counts, rank, base, peer_recv_bytes, stage_bytes, cfg, layout, node)
        if _PACK_COMBINE.hit(key):
            return
    check.config(cfg)
    check.layout(layout, cfg)
    W, L, E = layout.world_size, layout.num_local_experts, cfg.num_experts
    check.tensor("expert_y", expert_y, dtypes=(cfg.out_dtype,), shape=(None, cfg.hidden_dim))
    device = expert_y.device
    R = expert_y.shape[0]
    check.counts(counts, W, E, device)
    check.integer("rank", rank, 0, W)
    check.tensor("base", base, dtypes=(torch.uint8,), shape=(None,), device=device)
    check.peer_table("peer_recv_bytes", peer_recv_bytes, W, device)
    check.integer("stage_bytes", stage_bytes)

    y_row_bytes = expert_y.stride(0) * expert_y.element_size() if R else 0
    word_bytes, word_dtype = launch.word_bytes(cfg.y_bytes, expert_y.data_ptr(), y_row_bytes, stage_bytes,
                                               base.data_ptr(), cfg.combine_stride_bytes)
    align = launch.align_words(word_bytes, expert_y.data_ptr(), y_row_bytes, stage_bytes, base.data_ptr())
    y_words = launch.as_words(expert_y, word_dtype)
    row_words = cfg.y_bytes // word_bytes
    block_w = launch.chunk_words(row_words, word_bytes)
    grid, block_r = launch.persistent_grid(device, layout)
    sync_args = {} if node is None else node.kernel_args("combine_send", device)
    _PACK_COMBINE.launch(
        key, grid, y_words, counts, base, peer_recv_bytes, stage_bytes, rank, R,
        counts.stride(0), y_words.stride(0) if R else row_words,
        W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L),
        PAD=cfg.expert_padding, Y_WORDS=row_words, SC_BYTES=cfg.combine_stride_bytes,
        COMBINE_RECV_BYTES=layout.combine_recv_offset_bytes, CAPACITY=layout.expert_capacity,
        WORD_BYTES=word_bytes, ALIGN_WORDS=align,
        BLOCK_R=block_r, BLOCK_W=block_w, BLOCK_E=min(next_power_of_2(E), 256),
        num_warps=launch.num_warps(block_r * block_w, word_bytes), **sync_args,
    )


def reduce_combined_tokens(
    out_tokens: torch.Tensor,
    route_slot: torch.Tensor,
    weights: torch.Tensor,
    recv_base: torch.Tensor,
    recv_offset_bytes: int,
    cfg: A2AConfig,
    accumulate: bool = False,
    bound_m: torch.Tensor | None = None,
    node: NodeSync | None = None,
    remote_recv_offset_bytes: int | None = None,
    node_slots: torch.Tensor | None = None,
) -> None:
    """out_tokens[t] = sum_k weights[t, k] * y(route_slot[t, k]) for t < bound_m, in place.

    Args:
        out_tokens: `[T, H]` cfg.out_dtype, last stride 1: out (and the first addend when accumulate).
        route_slot: `[T, K]` int32/int64, the dispatch send slots (`-1` = not routed); the expert
            output of route (t, k) is the row at `recv + route_slot[t, k] * cfg.combine_stride_bytes`.
        weights: `[T, K]` float32 (any strides); weights of masked routes are not read.
        recv_base: 1-D uint8 tensor, base of the byte address space.
        recv_offset_bytes: offset of this rank's recv buffer from recv_base.
        accumulate: add to the old out_tokens[t] (first, then k = 0..K-1) instead of overwriting.
        bound_m: optional `[1]` int32 on out_tokens' device: tokens t >= bound_m[0] are not touched.
        node: same-node synchronisation (`node_sync.NodeSync`): when given, every program first waits
            until each same-node expert rank pushed this epoch's rows (combine_ready); it then launches
            even for T = 0.
        remote_recv_offset_bytes, node_slots: only remote rows staged: rows of slots in
            `[node_slots[0], node_slots[1])` (`[2]` int32, from `route_tokens`) are read at
            `recv_offset_bytes`, every other slot's at `remote_recv_offset_bytes`. Both or neither.

    Accumulates in fp32 in k order and casts once (round to nearest even). No host sync; CUDA-graph
    safe.
    """
    launch_wait_apart(node, "combine_recv", recv_base)  # a kernel of its own when the words are in host memory
    key = None
    if isinstance(out_tokens, torch.Tensor) and out_tokens.is_cuda:
        key = launch.key(out_tokens, route_slot, weights, recv_base, recv_offset_bytes, cfg, accumulate, bound_m, node,
                         remote_recv_offset_bytes, node_slots)
        if _REDUCE.hit(key):
            return
    check.config(cfg)
    check.tensor("out_tokens", out_tokens, dtypes=(cfg.out_dtype,), shape=(None, cfg.hidden_dim))
    device = out_tokens.device
    T, K, H = out_tokens.shape[0], cfg.experts_per_token, cfg.hidden_dim
    if T > cfg.max_num_tokens:
        check.fail("out_tokens", f"at most max_num_tokens={cfg.max_num_tokens} rows", str(T))
    check.tensor("route_slot", route_slot, dtypes=(torch.int32, torch.int64), shape=(T, K), device=device,
                 strides="any")
    check.tensor("weights", weights, dtypes=(torch.float32,), shape=(T, K), device=device, strides="any")
    check.tensor("recv_base", recv_base, dtypes=(torch.uint8,), shape=(None,), device=device)
    check.integer("recv_offset_bytes", recv_offset_bytes)
    if not isinstance(accumulate, bool):
        check.fail("accumulate", "a bool", repr(accumulate))
    check.bound_m(bound_m, device)
    split = check.split("remote_recv_offset_bytes", remote_recv_offset_bytes, node_slots, device)
    remote = remote_recv_offset_bytes if split else recv_offset_bytes
    item = cfg.out_itemsize
    # Rows are read as out_dtype elements at base + offset: both must be element-aligned.
    for name, off in (("recv_offset_bytes", recv_offset_bytes), ("remote_recv_offset_bytes", remote)):
        if off % item:
            check.fail(name, f"a multiple of out itemsize {item}", str(off))
    if recv_base.data_ptr() % item:
        check.fail("recv_base", f"data_ptr aligned to {item} bytes", hex(recv_base.data_ptr()))
    if T == 0 and node is None:
        return

    align = launch.align_words(item, out_tokens.data_ptr(), out_tokens.stride(0) * item, recv_base.data_ptr(),
                               recv_offset_bytes, remote)
    block_h = min(next_power_of_2(H), MAX_REDUCE_BLOCK_H)
    block_t = launch.tokens_per_program(device, T)
    grid = (max(1, ceil_div(T, block_t)), ceil_div(H, block_h))
    sync_args = {} if node is None else node.kernel_args("combine_recv", device)
    if split:
        sync_args = {**sync_args, "node_slots_ptr": node_slots, "remote_recv_bytes": remote_recv_offset_bytes,
                     "SPLIT": True}
    _REDUCE.launch(
        key, grid, out_tokens, route_slot, weights, recv_base, bound_m if bound_m is not None else route_slot,
        recv_offset_bytes, T,
        out_tokens.stride(0), route_slot.stride(0), route_slot.stride(1), weights.stride(0), weights.stride(1),
        K=K, MAX_SLOTS=cfg.max_routes, H=H, SC_BYTES=cfg.combine_stride_bytes, ITEM_BYTES=item,
        ALIGN_ELEMS=align, BLOCK_T=block_t, BLOCK_H=block_h, HAS_BOUND_M=bound_m is not None, ACCUMULATE=accumulate,
        num_warps=launch.num_warps(block_t * block_h, item), **sync_args,
    )


_PACK_COMBINE = launch.LaunchCache(_pack_expert_outputs_by_source_kernel)
_REDUCE = launch.LaunchCache(_reduce_combined_tokens_kernel)

__all__ = ["pack_combine_by_source", "reduce_combined_tokens"]
