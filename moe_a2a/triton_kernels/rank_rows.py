"""Per-rank rows: a token crosses to a rank once, however many of its experts live there.

With `A2AConfig(dispatch_rows="rank")` the dispatch sends one row per (token, destination rank) instead of
one per route (token, k) (`reference.dispatch_per_rank`); with `combine_rows="rank"` the combine sums a
token's expert outputs on the experts' rank and sends one row back per (token, rank)
(`reference.combine_reduced_at_sender`). Rows, counts and slots come from the same deterministic routing
as route rows (`routing.route_tokens`, run a second time over "the rank of each token's first route
there"), so nothing here uses atomics and every output is the same run to run.

- `route_tokens_by_rank` (send half): `route_tokens` keyed by the rank of each token's first route there
  (`rank_keys`): rows per destination rank (the count row's last W ints, `Layout.count_row_ints`) and each
  row's rank-major slot.
- `row_meta_args` (send half): the pack's arguments that make it write each row's metadata after its scales:
  per k the local expert (or -1) and the route's position among this rank's routes to it, and the weights for
  a sender-side reduce. The payload is packed by `dispatch.pack_tokens_by_expert` at these rows.
- `expand_rank_rows` (recv half): every received row read once and written to each expert row it names:
  the same expert-major output, in the same order, as `dispatch.unpack_tokens_by_expert`; with an
  `out_row_plan`, those expert rows of each received row too, for the combine.
- `reduce_rank_rows_by_source` (combine send, `combine_rows="rank"`): per received row the weighted sum of
  its experts' outputs (their rows from the row plan), in fp32 in k order, rounded once, into the home's recv
  buffer at its row's slot.
- `reduce_rank_rows_by_token` (combine recv): per token the sum of its rows in ascending rank order.

Across nodes the rows take the route rows' paths (docs/protocol.md): a remote peer's first P rows in the
private write behind the count row (which carries the W rows per rank), the rest in the remainder write;
the write plans count rows per rank (`write_plan`, `RANK_ROWS`), and with `combine_rows="rank"` the combine
writes too. Shrink mode is refused with per-rank rows (its masks drop routes, not rows), for now.
"""
from __future__ import annotations

import torch

from ..config import COMBINE_FP8_BLOCK, A2AConfig, Layout, ceil_div, next_power_of_2
from ..protocol.words import Flag, flag_word
from . import _checks as check
from . import _launch as launch
from .combine import MAX_REDUCE_BLOCK_H
from .dispatch import scale_output_strides
from .node_sync import NodeSync, launch_wait_apart
from .quant import Fp8Quantize, check_fused_quantize
from .routing import route_tokens
from ._rank_rows_kernels import (_expand_rank_rows_kernel, _reduce_rank_rows_by_source_kernel,
                                 _reduce_rank_rows_by_token_kernel)

# Rows per tile (decode-sized, prefill-sized layouts) of the per-rank rows' persistent kernels: fewer rows than
# routes, so smaller tiles than the route rows' (swept on the H200: docs/perf-notes.md, "Tiles of the per-rank").
EXPAND_ROWS_PER_TILE = (2, 16)
REDUCE_ROWS_PER_TILE = (2, 8)
# The reduce by source reads the expert rows the expand wrote (`row_plan`) instead of building the pair tables
# in every program; False: it rebuilds them (the A/B of `benchmarks/gpu/sweep_launch.py reduce-setup`).
REDUCE_FROM_PLAN = True
# Chunks of the hidden dimension (BLOCK_H each) one program of the reduces walks for a row tile: 1 puts each chunk
# in a program of its own (the most loads in flight, the tile's set-up repeated per chunk); more share the set-up.
# 4 measured fastest of 1 / 4 / 14 on the H100 (docs/perf-notes.md, "Where the reduce by source loses").
REDUCE_H_CHUNKS = 4


def _key(first: torch.Tensor, *rest):
    """The remembered-launch key of a launcher's arguments (`_launch.LaunchCache`): CUDA launches only."""
    return launch.key(first, *rest) if isinstance(first, torch.Tensor) and first.is_cuda else None


def _fp8_args(cfg: A2AConfig, device: torch.device) -> dict:
    """Kernel arguments of fp8 combine rows (`A2AConfig.combine_fp8`; `_details.py`'s fp8 helpers)."""
    if not cfg.combine_fp8:
        return {}
    return dict(FP8=True, Q_BLOCK=COMBINE_FP8_BLOCK, SCALE_OFFSET_BYTES=cfg.combine_scale_offset_bytes,
                FP8_VIA_BITS=device.type != "cuda")


def _relay_recv_args(layout: Layout, peer_recv_bytes: torch.Tensor | None, device: torch.device) -> dict:
    """Kernel arguments of a receiver's relay walk (`layout.relay`): the node peers' recv buffers."""
    if not layout.relay:
        if peer_recv_bytes is not None:
            check.fail("peer_recv_bytes", "None (layout.relay is False)", "a tensor")
        return {}
    check.peer_table("peer_recv_bytes", peer_recv_bytes, layout.world_size, device)
    return dict(peer_recv_bytes_ptr=peer_recv_bytes, RELAY=True, NODE_SIZE=layout.node_size)


def _check_rank_layout(cfg: A2AConfig, layout: Layout) -> tuple[int, int]:
    check.config(cfg)
    check.layout(layout, cfg)
    if not cfg.rank_rows or not layout.rank_rows:
        check.fail("cfg", "dispatch_rows='rank' (per-rank rows)", f"dispatch_rows={cfg.dispatch_rows!r}")
    return layout.world_size, layout.num_local_experts


def route_tokens_by_rank(indices: torch.Tensor, layout: Layout, out_rank_rows: torch.Tensor,
                         out_rank_slot: torch.Tensor, bound_m: torch.Tensor | None = None, abort: bool = False,
                         rank: int | None = None, **routing_args) -> None:
    """Rows per destination rank and the row each route opens: `route_tokens` keyed by the rank of each
    token's first route there (`route_tokens(rank_keys=)`: the keys are made in its own launches).

    Args:
        indices: `[T, K]` int32/int64, contiguous, -1 = not routed (as `route_tokens`; out-of-range values
            are dead here and reported by the routing of the routes).
        out_rank_rows: `[W]` int32 (any stride: this rank's count row's last W ints): rows to each rank.
        out_rank_slot: `[T, K]` int32, contiguous: for the first live route of token t to rank r, the row of
            (t, r) in the rank-major send order (`psum_excl(rank_rows)[r]` + earlier tokens to r); -1 for
            every other route.
        bound_m, abort: as `route_tokens`; `routing_args`: its `out_node_slots` / `node_experts` (here this
            node's ranks) and `out_send_row` / `private_stage` (remote peers' first rows staged privately).
        rank: this rank, needed with `layout.relay`: a route to another node's expert then opens the row of (t,
            this rank's relay on that node), so rows to ranks of other nodes go to relays only (one per (token, node)).
    No host sync; CUDA-graph safe. One or two launches, as `route_tokens`."""
    route_tokens(indices, layout.world_size, out_counts=out_rank_rows, out_route_slot=out_rank_slot, bound_m=bound_m,
                 abort=abort, rank_keys=(layout, rank), **routing_args)


def _relay_args(layout: Layout, rank: int | None) -> dict:
    """Kernel arguments of the send half's relay mapping (`layout.relay`; nothing otherwise)."""
    if not layout.relay:
        return {}
    check.integer("rank", rank, 0, layout.world_size)
    return dict(sender=rank, RELAY=True, NODE_SIZE=layout.node_size)


def row_meta_args(indices: torch.Tensor, route_slot: torch.Tensor, counts: torch.Tensor,
                  weights: torch.Tensor | None, cfg: A2AConfig, layout: Layout, rank: int | None = None) -> dict:
    """The pack's arguments (`dispatch.pack_tokens_by_expert(row_meta=)`) that make it write the metadata of
    every row this rank sends (`A2AConfig.rank_meta_offset_bytes`, after the scales): per k, the local expert
    of route k when it goes to the row's rank (else -1) and its position among this rank's routes to that
    expert; with `cfg.combine_rows == "rank"` also the K weights. The pack's chunk-0 programs write it before
    the pack publishes the rows, so it costs no launch of its own.

    Args:
        indices, route_slot: `[T, K]` as given to and returned by `route_tokens` (expert-major slots).
        counts: `[E]` int32, this rank's count row (any stride).
        weights: `[T, K]` float32 (any strides) when `cfg.combine_rows == "rank"`, else None.
        rank: this rank, needed with `layout.relay`: a row to a relay (another node) then names per k the
            node-local expert (`expert - first expert of the relay's node`) of each route to that node.
    The pack's `route_slot` is then the row each route opens (`route_tokens_by_rank`: -1 for every other
    route), its slot or with remote peers its send row (`route_tokens(out_send_row=)`)."""
    key = _key(indices, route_slot, counts, weights, cfg, layout, rank)
    if key is not None and key in _ROW_META:  # checked once per set of arguments, as a remembered launch
        return _ROW_META[key]
    W, L = _check_rank_layout(cfg, layout)
    T, K = indices.shape
    device = indices.device
    with_weights = cfg.combine_rows == "rank"
    check.tensor("indices", indices, dtypes=(torch.int32, torch.int64), shape=("T", "K"), strides="contiguous")
    if with_weights:
        check.tensor("weights", weights, dtypes=(torch.float32,), shape=(T, K), device=device, strides="any")
    elif weights is not None:
        check.fail("weights", "None (combine_rows='route': the weights stay home)", "a tensor")
    check.tensor("route_slot", route_slot, dtypes=(torch.int32,), shape=(T, K), device=device, strides="contiguous")
    E = layout.num_experts
    check.tensor("counts", counts, dtypes=(torch.int32,), shape=(E,), device=device, host_ok=True, strides="any")
    relay = _relay_args(layout, rank)
    args = dict(meta_indices_ptr=indices, meta_slot_ptr=route_slot, meta_counts_ptr=counts,
                meta_weights_ptr=weights if with_weights else counts, meta_num_experts=E,
                meta_stride_counts=counts.stride(0), meta_stride_w_t=weights.stride(0) if with_weights else 0,
                meta_stride_w_k=weights.stride(1) if with_weights else 0, meta_sender=relay.get("sender", 0),
                META_OFFSET_BYTES=cfg.rank_meta_offset_bytes, META_K_PAD=next_power_of_2(K), META_L=L,
                META_E_PAD=next_power_of_2(E), META_WEIGHTS=with_weights, META_RELAY=relay.get("RELAY", False),
                META_NODE=relay.get("NODE_SIZE", 1), RANK_META=True)
    if key is not None:
        if len(_ROW_META) > 64:
            _ROW_META.clear()
        _ROW_META[key] = args
    return args


def expand_rank_rows(out_expert_num_tokens: torch.Tensor, out_expert_x: torch.Tensor,
                     out_expert_x_scale: torch.Tensor | None, counts: torch.Tensor, rank_rows: torch.Tensor,
                     rank: int, base: torch.Tensor, peer_send_bytes: torch.Tensor, recv_bytes: int, cfg: A2AConfig,
                     layout: Layout, node: NodeSync | None = None, copy_bytes: int | None = None,
                     out_source_ranges: torch.Tensor | None = None, peer_recv_bytes: torch.Tensor | None = None,
                     quantize: "Fp8Quantize | dict | None" = None,
                     out_quantized_scale: torch.Tensor | None = None,
                     out_row_plan: torch.Tensor | None = None) -> None:
    """The receive half of per-rank dispatch rows: `unpack_tokens_by_expert`'s outputs (same rows, same
    order, `reference.dispatch`), each received row read once and written to every expert row it names.

    Args: as `dispatch.unpack_tokens_by_expert` (scales `[R, num_scales]`; `quantize` and `out_quantized_scale`,
    both or neither, as there: each row's scale words also to `[R, n]` or `[L, C, n]` of any strides, written
    row by row at every expert row the row names; a node peer's rows are pulled from
    its send buffer, a remote source's are in this rank's recv buffer at `recv_bytes`, its private slot then
    its remainder run), plus `rank_rows`: `[W, W]` int32, row s = rows source s sends to each rank (the count
    rows' last W ints). With `layout.relay`, `peer_recv_bytes`: `[W]` int64, the node peers' recv buffers from
    `base` (this rank's too; -1: remote): a remote source's rows are all the rows it sent its relay on this node,
    in that relay's recv buffer (its private slot, then its run of the relay geometry,
    `plan.relay_remainder_offsets`), and only those with a route here are read past their metadata.
    `out_row_plan`: `[layout.max_recv_rank_rows, K]` int32, contiguous, or None: row q's K output rows (-1:
    none), received rows numbered source-major, for `reduce_rank_rows_by_source(row_plan=)` of this call.
    No host sync; CUDA-graph safe."""
    launch_wait_apart(node, "dispatch_recv", base)
    if isinstance(quantize, dict):  # hashable for the launch key
        quantize = check_fused_quantize("quantize", quantize, cfg)
    key = _key(out_expert_num_tokens, out_expert_x, out_expert_x_scale, counts, rank_rows, rank, base, peer_send_bytes,
               recv_bytes, cfg, layout, node, copy_bytes, out_source_ranges, peer_recv_bytes, quantize,
               out_quantized_scale, out_row_plan)
    if key is not None and _EXPAND.hit(key):
        return
    W, L = _check_rank_layout(cfg, layout)
    E = layout.num_experts
    check.tensor("out_expert_x", out_expert_x, dtypes=(cfg.in_dtype,), shape=(None, cfg.hidden_dim))
    device, R = out_expert_x.device, out_expert_x.shape[0]
    check.tensor("out_expert_num_tokens", out_expert_num_tokens, dtypes=(torch.int32,), shape=(L,), device=device)
    if cfg.has_scales:
        check.tensor("out_expert_x_scale", out_expert_x_scale, dtypes=(torch.float32,), shape=(R, cfg.num_scales),
                     device=device, strides="any")
    elif out_expert_x_scale is not None:
        check.fail("out_expert_x_scale", "None (this config has no scales)", "a tensor")
    check.counts(counts, W, E, device)
    check.tensor("rank_rows", rank_rows, dtypes=(torch.int32,), shape=(W, W), device=device, host_ok=True)
    check.integer("rank", rank, 0, W)
    check.peer_table("peer_send_bytes", peer_send_bytes, W, device)
    check.integer("recv_bytes", recv_bytes)
    if out_source_ranges is not None:
        check.tensor("out_source_ranges", out_source_ranges, dtypes=(torch.int64,), shape=(L, W), device=device,
                     strides="contiguous")
    relay = _relay_recv_args(layout, peer_recv_bytes, device)
    plan_args = {}
    if out_row_plan is not None:
        check.tensor("out_row_plan", out_row_plan, dtypes=(torch.int32,),
                     shape=(layout.max_recv_rank_rows, cfg.experts_per_token), device=device, strides="contiguous")
        plan_args = dict(row_plan_ptr=out_row_plan, HAS_PLAN=True)
    quant_args = {}
    if (quantize is None) != (out_quantized_scale is None):
        given = "a tensor" if out_quantized_scale is not None else None
        check.fail("out_quantized_scale", "given together with quantize (both or neither)",
                   f"quantize={quantize!r}, out_quantized_scale={given}")
    if quantize is not None:  # addressed as the route rows' unpack addresses it (its per-row path)
        quantize = check_fused_quantize("quantize", quantize, cfg)
        q_words = quantize.scale_bytes(cfg.hidden_dim) // 4
        stride_q = scale_output_strides("out_quantized_scale", out_quantized_scale, q_words,
                                        (torch.float32, torch.int32), R, L, layout.expert_capacity, device)
        quant_args = dict(out_qscale_ptr=out_quantized_scale.view(torch.int32), stride_out_qscale_r=stride_q[0],
                          stride_out_qscale_s=stride_q[1], stride_out_qscale_e=stride_q[2],
                          Q_SCALE_WORD=quantize.scale_offset_bytes // 4, Q_WORDS=q_words)
    out_row_bytes = out_expert_x.stride(0) * out_expert_x.element_size() if R else 0
    word_bytes, word_dtype = launch.word_bytes(cfg.x_bytes, out_expert_x.data_ptr(), out_row_bytes, base.data_ptr(),
                                               recv_bytes, layout.private_offset_bytes, cfg.dispatch_stride_bytes)
    align = launch.align_words(word_bytes, out_expert_x.data_ptr(), out_row_bytes, base.data_ptr(), recv_bytes)
    x_words = launch.as_words(out_expert_x, word_dtype)
    row_words = cfg.x_bytes // word_bytes
    copy_words = row_words if copy_bytes is None else min(row_words, ceil_div(copy_bytes, word_bytes))
    block_w = launch.chunk_words(copy_words, word_bytes)
    scale_i32 = out_expert_x_scale.view(torch.int32) if cfg.has_scales else x_words
    stride_scale = out_expert_x_scale.stride() if cfg.has_scales else (0, 0)
    grid, block_r = launch.persistent_grid(device, layout, EXPAND_ROWS_PER_TILE)
    sync_args = {} if node is None else node.kernel_args("dispatch_recv", device)
    _EXPAND.launch(
        key, grid, out_expert_num_tokens, x_words, scale_i32, counts, rank_rows, base, peer_send_bytes, recv_bytes,
        rank, R, counts.stride(0), rank_rows.stride(0), x_words.stride(0) if R else row_words, stride_scale[0],
        stride_scale[1], P=layout.private_rows, HEADER_ROWS=layout.header_rows,
        PRIVATE_OFFSET_BYTES=layout.private_offset_bytes, W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L), K=cfg.experts_per_token,
        K_PAD=next_power_of_2(cfg.experts_per_token), PAD=cfg.expert_padding, X_WORDS=copy_words, S=cfg.num_scales,
        SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes, META_OFFSET_BYTES=cfg.rank_meta_offset_bytes,
        SD_BYTES=cfg.dispatch_stride_bytes, WORD_BYTES=word_bytes, ALIGN_WORDS=align, BLOCK_R=block_r,
        BLOCK_W=block_w, HAS_SCALES=cfg.has_scales, CAPACITY=layout.expert_capacity,
        CAPACITY_WORD=flag_word(Flag.CAPACITY_EXCEEDED), ABORT_WORD=flag_word(Flag.ABORTED),
        out_ranges_ptr=out_source_ranges, HAS_RANGES=out_source_ranges is not None,
        num_warps=launch.num_warps(block_r * block_w, word_bytes), **sync_args, **relay, **quant_args, **plan_args)


def reduce_launch_shape(cfg: A2AConfig, layout: Layout, device: torch.device) -> tuple:
    """(grid, rows per tile, hidden chunk, fp8 kernel arguments and H_CHUNKS, compile options) of the kernels that
    walk received per-rank rows to reduce them (`reduce_rank_rows_by_source`, `relay.reduce_relayed_rows`):
    persistent programs over row tiles, side by side for each `REDUCE_H_CHUNKS` chunks of the hidden dimension
    (the walk repeated per program of axis 1), compiled without FP contraction (`acc + w * y` as two roundings,
    as the reference: an FMA moves a partial by an ulp, which flips its fp8 rounding at ties)."""
    grid, block_r = launch.persistent_grid(device, layout, REDUCE_ROWS_PER_TILE)
    H = cfg.hidden_dim
    block_h = min(next_power_of_2(H), MAX_REDUCE_BLOCK_H // 2 if device.type == "cuda" else MAX_REDUCE_BLOCK_H)
    args = _fp8_args(cfg, device)
    if args:  # whole quantisation blocks per chunk
        block_h = max(block_h, COMBINE_FP8_BLOCK)
    chunks = min(REDUCE_H_CHUNKS, ceil_div(H, block_h))
    if chunks > 1:
        args = {**args, "H_CHUNKS": chunks}
    return (grid[0], ceil_div(H, block_h * chunks)), block_r, block_h, args, _no_fma(device)


def _no_fma(device: torch.device) -> dict:
    """Compile options of a reduce whose sums must round as the reference's (`acc + w * y`, `acc + q * scale`
    as two roundings each): no FP contraction on a GPU (the interpreter never fuses)."""
    return {"enable_fp_fusion": False} if device.type == "cuda" else {}


def reduce_rank_rows_by_source(expert_y: torch.Tensor, counts: torch.Tensor, rank_rows: torch.Tensor, rank: int,
                               base: torch.Tensor, peer_send_bytes: torch.Tensor, peer_recv_bytes: torch.Tensor,
                               recv_bytes: int, stage_bytes: int, cfg: A2AConfig, layout: Layout,
                               node: NodeSync | None = None, partial_bytes: int | None = None,
                               relay_recv_bytes: torch.Tensor | None = None,
                               row_plan: torch.Tensor | None = None) -> None:
    """The combine send half with `combine_rows="rank"`: for every row this rank received, the sum over its
    k whose expert is here of `w_k * expert_y[row of (l_k, pos_k)]`, in fp32 in k order, rounded once to
    out_dtype, into the home's recv buffer (combine region) at the slot of the row it sent.

    Args: `expert_y` as `combine.pack_combine_by_source`; `counts`, `rank_rows`, `peer_send_bytes`, `recv_bytes`
    as `expand_rank_rows` (the rows' metadata and weights are read again where the expand read them: node
    peers' send buffers and this recv buffer are untouched until this call's combine ends);
    `peer_recv_bytes`: `[W]` int64, node peers' recv buffers from `base` (-1: remote); `stage_bytes`: this
    rank's combine staging area, where rows for remote home s go at row `sum_{s' < s} rows s' sent here`
    (the combine write plan's source, `plan.combine_stage_offsets` in rows per (token, rank)).
    With `layout.relay`, `partial_bytes`: this rank's partial region from `base` (`Layout.relay_partial_offset_bytes`
    of its send buffer): a remote source's rows are walked as `expand_rank_rows` walks them (in its relay's recv
    buffer: `relay_recv_bytes`, `[W]` int64, where each node peer receives other nodes' rows, by default
    `peer_recv_bytes`), and each with a route here leaves its fp32 partial, unrounded, at row
    `plan.relay_partial_bases(...)[s] + j` there for the relay (`relay.reduce_relayed_rows`); nothing is staged,
    so the kernel neither waits for the proxy's previous combine writes nor tells it (the relay's reduce does).
    `row_plan`: what this call's `expand_rank_rows(out_row_plan=)` wrote, or None: the expert rows are read from
    it (with `REDUCE_FROM_PLAN`) instead of worked out again from the counts in every program.
    No host sync; CUDA-graph safe."""
    launch_wait_apart(node, "combine_send", base)
    key = _key(expert_y, counts, rank_rows, rank, base, peer_send_bytes, peer_recv_bytes, recv_bytes, stage_bytes,
               cfg, layout, node, partial_bytes, relay_recv_bytes, row_plan, REDUCE_FROM_PLAN)
    if key is not None and _BY_SOURCE.hit(key):
        return
    W, L = _check_rank_layout(cfg, layout)
    if cfg.combine_rows != "rank":
        check.fail("cfg", "combine_rows='rank'", repr(cfg.combine_rows))
    check.tensor("expert_y", expert_y, dtypes=(cfg.out_dtype,), shape=(None, cfg.hidden_dim))
    device, R = expert_y.device, expert_y.shape[0]
    check.counts(counts, W, layout.num_experts, device)
    check.tensor("rank_rows", rank_rows, dtypes=(torch.int32,), shape=(W, W), device=device, host_ok=True)
    check.integer("rank", rank, 0, W)
    check.peer_table("peer_send_bytes", peer_send_bytes, W, device)
    check.peer_table("peer_recv_bytes", peer_recv_bytes, W, device)
    check.integer("recv_bytes", recv_bytes)
    check.integer("stage_bytes", stage_bytes)
    relay = {}
    if layout.relay:
        check.integer("partial_bytes", partial_bytes)
        if (base.data_ptr() + partial_bytes) % 16:
            check.fail("partial_bytes", "base + it 16-byte aligned (fp32 partial rows)", str(partial_bytes))
        if relay_recv_bytes is None:
            relay_recv_bytes = peer_recv_bytes
        check.peer_table("relay_recv_bytes", relay_recv_bytes, W, device)
        relay = dict(partial_bytes=partial_bytes, RELAY=True, NODE_SIZE=layout.node_size,
                     PARTIAL_STRIDE_BYTES=layout.relay_partial_stride_bytes, relay_recv_bytes_ptr=relay_recv_bytes)
    elif partial_bytes is not None:
        check.fail("partial_bytes", "None (layout.relay is False)", str(partial_bytes))
    plan_args = {}
    if row_plan is not None:
        check.tensor("row_plan", row_plan, dtypes=(torch.int32,),
                     shape=(layout.max_recv_rank_rows, cfg.experts_per_token), device=device, strides="contiguous")
        if REDUCE_FROM_PLAN:
            plan_args = dict(row_plan_ptr=row_plan, FROM_PLAN=True)
    H, item = cfg.hidden_dim, cfg.out_itemsize
    grid, block_r, block_h, shape_args, no_fma = reduce_launch_shape(cfg, layout, device)
    # Destination rows: node homes' combine regions (buffers placed as `base`'s, as the route rows' pack
    # assumes) or the staging area, at multiples of the combine stride.
    align = launch.align_words(1, base.data_ptr(), stage_bytes, layout.combine_recv_offset_bytes,
                               cfg.combine_stride_bytes)
    sync_args = {} if node is None else node.kernel_args("combine_send", device)
    if relay and sync_args:  # staging and telling the proxy are the relay's reduce's (`relay.reduce_relayed_rows`)
        sync_args["HAS_PROXY"] = False
    _BY_SOURCE.launch(
        key, grid, expert_y, counts, rank_rows, base, peer_send_bytes, peer_recv_bytes, recv_bytes, stage_bytes,
        rank, R, counts.stride(0), rank_rows.stride(0), expert_y.stride(0) if R else H,
        P=layout.private_rows, HEADER_ROWS=layout.header_rows, PRIVATE_OFFSET_BYTES=layout.private_offset_bytes,
        W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L), K=cfg.experts_per_token,
        K_PAD=next_power_of_2(cfg.experts_per_token), PAD=cfg.expert_padding, H=H,
        META_OFFSET_BYTES=cfg.rank_meta_offset_bytes, SD_BYTES=cfg.dispatch_stride_bytes,
        SC_BYTES=cfg.combine_stride_bytes, COMBINE_RECV_BYTES=layout.combine_recv_offset_bytes, ITEM_BYTES=item,
        BLOCK_R=block_r, BLOCK_H=block_h, CAPACITY=layout.expert_capacity, ALIGN_BYTES=align,
        num_warps=launch.num_warps(block_r * block_h, item), **shape_args, **sync_args, **relay, **plan_args,
        **no_fma)  # (fp8 ties flipped by an FMA: 0.3% of elements with the toy expert's coarse outputs, on CPU too)


def reduce_rank_rows_by_token(out_tokens: torch.Tensor, rank_slot: torch.Tensor, recv_base: torch.Tensor,
                              recv_offset_bytes: int, cfg: A2AConfig, accumulate: bool = False,
                              bound_m: torch.Tensor | None = None, node: NodeSync | None = None,
                              remote_recv_offset_bytes: int | None = None,
                              node_slots: torch.Tensor | None = None) -> None:
    """The combine recv half with `combine_rows="rank"`: `out_tokens[t] = (old +) sum of the token's rows`
    (one per rank it was sent to, the row at `recv + rank_slot * Sc`), in ascending rank order, fp32, cast
    once (`reference.combine_reduced_at_sender`). Tokens t >= bound_m untouched. `remote_recv_offset_bytes`,
    `node_slots`: only remote rows staged, as `combine.reduce_combined_tokens` (slots of this node's ranks,
    from `route_tokens_by_rank`'s node range). No host sync; CUDA-graph safe."""
    launch_wait_apart(node, "combine_recv", recv_base)
    key = _key(out_tokens, rank_slot, recv_base, recv_offset_bytes, cfg, accumulate, bound_m, node,
               remote_recv_offset_bytes, node_slots)
    if key is not None and _BY_TOKEN.hit(key):
        return
    check.config(cfg)
    check.tensor("out_tokens", out_tokens, dtypes=(cfg.out_dtype,), shape=(None, cfg.hidden_dim))
    device = out_tokens.device
    T, K, H = out_tokens.shape[0], cfg.experts_per_token, cfg.hidden_dim
    check.tensor("rank_slot", rank_slot, dtypes=(torch.int32,), shape=(T, K), device=device, strides="contiguous")
    check.tensor("recv_base", recv_base, dtypes=(torch.uint8,), shape=(None,), device=device)
    check.integer("recv_offset_bytes", recv_offset_bytes)
    check.bound_m(bound_m, device)
    item = cfg.out_itemsize
    if recv_offset_bytes % item or recv_base.data_ptr() % item:
        check.fail("recv_offset_bytes", f"recv_base + it aligned to out itemsize {item}", str(recv_offset_bytes))
    if T == 0 and node is None:
        return
    block_h = min(next_power_of_2(H), MAX_REDUCE_BLOCK_H)
    block_t = launch.tokens_per_program(device, T)
    sync_args = {} if node is None else node.kernel_args("combine_recv", device)
    if check.split("remote_recv_offset_bytes", remote_recv_offset_bytes, node_slots, device):
        sync_args = {**sync_args, "node_slots_ptr": node_slots, "remote_recv_bytes": remote_recv_offset_bytes,
                     "SPLIT": True}
    _BY_TOKEN.launch(
        key, (max(1, ceil_div(T, block_t)), ceil_div(H, block_h)), out_tokens, rank_slot, recv_base,
        bound_m if bound_m is not None else rank_slot, recv_offset_bytes, T, out_tokens.stride(0),
        K=K, K_PAD=next_power_of_2(K), MAX_SLOTS=cfg.max_routes, H=H, SC_BYTES=cfg.combine_stride_bytes,
        ITEM_BYTES=item, BLOCK_T=block_t, BLOCK_H=block_h, HAS_BOUND_M=bound_m is not None, ACCUMULATE=accumulate,
        num_warps=launch.num_warps(block_t * block_h, item), **_fp8_args(cfg, device), **sync_args,
        **_no_fma(device))  # (an fp8 row's q * scale fused into the sum: a tie flipped, on the H200)


_ROW_META: dict = {}  # row_meta_args' answers by argument key (CUDA only)
_EXPAND = launch.LaunchCache(_expand_rank_rows_kernel)
_BY_SOURCE = launch.LaunchCache(_reduce_rank_rows_by_source_kernel)
_BY_TOKEN = launch.LaunchCache(_reduce_rank_rows_by_token_kernel)

__all__ = ["route_tokens_by_rank", "row_meta_args", "expand_rank_rows", "reduce_rank_rows_by_source",
           "reduce_rank_rows_by_token"]
