"""The protocol's arithmetic: pure functions of the exchanged count rows.

`counts` is the `[W, E]` matrix every rank holds once the count rows are in: row s = how many routes
source rank s sends to each expert (a remote source's row arrives at the head of its private write). From it every rank derives, without further messages,
who writes what where (docs/protocol.md). The proxy uses these functions to post writes; the
Triton kernels compute the same offsets on the device, and tests check that both agree.

A *write* is `(peer, src_offset_bytes, length_bytes, dst_offset_bytes)`, offsets relative to the
start of the sender's send buffer and of the receiver's recv buffer; the functions below return
them as rows of an int64 `[n, 4]` array, computed for all peers at once: at 64 ranks the proxy
runs them on the critical path of every call (per-peer Python loops cost 1.4 ms there, measured).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from typing import TYPE_CHECKING

from .words import PIECE_ALIGN_BYTES

if TYPE_CHECKING:  # the layout is config's; the protocol sits below it (config imports protocol.words)
    from ..config import Layout

Write = tuple[int, int, int, int]


# ---- counts ------------------------------------------------------------------------------------
def validate_counts(counts: np.ndarray, lay: Layout) -> None:
    """Refuse a count matrix that would overrun a buffer (a corrupt or malicious peer row)."""
    W, E, T, K = lay.world_size, lay.num_experts, lay.max_num_tokens, lay.experts_per_token
    if counts.shape != (W, E):
        raise ValueError(f"count matrix: expected shape {(W, E)}, got {counts.shape}")
    if counts.min() >= 0 and counts.sum(1).max() <= T * K:
        return
    bad = np.nonzero((counts < 0).any(1) | (counts.sum(1) > T * K))[0]
    if len(bad):
        raise ValueError(f"count rows of ranks {bad.tolist()} are negative or exceed T*K={T * K}")


def rank_counts(row: np.ndarray, lay: Layout) -> np.ndarray:
    """[W]: routes one source sends to each destination rank (experts are contiguous per rank)."""
    return row.reshape(lay.world_size, lay.num_local_experts).sum(1)


def send_offsets(row: np.ndarray, lay: Layout) -> np.ndarray:
    """[W] exclusive prefix sums: first send-buffer slot of each destination's run (rows)."""
    n = rank_counts(row, lay)
    return np.cumsum(n) - n


def recv_counts(counts: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """[W]: routes each source sends to `rank`."""
    L = lay.num_local_experts
    return counts[:, rank * L:(rank + 1) * L].sum(1)


def route_matrix(counts: np.ndarray, lay: Layout) -> np.ndarray:
    """[W, W] int64: routes[s, d] = routes source s sends to destination rank d (rank_counts of every
    row). Computed once per call by the proxy; the write functions below take it."""
    W, L = lay.world_size, lay.num_local_experts
    c = counts.reshape(W, W, L)
    if L <= 8:  # numpy reduces a short last axis slowly (90 µs at W=64, L=4): add L strided slices
        out = c[:, :, 0].astype(np.int64)
        for j in range(1, L):
            out += c[:, :, j]
        return out
    return c.sum(2, dtype=np.int64)


@lru_cache(maxsize=256)
def remote_peer_array(lay: Layout, rank: int) -> np.ndarray:
    """`lay.remote_peers(rank)` as a read-only int64 array (cached: the proxy asks every call)."""
    out = np.asarray(lay.remote_peers(rank), dtype=np.int64)
    out.flags.writeable = False
    return out


def remainder_offsets(n_recv: np.ndarray, lay: Layout) -> np.ndarray:
    """[W]: recv-buffer row where source s's tokens beyond the private region start.

    Every source gets a place, same-node ones included (they leave holes), so the formula is the
    same on every rank and needs no knowledge of the node layout."""
    rest = np.maximum(n_recv - lay.private_rows, 0)
    return lay.world_size * lay.private_slot_rows + np.cumsum(rest) - rest


def combine_stage_offsets(n_recv: np.ndarray) -> np.ndarray:
    """[W]: row of the expert side's send buffer where rows for source s are staged for combine."""
    return np.cumsum(n_recv) - n_recv


def expert_segments(counts: np.ndarray, rank: int, lay: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(rows per local expert [L], first row of each expert's padded segment [L]) on `rank`."""
    L, pad = lay.num_local_experts, lay.expert_padding
    totals = counts[:, rank * L:(rank + 1) * L].sum(0)
    if lay.expert_capacity:  # fixed segments: expert l at l * C
        return totals, np.arange(L, dtype=np.int64) * lay.expert_capacity
    padded = (totals + pad - 1) // pad * pad
    return totals, np.cumsum(padded) - padded


# ---- writes ------------------------------------------------------------------------------------
_NO_WRITES = np.empty((0, 4), dtype=np.int64)
_NO_WRITES.flags.writeable = False


def _writes(peer, src, length, dst) -> np.ndarray:
    """Columns (broadcast) -> int64 `[n, 4]` write rows."""
    out = np.empty((len(peer), 4), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = peer, src, length, dst
    return out


def private_writes(row: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """First phase of dispatch: to every remote peer, this rank's count row and its first min(n, P)
    routes, in one write of one contiguous source range into this rank's private slot there. The source is
    the peer's slot of the send buffer's private staging region (`Layout.private_stage_header_offset_bytes`:
    the count row, then the rows the pack put there), the destination the count row's place in the
    receiver's slot (`Layout.private_header_offset_bytes`), so the rows land right after it. Zero rows
    still write the count row and carry the immediate the peer counts."""
    P, stride = lay.private_rows, lay.dispatch_stride_bytes
    d = remote_peer_array(lay, rank)
    if not len(d):  # one node: nothing crosses the wire
        return _NO_WRITES
    n = rank_counts(row, lay)
    first = lay.node_of(rank) * lay.node_size
    index = d - lay.node_size * (d >= first)  # Layout.private_stage_index for every remote peer at once
    src = lay.private_stage_header_offset_bytes(0) + index * lay.private_slot_bytes
    return _writes(d, src, lay.routing_row_bytes + np.minimum(n[d], P) * stride, lay.private_header_offset_bytes(rank))


def private_stage_rows(row: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """[T*K] int64: the send row of each expert-major send slot (what `route_tokens(out_send_row=)` gives a
    route in that slot): the slot itself, or, for the first min(n, P) routes to a remote peer, their row in
    the peer's private staging slot (`lay.send_rows + index * private_slot_rows + header_rows + i`)."""
    P = lay.private_rows
    n = rank_counts(row, lay)
    off = np.cumsum(n) - n
    out = np.arange(lay.send_rows, dtype=np.int64)
    for d in remote_peer_array(lay, rank).tolist():
        k = min(int(n[d]), P)
        index = lay.private_stage_index(rank, d)
        out[off[d]:off[d] + k] = lay.send_rows + index * lay.private_slot_rows + lay.header_rows + np.arange(k)
    return out


def remainder_writes(routes: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """Second phase of dispatch, once every count row is known (`routes = route_matrix(counts)`): one
    write per remote peer that gets more than P routes from this rank (no write, and no immediate,
    otherwise)."""
    W, P, stride = lay.world_size, lay.private_rows, lay.dispatch_stride_bytes
    if not len(remote_peer_array(lay, rank)):
        return _NO_WRITES
    n = routes[rank]
    off = np.cumsum(n) - n  # send_offsets(counts[rank])
    d = remote_peer_array(lay, rank)
    d = d[n[d] > P]
    # remainder_offsets(routes[:, d])[rank] for every destination d at once
    before = np.maximum(routes[:rank, d] - P, 0).sum(0)
    return _writes(d, (off[d] + P) * stride, (n[d] - P) * stride, (W * lay.private_slot_rows + before) * stride)


def expected_dispatch_imms(routes: np.ndarray, rank: int, lay: Layout) -> dict[int, int]:
    """Remote peer -> DISPATCH immediates this rank must receive: 1 private (+1 remainder)."""
    s = remote_peer_array(lay, rank)
    return dict(zip(s.tolist(), (1 + (routes[s, rank] > lay.private_rows)).tolist()))


def combine_writes(routes: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """Combine, expert side: to every remote source, its rows (staged contiguously) back to the
    slots its dispatch send buffer used, in the combine region of its recv buffer
    (`routes = route_matrix(counts)`).
    Zero-length writes kept."""
    stride = lay.combine_stride_bytes
    if not len(remote_peer_array(lay, rank)):
        return _NO_WRITES
    n = routes[:, rank]
    stage = combine_stage_offsets(n)
    first = routes[:, :rank].sum(1)  # send_offsets(counts[s])[rank] for every source s
    s = remote_peer_array(lay, rank)
    return _writes(s, lay.combine_stage_offset_bytes + stage[s] * stride, n[s] * stride,
                   lay.combine_recv_offset_bytes + first[s] * stride)


def group_targets(writes: np.ndarray, rank: int, src_base: int, dst_base: int) -> np.ndarray:
    """Write rows -> `TransferEngine.scatter` targets of a peer group holding every rank but `rank`
    in order: rank d becomes position d - (d > rank), offsets move by the regions' bases."""
    t = writes.copy()
    t[:, 0] -= t[:, 0] > rank
    t[:, 1] += src_base
    t[:, 3] += dst_base
    return t


# ---- the relay (docs/protocol.md, 3.8): rows to another node go through the source's relay there ----------
# Here `rows` is the `[W, W]` matrix of rows per (token, destination rank) (the count rows' last W ints):
# rows[s, q] = rows source s sends rank q, where a remote q is s's relay on q's node or gets none.
def relay_peers(lay: Layout, rank: int) -> np.ndarray:
    """[nodes - 1] int64: `rank`'s relay on every other node (the rank there with its local index)."""
    return np.asarray(lay.rail_peers(rank), dtype=np.int64)


def relayed_sources(lay: Layout, rank: int) -> np.ndarray:
    """int64: the remote sources `rank` relays for (those on its rail: the same local index)."""
    return np.asarray(lay.rail_peers(rank), dtype=np.int64)


def relay_remainder_offsets(rows: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """[W]: recv-buffer row of `rank` where source s's rows beyond the private region start, relay geometry:
    only remote sources count (a node source's rows are pulled, and a remote sender cannot know them)."""
    remote = np.arange(lay.world_size) // lay.node_size != lay.node_of(rank)
    rest = np.where(remote, np.maximum(rows[:, rank] - lay.private_rows, 0), 0)
    return lay.world_size * lay.private_slot_rows + np.cumsum(rest) - rest


def relay_private_writes(rows: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """`private_writes` through the relay: to each of `rank`'s relays only (`relay_peers`), its count row then
    its first min(n, P) rows, n = rows[rank, relay] (possibly 0: the count row still goes, and its immediate)."""
    d = relay_peers(lay, rank)
    if not len(d):
        return _NO_WRITES
    n = rows[rank, d]
    first = lay.node_of(rank) * lay.node_size
    index = d - lay.node_size * (d >= first)  # Layout.private_stage_index
    src = lay.private_stage_header_offset_bytes(0) + index * lay.private_slot_bytes
    return _writes(d, src, lay.routing_row_bytes + np.minimum(n, lay.private_rows) * lay.dispatch_stride_bytes,
                   lay.private_header_offset_bytes(rank))


def relay_remainder_writes(rows: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """`remainder_writes` through the relay: to each relay that gets more than P rows, the rest, at the relay
    geometry's place (`relay_remainder_offsets`)."""
    P, stride = lay.private_rows, lay.dispatch_stride_bytes
    d = relay_peers(lay, rank)
    n = rows[rank]
    off = np.cumsum(n) - n  # rank-major send offsets
    d = d[n[d] > P]
    if not len(d):
        return _NO_WRITES
    dst = np.array([relay_remainder_offsets(rows, int(q), lay)[rank] for q in d.tolist()], dtype=np.int64)
    return _writes(d, (off[d] + P) * stride, (n[d] - P) * stride, dst * stride)


def relay_expected_dispatch_imms(rows: np.ndarray, rank: int, lay: Layout) -> dict[int, int]:
    """Relayed source -> DISPATCH immediates `rank` must receive: 1 private (+1 remainder). Other remote
    sources write nothing here."""
    s = relayed_sources(lay, rank)
    return dict(zip(s.tolist(), (1 + (rows[s, rank] > lay.private_rows)).tolist()))


def relay_combine_writes(rows: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """`combine_writes` through the relay: to each relayed source s, the rows the relay reduced for it (staged at
    `combine_stage_offsets(rows[:, rank])[s]`), back to the slots of its rows to this rank in its combine region.
    Zero-length writes kept (the home counts one immediate per relay)."""
    s = relayed_sources(lay, rank)
    if not len(s):
        return _NO_WRITES
    stride = lay.combine_stride_bytes
    n = rows[:, rank]
    stage = combine_stage_offsets(n)
    first = rows[s, :rank].sum(1)
    return _writes(s, lay.combine_stage_offset_bytes + stage[s] * stride, n[s] * stride,
                   lay.combine_recv_offset_bytes + first * stride)


def relay_expected_combine_imms(lay: Layout, rank: int) -> dict[int, int]:
    """Relay -> COMBINE immediates home `rank` must receive: one from its relay on every other node."""
    return dict.fromkeys(relay_peers(lay, rank).tolist(), 1)


def relay_partial_bases(rows: np.ndarray, rank: int, lay: Layout) -> np.ndarray:
    """[W] int64: the partial-region row of row 0 of each remote source s into `rank`'s node,
    `sum_{s' < s remote} rows[s', relay(s', node)]` (dense over every remote source's rows into the node: the
    same numbering on each of its ranks); -1 for the node's own sources."""
    ns, W = lay.node_size, lay.world_size
    node = lay.node_of(rank)
    s = np.arange(W)
    remote = s // ns != node
    n = np.where(remote, rows[s, node * ns + s % ns], 0).astype(np.int64)
    return np.where(remote, np.cumsum(n) - n, -1)


# ---- writes in pieces (Layout.wire_pieces, docs/protocol.md 3.5): one piece per proxy, NIC j to NIC j ---------
def piece_starts(length, pieces: int) -> np.ndarray:
    """`[..., pieces + 1]` int64: where each of a write's `pieces` pieces starts (the last entry: `length`), the
    j-th at `floor(length * j / pieces)` rounded down to `PIECE_ALIGN_BYTES`; a short write's first pieces may
    be empty."""
    length = np.asarray(length, dtype=np.int64)[..., None]
    j = np.arange(pieces + 1, dtype=np.int64)
    a = (length * j // pieces) // PIECE_ALIGN_BYTES * PIECE_ALIGN_BYTES
    return np.where(j == pieces, length, a)


def split_writes(writes: np.ndarray, pieces: int) -> np.ndarray:
    """`[pieces, n, 4]`: piece j of every write of `writes` (`[n, 4]` rows of `_writes`), the same peer, the
    source and destination advanced alike (`piece_starts`). Pieces of one write tile it, in order."""
    a = piece_starts(writes[:, 2], pieces)                      # [n, pieces + 1]
    out = np.repeat(writes[None], pieces, axis=0).copy()
    out[:, :, 1] += a[:, :-1].T
    out[:, :, 2] = (a[:, 1:] - a[:, :-1]).T
    out[:, :, 3] += a[:, :-1].T
    return out


def private_piece_more(rows: np.ndarray, rank: int, lay: Layout, pieces: int) -> np.ndarray:
    """`[pieces, nodes - 1]` bool: whether piece j of `rank`'s private write to each relay (`relay_peers`) says
    a remainder piece follows (`Imm.DISPATCH_MORE`): piece j of its remainder write is not empty. The receiving
    proxy j awaits exactly that piece."""
    d = relay_peers(lay, rank)
    rest = np.maximum(rows[rank, d] - lay.private_rows, 0) * lay.dispatch_stride_bytes
    a = piece_starts(rest, pieces)
    return (a[:, 1:] > a[:, :-1]).T
