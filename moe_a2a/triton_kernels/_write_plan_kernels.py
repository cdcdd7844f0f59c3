"""The `@triton.jit` bodies of `write_plan.py` (private: launched only by its launchers, which hold the
overview and the checks).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..protocol import device as protocol_device
from ..protocol.words import PIECE_ALIGN_BYTES, Imm
from . import _details as d
from . import _launch as launch


_DISPATCH: tl.constexpr = tl.constexpr(int(Imm.DISPATCH))
_DISPATCH_MORE: tl.constexpr = tl.constexpr(int(Imm.DISPATCH_MORE))
_DISPATCH_REMAINDER: tl.constexpr = tl.constexpr(int(Imm.DISPATCH_REMAINDER))
_COMBINE: tl.constexpr = tl.constexpr(int(Imm.COMBINE))
_ALIGN: tl.constexpr = tl.constexpr(PIECE_ALIGN_BYTES)


@triton.jit
def _piece_bounds(length, j: tl.constexpr, PIECES: tl.constexpr):
    """[start, end) of piece j of writes of `length` bytes (`plan.piece_starts`)."""
    start = (length * j // PIECES) // _ALIGN * _ALIGN
    if j + 1 == PIECES:
        end = length
    else:
        end = (length * (j + 1) // PIECES) // _ALIGN * _ALIGN
    return start, end


@triton.jit
def _store_rows(table_ptr, piece, peer, valid, src, length, dst, imm, W: tl.constexpr):
    """Rows `peer < W` of piece `piece` of one write table: (src_offset_bytes, length_bytes, dst_offset_bytes,
    imm); zeros where not `valid` (same-node peers, this rank), so a stale row of an earlier call never survives."""
    row = table_ptr + (piece * W + peer.to(tl.int64)) * 4
    z = tl.zeros_like(src)
    inside = peer < W
    tl.store(row + 0, tl.where(valid, src, z), mask=inside)
    tl.store(row + 1, tl.where(valid, length, z), mask=inside)
    tl.store(row + 2, tl.where(valid, dst, z), mask=inside)
    tl.store(row + 3, tl.where(valid, imm, z), mask=inside)


@triton.jit
def _store_pieces(table_ptr, peer, valid, src, length, dst, imm, W: tl.constexpr, PIECES: tl.constexpr):
    """`_store_rows` of each of the PIECES pieces of the writes (src, length, dst), one immediate for all."""
    for j in tl.static_range(PIECES):
        a, b = _piece_bounds(length, j, PIECES)
        _store_rows(table_ptr, j, peer, valid, src + a, b - a, dst + a, imm, W)


@triton.jit
def _routes_row(counts_ptr, stride_counts_w, s, W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr,
                L_PAD: tl.constexpr):
    """[W_PAD] int64: routes source `s` sends to each destination rank (its count row summed per rank;
    an aborting source's row of -1 counts as 0)."""
    dd = tl.arange(0, W_PAD)[:, None]
    ll = tl.arange(0, L_PAD)[None, :]
    c = tl.load(counts_ptr + s.to(tl.int64) * stride_counts_w + dd * L + ll, mask=(dd < W) & (ll < L), other=0)
    return tl.sum(tl.maximum(c, 0).to(tl.int64), axis=1)


@triton.jit(do_not_specialize=["rank", "node_first", "send_bytes"])
def _plan_private_writes_kernel(
    # inputs
    counts_ptr,          # (W, E) int32, row stride `stride_counts_w`: this rank's row is final
    epoch_ptr,           # (1,) int64: this call's epoch (advanced by the route kernel on the stream)
    stride_counts_w,
    rank, node_first,    # this rank; its node is ranks [node_first, node_first + NODE)
    header_dst_bytes,    # Layout.private_header_offset_bytes(rank): where the count row lands at a peer
    # outputs
    table_ptr,           # (PIECES, W, 4) int64: the PRIVATE write table
    remainder_writes_ptr,  # (1,) int64: how many remote peers get a remainder write (Flag.REMAINDER_WRITES)
    base_ptr,            # uint8: byte address space of the send buffer (with HEADERS)
    send_bytes,          # the send buffer - base, in bytes (with HEADERS)
    NODE: tl.constexpr, P: tl.constexpr, STRIDE_BYTES: tl.constexpr,
    W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr,
    STAGE_HEADER_BYTES: tl.constexpr,  # Layout.private_stage_header_offset_bytes(0)
    SLOT_BYTES: tl.constexpr,          # Layout.private_slot_bytes
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_P: tl.constexpr, HEADERS: tl.constexpr,
    RANK_ROWS: tl.constexpr = False,   # per-rank rows: the rows to each peer are the count row's last W ints
    RELAY: tl.constexpr = False,       # the relay: writes only to the remote peers of this rank's rail
    PIECES: tl.constexpr = 1,          # Layout.wire_pieces: each write as PIECES pieces (table rows [PIECES, W])
):
    """Grid (1,): the private write to every remote peer (`plan.private_writes`): one source range, the
    peer's slot of the private staging region, whose header gets this rank's count row here (with HEADERS)
    and whose rows the pack fills (`route_tokens(out_send_row=)`). E is the count row's length
    (`Layout.count_row_ints`: with per-rank rows the experts' counts, then W rows per rank)."""
    if RANK_ROWS:
        n = _routes_row(counts_ptr + (E - W), stride_counts_w, rank, W, 1, W_PAD, 1)
    else:
        n = _routes_row(counts_ptr, stride_counts_w, rank, W, L, W_PAD, L_PAD)
    peer = tl.arange(0, W_PAD)
    remote = (peer < W) & ((peer < node_first) | (peer >= node_first + NODE))
    if RELAY:  # a source writes only to its relays, the GPUs with its local index (one rail)
        remote = remote & (peer % NODE == rank % NODE)
    index = tl.where(peer >= node_first + NODE, peer - NODE, peer).to(tl.int64)  # Layout.private_stage_index
    more = n > P
    src = STAGE_HEADER_BYTES + index * SLOT_BYTES
    length = E * 4 + tl.minimum(n, P) * STRIDE_BYTES
    dst = tl.full([W_PAD], 0, tl.int64) + header_dst_bytes
    rest = tl.maximum(n - P, 0) * STRIDE_BYTES
    for piece in tl.static_range(PIECES):
        # A piece says "more" only when that piece of the remainder is not empty: its receiving proxy awaits it
        r0, r1 = _piece_bounds(rest, piece, PIECES)
        kind = tl.where(r1 > r0, _DISPATCH_MORE, _DISPATCH)
        imm = protocol_device.encode_imm(kind, tl.full([W_PAD], 0, tl.int64) + rank, tl.load(epoch_ptr))
        a, b = _piece_bounds(length, piece, PIECES)
        _store_rows(table_ptr, piece, peer, remote, src + a, b - a, dst + a, imm, W)
    tl.store(remainder_writes_ptr, tl.sum((remote & more).to(tl.int64), axis=0))
    if HEADERS:  # the count row (a row of -1 too: an aborted call) at the head of every remote peer's slot
        e = tl.arange(0, E_PAD)
        row = tl.load(counts_ptr + rank.to(tl.int64) * stride_counts_w + e, mask=e < E)
        headers = (base_ptr + send_bytes + STAGE_HEADER_BYTES).to(tl.pointer_type(tl.int32))
        for j0 in range(0, W - NODE, BLOCK_P):  # slots of the remote peers, BLOCK_P at a time
            j = j0 + tl.arange(0, BLOCK_P)[:, None]
            tl.store(headers + j.to(tl.int64) * (SLOT_BYTES // 4) + e[None, :], row[None, :] + tl.zeros_like(j),
                     mask=(j < W - NODE) & (e[None, :] < E))


# Compiled (and profiled) under a name without "combine": DeepEP's profiler helper takes the one kernel whose
# name holds "combine" for the combine (`_launch.COMBINE_SYMBOL`), so no other kernel's name may hold it.
@triton.jit(do_not_specialize=["rank", "node_first", "timeout_ns", "max_spins"],
            repr=launch.compiled_as("_plan_remainder_and_return_writes_kernel"))
def _plan_remainder_and_combine_writes_kernel(
    # inputs
    counts_ptr,          # (W, E) int32, row stride `stride_counts_w`: this rank's and its node peers' rows final
    base_ptr,            # uint8: byte address space of this rank's recv buffer (`headers_bytes` into it)
    epoch_ptr,           # (1,) int64
    failed_ptr,          # (1,) int64 sticky failure word (device)
    flags_ptr,           # (N,) int64 this rank's flags area (host memory seen through UVA on a GPU)
    stride_counts_w,
    headers_bytes,       # offset from base of source 0's private-slot header (its count row, as it landed)
    rank, node_first,
    timeout_ns, max_spins,
    # outputs (and counts_ptr: the remote sources' rows)
    remainder_ptr,       # (PIECES, W, 4) int64: the REMAINDER write table
    combine_ptr,         # (PIECES, W, 4) int64: the COMBINE write table
    NODE: tl.constexpr, P: tl.constexpr, PRIVATE_SLOT_ROWS: tl.constexpr, SLOT_WORDS: tl.constexpr,
    DISPATCH_STRIDE_BYTES: tl.constexpr, COMBINE_STRIDE_BYTES: tl.constexpr,
    COMBINE_STAGE_BYTES: tl.constexpr, COMBINE_RECV_BYTES: tl.constexpr,
    W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    MAX_ROUTES: tl.constexpr,
    PROXY_WAIT_WORD: tl.constexpr, SIGNAL_WORD: tl.constexpr, ERROR_WORD: tl.constexpr, STATUS_WORD: tl.constexpr,
    BAD_COUNTS_WORD: tl.constexpr,
    SPIN: tl.constexpr, USE_PTX: tl.constexpr, BACKOFF_NS: tl.constexpr,
    MAX_RANK_ROWS: tl.constexpr = 0,    # Layout.send_rows: the most rows per (token, rank) a source sends
    RANK_ROWS: tl.constexpr = False,    # per-rank rows: a count row ends with W rows per rank (at int W*L), and
    COMBINE_RANK: tl.constexpr = False,  # the dispatch moves those rows; COMBINE_RANK: the combine too
    # The relay (Layout.relay): a remote source's count row landed in its relay's recv buffer, the node peer
    # with its local index, at `relay_recv_ptr[s % NODE]` (offsets from base) + HEADER0_BYTES + s*SLOT_BYTES.
    relay_recv_ptr=None, HEADER0_BYTES: tl.constexpr = 0, RELAY: tl.constexpr = False,
    PIECES: tl.constexpr = 1,  # Layout.wire_pieces: each write as PIECES pieces (table rows [PIECES, W])
):
    """Grid (1,), four warps: once the proxy says every private write has landed (COUNT_ROWS_READY),
    one pass over the W count rows, BLOCK_S at a time as [BLOCK_S, W, L] tiles: the remote sources' rows
    are copied from their private-slot headers into the routing area (the proxy copies nothing), every row
    is checked (`plan.validate_counts`), and the sums the plans need are accumulated; then the remainder
    writes of this rank (`plan.remainder_writes`) and its combine writes (`plan.combine_writes`); raise
    REMAINDER_PLANNED. Each count is read once: the rows are in host memory, a PCIe read away, so the
    tiles keep many loads in flight."""
    ok = d.node_wait(flags_ptr, 0, epoch_ptr, failed_ptr, flags_ptr, 0, timeout_ns, max_spins, 0, 1, True,
                     PROXY_WAIT_WORD, 0, ERROR_WORD, STATUS_WORD, USE_PTX, SPIN, BACKOFF_NS)
    if ok:
        headers = (base_ptr + headers_bytes).to(tl.pointer_type(tl.int32))
        peer = tl.arange(0, W_PAD)
        d3 = tl.arange(0, W_PAD)[None, :, None]
        l3 = tl.arange(0, L_PAD)[None, None, :]
        expert = d3 * L + l3
        d2 = tl.arange(0, W_PAD)[None, :]
        n = tl.zeros([W_PAD], dtype=tl.int64)       # routes[rank, d]
        before = tl.zeros([W_PAD], dtype=tl.int64)  # sum_{s<rank} max(routes[s, d] - P, 0)
        n_src = tl.zeros([W_PAD], dtype=tl.int64)   # routes[s, rank]
        first = tl.zeros([W_PAD], dtype=tl.int64)   # sum_{d<rank} routes[s, d]
        bad_source = tl.full([], W_PAD, tl.int32)
        for s0 in range(0, W, BLOCK_S):
            s1 = s0 + tl.arange(0, BLOCK_S)
            s3 = s1[:, None, None]
            is_remote = (s3 < node_first) | (s3 >= node_first + NODE)
            m = (s3 < W) & (d3 < W) & (l3 < L)
            c = tl.load(counts_ptr + s3.to(tl.int64) * stride_counts_w + expert, mask=m & ~is_remote, other=0)
            # [BLOCK_S] int32 words from `headers`: where each remote source's count row landed
            hw = s1.to(tl.int64) * SLOT_WORDS
            if RELAY:
                hw += (tl.load(relay_recv_ptr + s1 % NODE, mask=s1 < W, other=0) + HEADER0_BYTES - headers_bytes) // 4
            c += tl.load(headers + hw[:, None, None] + expert, mask=m & is_remote, other=0)
            tl.store(counts_ptr + s3.to(tl.int64) * stride_counts_w + expert, c, mask=m & is_remote)
            # Sound rows: all -1 (the source aborted the call), or non-negative with at most T*K routes.
            lo = tl.min(tl.min(tl.where(m, c, 0), axis=2), axis=1)
            hi = tl.max(tl.max(tl.where(m, c, -1), axis=2), axis=1)
            total = tl.sum(tl.sum(c.to(tl.int64), axis=2), axis=1)
            bad = (s1 < W) & ~((lo == -1) & (hi == -1)) & ((lo < 0) | (total > MAX_ROUTES))
            bad_source = tl.minimum(bad_source, tl.min(tl.where(bad, s1, W_PAD), axis=0))
            routes = tl.sum(tl.maximum(c, 0).to(tl.int64), axis=2)   # [BLOCK_S, W_PAD]: routes[s, d]
            s2 = s1[:, None]
            sent = routes  # rows each source sends each rank in the dispatch (and back in the combine)
            back = routes
            if RANK_ROWS:  # the count row's last W ints: rows per (token, rank), copied and checked alike
                m2 = (s2 < W) & (d2 < W)
                rr = tl.load(counts_ptr + s2.to(tl.int64) * stride_counts_w + W * L + d2,
                             mask=m2 & ~((s2 < node_first) | (s2 >= node_first + NODE)), other=0)
                remote2 = (s2 < node_first) | (s2 >= node_first + NODE)
                rr += tl.load(headers + hw[:, None] + W * L + d2, mask=m2 & remote2, other=0)
                tl.store(counts_ptr + s2.to(tl.int64) * stride_counts_w + W * L + d2, rr, mask=m2 & remote2)
                lo_r = tl.min(tl.where(m2, rr, 0), axis=1)
                hi_r = tl.max(tl.where(m2, rr, -1), axis=1)
                total_r = tl.sum(tl.where(m2, rr, 0).to(tl.int64), axis=1)
                bad = bad | ((s1 < W) & ~((lo_r == -1) & (hi_r == -1)) & ((lo_r < 0) | (total_r > MAX_RANK_ROWS)))
                bad_source = tl.minimum(bad_source, tl.min(tl.where(bad, s1, W_PAD), axis=0))
                sent = tl.maximum(rr, 0).to(tl.int64)
                if COMBINE_RANK:
                    back = sent
            n += tl.sum(tl.where(s2 == rank, sent, 0), axis=0)
            if RELAY:  # a relay's remainder region holds only other nodes' sources (no sender knows the rest)
                before += tl.sum(tl.where((s2 < rank) & (s2 // NODE != d2 // NODE), tl.maximum(sent - P, 0), 0), axis=0)
            else:
                before += tl.sum(tl.where(s2 < rank, tl.maximum(sent - P, 0), 0), axis=0)
            to_me = tl.sum(tl.where(d2 == rank, back, 0), axis=1)  # [BLOCK_S]
            below = tl.sum(tl.where(d2 < rank, back, 0), axis=1)
            row_of = s2 == d2                                       # block row i is source s0 + i
            n_src += tl.sum(tl.where(row_of, to_me[:, None], 0), axis=0)
            first += tl.sum(tl.where(row_of, below[:, None], 0), axis=0)
        if bad_source < W:
            tl.store(flags_ptr + BAD_COUNTS_WORD, 1 + bad_source.to(tl.int64))
            tl.store(failed_ptr, 1)
        else:
            _store_plans(remainder_ptr, combine_ptr, flags_ptr + SIGNAL_WORD, epoch_ptr, peer, rank, node_first,
                         n, before, n_src, first, NODE, P, PRIVATE_SLOT_ROWS, DISPATCH_STRIDE_BYTES,
                         COMBINE_STRIDE_BYTES, COMBINE_STAGE_BYTES, COMBINE_RECV_BYTES, W, W_PAD, USE_PTX, RELAY,
                         PIECES)


@triton.jit
def _store_plans(remainder_ptr, combine_ptr, planned_ptr, epoch_ptr, peer, rank, node_first, n, before, n_src, first,
                 NODE: tl.constexpr, P: tl.constexpr, PRIVATE_SLOT_ROWS: tl.constexpr,
                 DISPATCH_STRIDE_BYTES: tl.constexpr, COMBINE_STRIDE_BYTES: tl.constexpr,
                 COMBINE_STAGE_BYTES: tl.constexpr, COMBINE_RECV_BYTES: tl.constexpr,
                 W: tl.constexpr, W_PAD: tl.constexpr, USE_PTX: tl.constexpr, RELAY: tl.constexpr,
                 PIECES: tl.constexpr):
    """The REMAINDER and COMBINE tables from the pass's sums, then REMAINDER_PLANNED (release)."""
    epoch = tl.load(epoch_ptr)
    remote = (peer < W) & ((peer < node_first) | (peer >= node_first + NODE))
    if RELAY:  # this rank exchanges writes with its rail only: its relays, and the sources it relays for
        remote = remote & (peer % NODE == rank % NODE)
    me = tl.full([W_PAD], 0, tl.int64) + rank
    # ---- remainder: this rank's routes past the private region, to every remote d with n[d] > P; they
    # land after the private slots and the remainders of every source s < rank (same-node sources
    # included: the formula is the same on every rank).
    off = tl.cumsum(n, axis=0) - n
    has_rest = remote & (n > P)
    imm = protocol_device.encode_imm(tl.full([W_PAD], _DISPATCH_REMAINDER, tl.int64), me, epoch)
    _store_pieces(remainder_ptr, peer, has_rest, (off + P) * DISPATCH_STRIDE_BYTES,
                  (n - P) * DISPATCH_STRIDE_BYTES, (W * PRIVATE_SLOT_ROWS + before) * DISPATCH_STRIDE_BYTES, imm, W,
                  PIECES)
    # ---- combine: to every remote source s, its rows (staged source-major) back to the slots its
    # dispatch send buffer used: routes[s, rank] rows from stage[s], landing at sum_{d<rank} routes[s, d].
    stage = tl.cumsum(n_src, axis=0) - n_src
    imm = protocol_device.encode_imm(tl.full([W_PAD], _COMBINE, tl.int64), me, epoch)
    _store_pieces(combine_ptr, peer, remote, COMBINE_STAGE_BYTES + stage * COMBINE_STRIDE_BYTES,
                  n_src * COMBINE_STRIDE_BYTES, COMBINE_RECV_BYTES + first * COMBINE_STRIDE_BYTES, imm, W, PIECES)
    d.publish_epoch(planned_ptr, epoch_ptr, USE_PTX)

