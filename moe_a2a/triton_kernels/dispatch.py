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

from ..config import A2AConfig, Layout, ceil_div, next_power_of_2
from ..protocol.words import Flag, flag_word
from . import _checks as check
from . import _launch as launch
from .node_sync import NodeSync, launch_wait_apart
from .quant import Fp8Quantize, check_fused_quantize
from ._dispatch_kernels import _pack_tokens_by_expert_kernel, _unpack_tokens_by_expert_kernel


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
    row_meta: dict | None = None,
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
            staging rows after them: `layout.send_rows + layout.private_stage_rows`.
        row_meta: per-rank rows (`route_slot` = the row each route opens): `rank_rows.row_meta_args(...)`, so the
            pack also writes every row's metadata after its scales (what peers expand the row by).

    Slot j is written at `send + j*Sd` (payload) and `send + j*Sd + cfg.dispatch_scale_offset_bytes`
    (scales); bytes between payload and scales are not touched. No host sync; CUDA-graph safe.
    """
    launch_wait_apart(node, "dispatch_send", send_base)  # a kernel of its own when the words are in host memory
    if isinstance(quantize, dict):  # hashable for the launch key (an Fp8Quantize is checked after a miss)
        quantize = check_fused_quantize("quantize", quantize, cfg)
    key = None
    if isinstance(x, torch.Tensor) and x.is_cuda:
        key = launch.key(x, x_scale, route_slot, send_base, send_offset_bytes, cfg, bound_m, node,
                         remote_send_offset_bytes, node_slots, quantize, max_slots,
                         *(() if row_meta is None else row_meta.values()))
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
    check.integer("max_slots", max_slots, 0)
    if row_meta is not None and not row_meta.get("RANK_META"):
        check.fail("row_meta", "rank_rows.row_meta_args(...) (per-rank rows' metadata)", str(sorted(row_meta)))
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
        # Warps by the fp8 bytes stored, not the bf16 read: one 16-byte store a thread a route (2 warps a
        # 1024-element chunk; by the bytes read, 8-byte stores were 1.5 µs slower a facade pair, docs/perf-notes.md).
        warps = launch.num_warps(block_t * block_w, 1)
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
        num_warps=warps, **quant_args, **sync_args, **(row_meta or {}),
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
    quantize: "Fp8Quantize | dict | None" = None,
    out_quantized_scale: torch.Tensor | None = None,
) -> None:
    """Copy every row sent to this rank into the expert-major dispatch output (`reference.dispatch`).

    Args:
        out_expert_num_tokens: `[L]` int32, out: rows per local expert.
        out_expert_x: `[R, H]` cfg.in_dtype, last stride 1, out. Expert l's rows start at
            sum_{j<l} round_up(num_tokens[j], expert_padding), ordered by (source, token, k). Padding
            rows and rows past the received ones are not written; R >= layout.max_dispatch_rows
            guarantees room (a row past R is dropped, never written out of bounds).
        out_expert_x_scale: `[R, num_scales]` float32 (any strides) when cfg.has_scales, else None. With
            `cfg.expert_capacity` C it may also be `[L, C, num_scales]` float32 of any strides (row l*C + c's
            scales go to `[l, c, :]`), e.g. DeepEP's column-major scale layout, written without a copy.
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
        quantize, out_quantized_scale: both or neither. `quantize` as the senders' pack was given it (a
            fused fp8 quantisation, `quant.Fp8Quantize`): each row's scale words (from byte
            `quantize.scale_offset_bytes` of its payload: fp32 scales, or UE8M0 codes four per int32) also
            go to `out_quantized_scale`, `[R, n]` float32/int32 of any strides (n = scale_bytes(H) / 4) or, with
            `cfg.expert_capacity`, `[L, C, n]` of any strides (DeepEP's column-major scales, no copy after).
            Bit-exact; rows past the received ones are not written. `copy_bytes` may then stop at H.

    Every offset is computed on the device from `counts`: no host sync, CUDA-graph safe.
    """
    launch_wait_apart(node, "dispatch_recv", base)  # a kernel of its own when the words are in host memory
    key = None
    if isinstance(out_expert_x, torch.Tensor) and out_expert_x.is_cuda:
        if isinstance(quantize, dict):  # hashable for the launch key (checked after a miss)
            quantize = check_fused_quantize("quantize", quantize, cfg)
        key = launch.key(out_expert_num_tokens, out_expert_x, out_expert_x_scale, counts, rank, base, peer_send_bytes,
                         recv_bytes, cfg, layout, node, copy_bytes, out_source_ranges, quantize, out_quantized_scale)
        if _UNPACK.hit(key):
            return
    W, L, E, device, R = check.expert_rows("out_expert_x", out_expert_x, cfg.in_dtype, cfg, layout)
    check.tensor("out_expert_num_tokens", out_expert_num_tokens, dtypes=(torch.int32,), shape=(L,),
                 device=device)
    C = layout.expert_capacity
    if cfg.has_scales:
        stride_scale = scale_output_strides("out_expert_x_scale", out_expert_x_scale, cfg.num_scales,
                                            (torch.float32,), R, L, C, device)
    elif out_expert_x_scale is not None:
        check.fail("out_expert_x_scale", "None (this config has no scales)", "a tensor")
    else:
        stride_scale = (0, 0, 0)
    quant_args = {}
    if (quantize is None) != (out_quantized_scale is None):
        given = "a tensor" if out_quantized_scale is not None else None
        check.fail("out_quantized_scale", "given together with quantize (both or neither)",
                   f"quantize={quantize!r}, out_quantized_scale={given}")
    if quantize is not None:
        quantize = check_fused_quantize("quantize", quantize, cfg)
        q_words = quantize.scale_bytes(cfg.hidden_dim) // 4
        stride_q = scale_output_strides("out_quantized_scale", out_quantized_scale, q_words,
                                        (torch.float32, torch.int32), R, L, C, device)
        quant_args = dict(out_qscale_ptr=out_quantized_scale.view(torch.int32), stride_out_qscale_r=stride_q[0],
                          stride_out_qscale_s=stride_q[1], stride_out_qscale_e=stride_q[2],
                          Q_SCALE_WORD=quantize.scale_offset_bytes // 4, Q_WORDS=q_words)
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
    # Outputs whose rows are adjacent words (DeepEP's column-major scales) take per-expert tiles of their own.
    by_expert = dict(SCALES_BY_EXPERT=bool(C and cfg.has_scales and stride_scale[0] == 1),
                     QSCALES_BY_EXPERT=bool(C and quant_args and stride_q[0] == 1),
                     BLOCK_SC=min(next_power_of_2(S), 64) if cfg.has_scales else 1,
                     BLOCK_QC=min(next_power_of_2(quant_args.get("Q_WORDS", 1)), 64))
    grid, block_r = launch.persistent_grid(device, layout)
    sync_args = {} if node is None else node.kernel_args("dispatch_recv", device)
    _UNPACK.launch(
        key, grid, out_expert_num_tokens, x_words, scale_i32, counts, base, peer_send_bytes, recv_bytes, rank, R,
        counts.stride(0), x_words.stride(0) if R else row_words, *stride_scale,
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
        HAS_RANGES=out_source_ranges is not None, **quant_args, **sync_args, **by_expert,
    )


def scale_output_strides(name: str, t, cols: int, dtypes: tuple, R: int, L: int, C: int,
                         device) -> tuple[int, int, int]:
    """Check a scale output of unpack, `[R, cols]` or (with expert capacity C) `[L, C, cols]`, any strides;
    return its strides in elements as `(row, column, expert)`: row l*C + c's column s is at
    `l * expert + c * row + s * column` (a 2-D tensor's expert stride is C rows: the same address)."""
    is_3d = isinstance(t, torch.Tensor) and t.dim() == 3
    if is_3d and not C:
        check.fail(name, f"a [{R}, {cols}] tensor (a 3-D [L, C, {cols}] one needs A2AConfig.expert_capacity C)",
                   f"shape {list(t.shape)}")
    check.tensor(name, t, dtypes=dtypes, shape=(L, C, cols) if is_3d else (R, cols), device=device, strides="any")
    if is_3d:
        return t.stride(1), t.stride(2), t.stride(0)
    return t.stride(0), t.stride(1), C * t.stride(0)


_PACK = launch.LaunchCache(_pack_tokens_by_expert_kernel)
_UNPACK = launch.LaunchCache(_unpack_tokens_by_expert_kernel)

__all__ = ["pack_tokens_by_expert", "unpack_tokens_by_expert"]
