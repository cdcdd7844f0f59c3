"""What one instance moves and holds: the bytes of a call per phase (`AllToAll.bytes_last_call`) and the
bytes of its buffers (`AllToAll.buffer_bytes`, `moe-a2a sizes`).

Both are host-side arithmetic over sizes that `config.py` owns (`A2AConfig.dispatch_stride_bytes`,
`combine_stride_bytes`, `Layout.send_bytes`, ...) and the count matrix the protocol exchanges anyway
(`protocol/plan.py` reads it the same way): nothing here is on the hot path. `reference.bytes_per_phase`
is the specification of the rows counted here; `tests/runtime/test_traffic.py` holds one against the other
for real calls.
"""
from __future__ import annotations

import numpy as np

from ..protocol import plan
from ..reference import Wire

PHASES = ("dispatch", "combine")
DIRECTIONS = ("node_sent", "remote_sent", "node_received", "remote_received")


def wire(cfg) -> Wire:
    """The config's wire as `reference.Wire` (the specification's name for it): its `dispatch_rows`,
    `combine_rows` and `combine_fp8`, where the config has them, else today's per-route rows."""
    return Wire(getattr(cfg, "dispatch_rows", "route"), getattr(cfg, "combine_rows", "route"),
                bool(getattr(cfg, "combine_fp8", False)))


def count_row_bytes(layout) -> int:
    """Bytes of one count row as it crosses to a peer: int32 per expert (and, with per-rank dispatch rows,
    per rank: `Layout.count_row_ints` where the layout has it)."""
    return 4 * getattr(layout, "count_row_ints", layout.num_experts)


def call_bytes(counts, layout, cfg, rank: int, rank_rows=None) -> dict[str, dict[str, int]]:
    """Bytes rank `rank` exchanged with the other ranks in one call, per phase, by direction and place.

    Returns `{"dispatch": {"node_sent", "remote_sent", "node_received", "remote_received"}, "combine":
    {...}}`, ints, where "node" is the other ranks of this rank's node (`layout.same_node`) and "remote"
    every rank on another node; what a rank keeps for itself crosses no link and is in neither. Sent =
    bytes that leave this rank's buffers for a peer; received = bytes that arrive in this rank's buffers
    from a peer (a node peer's dispatch rows are pulled by the receiver, counted the same).

    - dispatch: `rows[s, d] * cfg.dispatch_stride_bytes` from home rank s to expert rank d, plus ONE count
      row (`count_row_bytes`) from every rank to every other rank: into a node peer's sync area by the
      pack's epilogue, to a remote peer at the head of the private write (sent even with no rows).
    - combine: the same pairs' rows back, d to s, each `cfg.combine_stride_bytes`; no count row.
    - rows: `rows[s, d]` = live routes of s to d's experts (`dispatch_rows="route"`, read off the count
      matrix, duplicates twice), or tokens of s with at least one route to d (`dispatch_rows="rank"`,
      `rank_rows`); the combine's pairs likewise by `combine_rows`. A count row of -1 (a rank that
      aborted the call) counts no rows.
    The strides are the slots the kernels and the proxy move (a quantised call's unpack copies fewer bytes
    of each node row; not counted here). Flags, immediates and epoch words are not counted.
    With the relay (`layout.relay`) the remote pairs are the rail's (a rank and its relays: `rank_rows` holds
    the rows per (token, node) there, 0 for the other remote ranks) and a count row crosses to those only;
    the relay's node traffic (its node peers reading what landed at it, their fp32 partials to it) is not in
    the count matrix and not counted (`reference.relay_bytes_per_phase` has it).

    Args:
        counts: `[W, E]` int32 (tensor or array): row s = routes source s sends to each expert, as every
            rank holds it after the dispatch (`AllToAll.counts`).
        layout: the instance's `Layout` (world and node size, local experts).
        cfg: its `A2AConfig` (strides, `dispatch_rows` / `combine_rows` where the config has them).
        rank: this rank.
        rank_rows: `[W, W]` int (tensor or array), row s = rows source s sends to each rank, needed when
            either phase sends rows per (token, rank); ValueError when missing then.
    """
    w = wire(cfg)
    per_rank = {"dispatch": w.dispatch_rows == "rank", "combine": w.combine_rows == "rank"}
    routes = plan.route_matrix(np.maximum(_numpy(counts), 0), layout)      # [home s, expert rank d]
    if any(per_rank.values()):
        if rank_rows is None:
            raise ValueError("rows per (token, rank): the [W, W] rows per (source, rank) are needed "
                             "(the instance's rank_rows), not given")
        pairs = np.maximum(_numpy(rank_rows).astype(np.int64), 0)
    rows = {ph: pairs if per_rank[ph] else routes for ph in PHASES}
    stride = {"dispatch": cfg.dispatch_stride_bytes, "combine": cfg.combine_stride_bytes}
    head = count_row_bytes(layout)
    out = {ph: dict.fromkeys(DIRECTIONS, 0) for ph in PHASES}
    on_wire = layout.wire_peers(rank)
    for peer in range(layout.world_size):
        if peer == rank:
            continue
        where = "node" if layout.same_node(rank, peer) else "remote"
        off_rail = where == "remote" and peer not in on_wire
        d, c = out["dispatch"], out["combine"]
        d[where + "_sent"] += int(rows["dispatch"][rank, peer]) * stride["dispatch"] + (0 if off_rail else head)
        d[where + "_received"] += int(rows["dispatch"][peer, rank]) * stride["dispatch"] + (0 if off_rail else head)
        c[where + "_sent"] += int(rows["combine"][peer, rank]) * stride["combine"]      # back to home peer
        c[where + "_received"] += int(rows["combine"][rank, peer]) * stride["combine"]  # from expert peer
    return out


def bytes_last_call(a2a) -> dict[str, dict[str, int]]:
    """`AllToAll.bytes_last_call`: `call_bytes` of the instance's last call, from its count matrix (and its
    per-rank rows with `dispatch_rows="rank"`), read on the host."""
    if a2a.epoch == 0:
        raise ValueError("bytes_last_call: no call yet")
    rank_rows = getattr(a2a, "rank_rows", None)
    if rank_rows is None:  # the wiring's view, until the instance exposes it
        rank_rows = getattr(a2a._w, "rank_rows", None)
    return call_bytes(a2a.counts, a2a.layout, a2a.cfg, a2a.rank, rank_rows)


def buffer_bytes(layout, placement: str, device_type: str = "cuda") -> dict:
    """Bytes one instance holds on one rank, for a placement (`AllToAll.placement`, `runtime.placement`):

    `{"placement", "send_bytes", "recv_bytes", "segment_bytes", "device_bytes", "host_bytes"}`:
    send_bytes / recv_bytes are `Layout.send_bytes` / `recv_bytes` (one buffer each); segment_bytes is
    the shared host segment (`Layout.segment_bytes`: flags, traces, sync area, write tables, and the
    send/recv buffers themselves when the placement stages rows there: "host" and "staged"). The
    placements "ipc", "nic" and "staged" hold a send and a recv buffer of their own besides: GPU memory
    on a GPU (`device_bytes`), host memory on a CPU. `host_bytes` is the rest (the segment, pinned on a
    GPU). With rows reduced at the experts' rank, `row_plan_bytes` (`Wiring.row_plan`: W * T * K int32, the
    expand's expert rows of each received row) is on the instance's device too. The proxy processes' own
    memory and the dispatch / combine outputs the caller allocates are not counted."""
    from .placement import PLACEMENTS

    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {sorted(PLACEMENTS)}, got {placement!r}")
    segment = layout.segment_bytes(PLACEMENTS[placement].host_staged)
    plan = row_plan_bytes(layout)
    own = (0 if placement == "host" else layout.send_bytes + layout.recv_bytes) + plan
    on_device = own if device_type == "cuda" else 0
    return {"placement": placement, "send_bytes": layout.send_bytes, "recv_bytes": layout.recv_bytes,
            "segment_bytes": segment, "row_plan_bytes": plan, "device_bytes": on_device,
            "host_bytes": segment + own - on_device}


def row_plan_bytes(layout) -> int:
    """Bytes of `Wiring.row_plan` (rows reduced at the experts' rank only, else 0)."""
    return layout.max_recv_rank_rows * layout.experts_per_token * 4 if layout.combine_rank_rows else 0


def placements_for(layout) -> list[str]:
    """The placements an instance of this layout can take (`runtime.placement.choose`): GPU buffers ("ipc"
    on one node; "nic", or "staged" where the NIC cannot reach GPU memory, across nodes) or "host"."""
    one_node = layout.node_size == layout.world_size
    return ["ipc", "host"] if one_node else ["nic", "staged", "host"]


def sizes_report(cfg, world_size: int, node_size: int | None = None, proxies: int = 1) -> dict:
    """What `moe-a2a sizes` prints (the CLI adds the DeepEP facade's size hint): one rank's row sizes and
    buffers for `cfg` at `world_size` ranks (`node_size` per node, default one node), per placement
    (`buffer_bytes`, on a GPU); `proxies` a rank (under the relay its write tables hold a piece per proxy)."""
    lay = cfg.layout(world_size, node_size).with_wire_pieces(proxies)
    return {"config": str(cfg), "world": world_size, "node": lay.node_size, "proxies": proxies,
            "write_table_bytes": lay.write_table_bytes,
            "rows": {"dispatch_stride_bytes": cfg.dispatch_stride_bytes,
                     "combine_stride_bytes": cfg.combine_stride_bytes, "count_row_bytes": count_row_bytes(lay),
                     "private_rows": lay.private_rows, "max_dispatch_rows": lay.max_dispatch_rows,
                     "relay_partial_bytes": lay.relay_partial_rows * lay.relay_partial_stride_bytes,
                     "row_plan_bytes": row_plan_bytes(lay)},
            "placements": {p: buffer_bytes(lay, p, "cuda") for p in placements_for(lay)}}


def _numpy(t) -> np.ndarray:
    """A tensor (any device: one host copy) or array, as a numpy array."""
    if hasattr(t, "detach"):
        return t.detach().cpu().numpy()
    return np.asarray(t)


__all__ = ["PHASES", "DIRECTIONS", "wire", "count_row_bytes", "call_bytes", "bytes_last_call", "buffer_bytes",
           "placements_for", "sizes_report"]
