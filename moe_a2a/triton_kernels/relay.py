"""The relay (issue 46; docs/protocol.md, 3.8): a token crosses the network once per destination node.

`Layout.relay` (with `A2AConfig(dispatch_rows="rank", combine_rows="rank")`) switches the per-rank rows'
kernels (`rank_rows.py`) to the relay's data path; `reduce_relayed_rows` is the one kernel of its own:

- send half: `route_tokens_by_rank(rank=)` maps a route to an expert of another node to the sender's relay
  there (`reference.relay_rank`: that node's rank with the sender's local index), so a token sends each remote
  node one row; the pack's metadata (`row_meta_args(rank=)`) gives such a row node-local expert ids.
- wire (the proxy, `plan.relay_private_writes` / `relay_remainder_writes`): to the relays only; a relay's recv
  buffer keeps the private slots, and its remainder runs count remote sources only (`plan.relay_remainder_offsets`).
- receive half: `expand_rank_rows(peer_recv_bytes=)` reads a remote source's rows in its relay's recv buffer
  (a node peer's, or this rank's) and expands those with a route here: `reference.dispatch`'s output.
- combine: `reduce_rank_rows_by_source(partial_bytes=)` leaves, per remote source's row with a route here, the
  fp32 partial in this rank's partial region (`Layout.relay_partial_offset_bytes`); then on the relay,
  `reduce_relayed_rows` sums the node's partials of each row it relayed in ascending rank, rounds once and
  stages the row where `plan.relay_combine_writes` sends it home; the home's `reduce_rank_rows_by_token` is
  unchanged. Result: `reference.combine_relay`.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ..config import A2AConfig, Layout, next_power_of_2
from . import _checks as check
from . import _launch as launch
from .node_sync import NodeSync, launch_wait_apart
from .rank_rows import _key, reduce_launch_shape
from ._relay_kernels import _reduce_relayed_rows_kernel

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def reduce_relayed_rows(rank_rows: torch.Tensor, rank: int, base: torch.Tensor, peer_partial_bytes: torch.Tensor,
                        recv_bytes: int, stage_bytes: int, cfg: A2AConfig, layout: Layout,
                        node: NodeSync | None = None) -> None:
    """The relay's combine: for every row a remote source s sent this rank as its relay (s on another node, with
    this rank's local index), the sum of the node's fp32 partials of that row (`reduce_rank_rows_by_source` with
    `partial_bytes`), in ascending rank over the node ranks its routes hit, from +0, rounded once to out_dtype
    (bf16 to nearest even) or to fp8 blocks (`cfg.combine_fp8`), staged for s's combine write.

    Args:
        rank_rows: `[W, W]` int32, row s = rows source s sends each rank (the count rows' last W ints).
        rank: this rank (the relay).
        base: uint8, the byte address space of the node's buffers.
        peer_partial_bytes: `[W]` int64, each node peer's partial region from `base` (this rank's too; -1 for
            remote ranks): `send buffer + Layout.relay_partial_offset_bytes`, 16-byte aligned. Row
            `plan.relay_partial_bases(...)[s] + j` of node rank d holds d's partial of s's row j when one of the
            row's routes is on d.
        recv_bytes: this rank's recv buffer from `base` (the relayed rows' metadata: private slots, then the
            remainder runs of the relay geometry, `plan.relay_remainder_offsets`).
        stage_bytes: this rank's combine staging area from `base` (`send buffer + Layout.combine_stage_offset_bytes`):
            s's row j goes to row `plan.combine_stage_offsets(rank_rows[:, rank])[s] + j`, the source of
            `plan.relay_combine_writes`.
        node: the node synchronisation of the half "combine_relay": wait for the node peers' combine_ready (their
            partials are in) and the proxy's previous combine writes; the last program raises
            `Flag.COMBINE_SEND_READY`.
    No host sync; CUDA-graph safe."""
    launch_wait_apart(node, "combine_relay", base)
    key = _key(rank_rows, rank, base, peer_partial_bytes, recv_bytes, stage_bytes, cfg, layout, node)
    if key is not None and _RELAYED.hit(key):
        return
    check.config(cfg)
    check.layout(layout, cfg)
    if not layout.relay:
        check.fail("layout", "a relay layout (A2AConfig.layout(..., relay=True))", "relay=False")
    if not cfg.rank_rows or cfg.combine_rows != "rank":
        check.fail("cfg", "dispatch_rows='rank', combine_rows='rank'",
                   f"dispatch_rows={cfg.dispatch_rows!r}, combine_rows={cfg.combine_rows!r}")
    W = layout.world_size
    device = base.device
    check.tensor("base", base, dtypes=(torch.uint8,), shape=(None,), device=device)
    check.tensor("rank_rows", rank_rows, dtypes=(torch.int32,), shape=(W, W), device=device, host_ok=True)
    check.integer("rank", rank, 0, W)
    check.peer_table("peer_partial_bytes", peer_partial_bytes, W, device)
    check.integer("recv_bytes", recv_bytes)
    check.integer("stage_bytes", stage_bytes)
    H, item = cfg.hidden_dim, cfg.out_itemsize
    grid, block_r, block_h, shape_args, no_fma = reduce_launch_shape(cfg, layout, device)
    align = launch.align_words(1, base.data_ptr(), stage_bytes, cfg.combine_stride_bytes)
    sync_args = {} if node is None else node.kernel_args("combine_relay", device)
    _RELAYED.launch(
        key, grid, rank_rows, base, peer_partial_bytes, recv_bytes, stage_bytes, rank, rank_rows.stride(0),
        W=W, W_PAD=next_power_of_2(W), L=layout.num_local_experts, K=cfg.experts_per_token,
        K_PAD=next_power_of_2(cfg.experts_per_token), H=H, NODE_SIZE=layout.node_size, P=layout.private_rows,
        HEADER_ROWS=layout.header_rows, PRIVATE_OFFSET_BYTES=layout.private_offset_bytes,
        SD_BYTES=cfg.dispatch_stride_bytes, META_OFFSET_BYTES=cfg.rank_meta_offset_bytes,
        SC_BYTES=cfg.combine_stride_bytes, PARTIAL_STRIDE_BYTES=layout.relay_partial_stride_bytes, ITEM_BYTES=item,
        Y_TY=_TL_DTYPES[cfg.out_dtype], BLOCK_R=block_r, BLOCK_H=block_h, ALIGN_BYTES=align,
        num_warps=launch.num_warps(block_r * block_h, 4), **shape_args, **sync_args, **no_fma)


_RELAYED = launch.LaunchCache(_reduce_relayed_rows_kernel)

__all__ = ["reduce_relayed_rows"]
