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

With `cfg.combine_fp8` the pack quantises each row into its slot instead of copying it (fp8 e4m3 bytes,
then one fp32 scale per 128 elements at `cfg.combine_scale_offset_bytes`) and the reduce dequantises
each row it reads (fp32(q) * scale) before the same weighted sum: `reference.combine_fp8`, bitwise in
the interpreter. Slots are `cfg.combine_stride_bytes` apart either way, so nothing else changes.
"""
from __future__ import annotations

import torch

from ..config import COMBINE_FP8_BLOCK, A2AConfig, Layout, ceil_div, next_power_of_2
from . import _checks as check
from . import _launch as launch
from .node_sync import NodeSync, launch_wait_apart
from ._combine_kernels import _pack_combine_by_source_kernel, _reduce_combined_tokens_kernel

# Hidden elements per program of the reduce: 1024 bf16 = 2 KB per route row per program.
MAX_REDUCE_BLOCK_H = 1024
# fp8 pack on a GPU: elements of expert_y quantised per step of a tile (BLOCK_R rows x G scale groups), in
# fp32 registers: 4096 = 16 per thread at 8 warps (not tuned on a GPU). The interpreter takes whole chunks.
MAX_FP8_TILE_ELEMS = 4096


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
            (padding rows are not read); or `[L, C, H]` whose two first dimensions merge into rows
            (`stride(0) == C * stride(1)`: what `view(-1, H)` takes). With cfg.combine_fp8 each row is
            quantised into its slot.
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
    if isinstance(expert_y, torch.Tensor) and expert_y.dim() == 3:  # [L, C, H]: its rows, as one run
        expert_y = expert_y.view(-1, expert_y.shape[2])
    W, L, E, device, R = check.expert_rows("expert_y", expert_y, cfg.out_dtype, cfg, layout)
    check.counts(counts, W, E, device)
    check.integer("rank", rank, 0, W)
    check.tensor("base", base, dtypes=(torch.uint8,), shape=(None,), device=device)
    check.peer_table("peer_recv_bytes", peer_recv_bytes, W, device)
    check.integer("stage_bytes", stage_bytes)

    grid, block_r = launch.persistent_grid(device, layout)
    fp8_args = {}
    if cfg.combine_fp8:
        # expert_y is read in elements, the slots written in bytes; a step is G whole scale groups (the
        # tile holds one row per (row, group)), as many bytes of expert_y as a copy chunk.
        if stage_bytes % 4 or base.data_ptr() % 4:  # the fp32 scales are stored as words
            check.fail("stage_bytes", "a multiple of 4 from a 4-byte aligned base", str(stage_bytes))
        word_bytes, y_words, row_words = 1, expert_y, cfg.hidden_dim
        align = launch.align_words(1, stage_bytes, base.data_ptr())
        block_w = max(COMBINE_FP8_BLOCK, launch.chunk_words(row_words, expert_y.element_size()))
        if device.type == "cuda":
            block_w = max(COMBINE_FP8_BLOCK, min(block_w, MAX_FP8_TILE_ELEMS // block_r))
        fp8_args = dict(FP8=True, G=block_w // COMBINE_FP8_BLOCK, Q_BLOCK=COMBINE_FP8_BLOCK,
                        SCALE_OFFSET_BYTES=cfg.combine_scale_offset_bytes, FP8_VIA_BITS=device.type != "cuda")
        warps = launch.num_warps(block_r * block_w, expert_y.element_size())
    else:
        y_row_bytes = expert_y.stride(0) * expert_y.element_size() if R else 0
        word_bytes, word_dtype = launch.word_bytes(cfg.y_bytes, expert_y.data_ptr(), y_row_bytes, stage_bytes,
                                                   base.data_ptr(), cfg.combine_stride_bytes)
        align = launch.align_words(word_bytes, expert_y.data_ptr(), y_row_bytes, stage_bytes, base.data_ptr())
        y_words = launch.as_words(expert_y, word_dtype)
        row_words = cfg.y_bytes // word_bytes
        block_w = launch.chunk_words(row_words, word_bytes)
        warps = launch.num_warps(block_r * block_w, word_bytes)
    sync_args = {} if node is None else node.kernel_args("combine_send", device)
    _PACK_COMBINE.launch(
        key, grid, y_words, counts, base, peer_recv_bytes, stage_bytes, rank, R,
        counts.stride(0), y_words.stride(0) if R else row_words,
        W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L),
        PAD=cfg.expert_padding, Y_WORDS=row_words, SC_BYTES=cfg.combine_stride_bytes,
        COMBINE_RECV_BYTES=layout.combine_recv_offset_bytes, CAPACITY=layout.expert_capacity,
        WORD_BYTES=word_bytes, ALIGN_WORDS=align,
        BLOCK_R=block_r, BLOCK_W=block_w, BLOCK_E=min(next_power_of_2(E), 256),
        num_warps=warps, **fp8_args, **sync_args,
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
            output of route (t, k) is the row at `recv + route_slot[t, k] * cfg.combine_stride_bytes`
            (with cfg.combine_fp8: fp8 bytes and fp32 scales, dequantised before the sum).
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
    # Rows are read as out_dtype elements at base + offset (fp8: the scales as fp32 words): both must be
    # aligned to them.
    need = 4 if cfg.combine_fp8 else item
    what = "4 (the fp8 rows' fp32 scales)" if cfg.combine_fp8 else f"out itemsize {item}"
    for name, off in (("recv_offset_bytes", recv_offset_bytes), ("remote_recv_offset_bytes", remote)):
        if off % need:
            check.fail(name, f"a multiple of {what}", str(off))
    if recv_base.data_ptr() % need:
        check.fail("recv_base", f"data_ptr aligned to {need} bytes", hex(recv_base.data_ptr()))
    if T == 0 and node is None:
        return

    align = launch.align_words(item, out_tokens.data_ptr(), out_tokens.stride(0) * item, recv_base.data_ptr(),
                               recv_offset_bytes, remote)
    fp8_args = {}
    if cfg.combine_fp8:  # rows addressed in bytes
        align = launch.align_words(1, recv_base.data_ptr(), recv_offset_bytes, remote)
        fp8_args = dict(FP8=True, Q_BLOCK=COMBINE_FP8_BLOCK, SCALE_OFFSET_BYTES=cfg.combine_scale_offset_bytes,
                        FP8_VIA_BITS=device.type != "cuda")
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
        K=K, MAX_SLOTS=cfg.max_routes, H=H, SC_BYTES=cfg.combine_stride_bytes,
        ITEM_BYTES=1 if cfg.combine_fp8 else item, ALIGN_ELEMS=align, BLOCK_T=block_t, BLOCK_H=block_h,
        HAS_BOUND_M=bound_m is not None, ACCUMULATE=accumulate,
        num_warps=launch.num_warps(block_t * block_h, item), **fp8_args, **sync_args,
    )


_PACK_COMBINE = launch.LaunchCache(_pack_combine_by_source_kernel)
_REDUCE = launch.LaunchCache(_reduce_combined_tokens_kernel)

__all__ = ["pack_combine_by_source", "reduce_combined_tokens"]
