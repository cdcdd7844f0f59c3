"""The protocol arithmetic: writes never overlap, stay inside buffers, imm counts add up, and every write
puts each row where the protocol, simulated row by row without plan.py, says it goes."""
from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from moe_a2a.protocol import plan
from moe_a2a.config import A2AConfig
from moe_a2a.protocol.words import Imm, decode_imm, encode_imm


@given(kind=st.sampled_from(list(Imm)), rank=st.integers(0, 4095), epoch=st.integers(1, 10**9))
def test_imm_round_trip(kind, rank, epoch):
    k, r, e = decode_imm(encode_imm(kind, rank, epoch))
    assert (k, r) == (int(kind), rank) and e == epoch % (1 << 16)


@settings(max_examples=60, deadline=None)
@given(W=st.sampled_from([1, 2, 4, 8]), node=st.sampled_from([1, 2, 4, 8]), T=st.integers(1, 9),
       K=st.integers(1, 4), private=st.sampled_from([None, 0, 1, 5]), skew=st.booleans(), seed=st.integers(0, 99))
def test_dispatch_and_combine_writes_fit_and_do_not_overlap(W, node, T, K, private, skew, seed):
    node = min(node, W)
    cfg = A2AConfig(max_num_tokens=T, num_experts=2 * W, experts_per_token=K, hidden_dim=8,
                    in_dtype=torch.float32, max_private_tokens=private)
    lay = cfg.layout(W, node)
    rng = np.random.default_rng(seed)
    counts = np.zeros((W, lay.num_experts), np.int64)
    for s in range(W):
        experts = np.zeros(T * K, np.int64) if skew else rng.integers(-1, lay.num_experts, T * K)
        counts[s] = np.bincount(experts[experts >= 0], minlength=lay.num_experts)
    plan.validate_counts(counts, lay)
    routes = plan.route_matrix(counts, lay)

    def dispatch_writes(s):
        return plan.private_writes(counts[s], s, lay).tolist() + plan.remainder_writes(routes, s, lay).tolist()

    for d in range(W):
        spans = []  # (start, end) byte spans written into d's recv buffer during dispatch
        for s in range(W):
            for peer, src, n, dst in plan.private_writes(counts[s], s, lay).tolist():
                # one range of the private staging region: the count row, then the rows
                assert lay.private_stage_offset_bytes <= src and src + n <= lay.combine_stage_offset_bytes
                assert n >= lay.routing_row_bytes
                if peer == d:  # one write, never empty
                    assert dst == lay.private_header_offset_bytes(s)
                    spans.append((dst, dst + n))
            for peer, src, n, dst in plan.remainder_writes(routes, s, lay).tolist():
                assert 0 <= src and src + n <= lay.max_routes * lay.dispatch_stride_bytes
                if peer == d and n:
                    spans.append((dst, dst + n))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "dispatch writes overlap"
        # the dispatch regions end where the combine region starts: no barrier is needed between phases
        assert all(e <= lay.combine_recv_offset_bytes for _, e in spans)
        # remote senders deliver exactly what the receiver expects to count
        exp = plan.expected_dispatch_imms(routes, d, lay)
        sent = {s: sum(1 for p, *_ in dispatch_writes(s) if p == d) for s in lay.remote_peers(d)}
        assert exp == sent
        # combine: d's writes land in each source's recv buffer inside [0, T*K) slots, disjoint per sender
    for s in range(W):
        spans = sorted((dst, dst + n) for d in range(W) for p, _, n, dst in plan.combine_writes(routes, d, lay).tolist()
                       if p == s and n)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        region = lay.combine_recv_offset_bytes
        assert all(region <= a and e <= region + lay.max_routes * lay.combine_stride_bytes for a, e in spans)
        # and their sources, staged after the dispatch rows of the expert's send buffer
        for d in range(W):
            for _, src, n, _ in plan.combine_writes(routes, d, lay).tolist():
                assert lay.combine_stage_offset_bytes >= lay.max_routes * lay.dispatch_stride_bytes
                assert src >= lay.combine_stage_offset_bytes and src + n <= lay.send_bytes


# The protocol simulated row by row from its definition (docs/design.md, "Buffer layout"; docs/protocol.md,
# 2.4), with no function of plan.py: the expectations the vectorised writes must reproduce exactly.
@dataclass
class Simulated:
    """Every remote row's journey, as byte offsets: maps `dst -> src` per (sender, receiver) pair."""

    private: dict = field(default_factory=dict)      # (s, d) -> {dst in d's recv: src in s's send}
    header: dict = field(default_factory=dict)       # (s, d) -> where s's count row lands in d's recv buffer
    stage_header: dict = field(default_factory=dict)  # (s, d) -> where s's count row for d is in s's send buffer
    send_row: dict = field(default_factory=dict)     # s -> {send slot: the row the pack writes it to}
    remainder: dict = field(default_factory=dict)    # (s, d) -> {dst: src}, only pairs with rows beyond P
    combine: dict = field(default_factory=dict)      # (expert rank d, home s) -> {dst in s's recv: src in d's send}
    imms: dict = field(default_factory=dict)         # d -> {remote s: DISPATCH writes s sends d}
    segments: dict = field(default_factory=dict)     # d -> (rows per local expert, first row of each)


def simulate(experts: list[list[int]], lay) -> Simulated:
    """experts[s]: the expert of each of source s's live routes. Walks every route of every source."""
    W, L, P, S, C = lay.world_size, lay.num_local_experts, lay.private_rows, lay.dispatch_stride_bytes, \
        lay.combine_stride_bytes
    # A source's send slots hold its routes expert-major (stable), so each destination's run is contiguous.
    slots_to = [[[j for j, e in enumerate(sorted(experts[s])) if e // L == d] for d in range(W)] for s in range(W)]
    sim = Simulated()
    # The sender's private staging region: a slot per remote peer (in rank order, its own node skipped),
    # shaped as the receiver's private slot; a remote peer's first P routes are packed there, not at their slot.
    for s in range(W):
        remote = [d for d in range(W) if not lay.same_node(s, d)]
        sim.send_row[s] = {j: j for j in range(len(experts[s]))}
        for index, d in enumerate(remote):
            rows_at = lay.max_routes + index * lay.private_slot_rows + lay.header_rows
            sim.stage_header[s, d] = rows_at * S - lay.routing_row_bytes
            for i, j in enumerate(slots_to[s][d][:P]):
                sim.send_row[s][j] = rows_at + i
    for d in range(W):
        remainder_at = W * lay.private_slot_rows      # the remainder region: sources in rank order, holes kept
        for s in range(W):
            mine = slots_to[s][d]
            if not lay.same_node(s, d):
                rows_at = lay.private_offset_bytes + (s * lay.private_slot_rows + lay.header_rows) * S
                sim.header[s, d] = rows_at - lay.routing_row_bytes     # the count row, right before the rows
                sim.private[s, d] = {rows_at + i * S: sim.send_row[s][j] * S for i, j in enumerate(mine[:P])}
                if len(mine) > P:
                    sim.remainder[s, d] = {(remainder_at + i) * S: j * S for i, j in enumerate(mine[P:])}
                sim.imms.setdefault(d, {})[s] = 1 + (len(mine) > P)
            remainder_at += max(0, len(mine) - P)
        staged = 0                                    # expert rank d stages outputs source-major, all sources
        for s in range(W):
            mine = slots_to[s][d]
            if not lay.same_node(s, d):
                sim.combine[d, s] = {lay.combine_recv_offset_bytes + j * C:
                                     lay.combine_stage_offset_bytes + (staged + i) * C for i, j in enumerate(mine)}
            staged += len(mine)
        totals = [sum(e == d * L + l for ex in experts for e in ex) for l in range(L)]
        padded = [-(-n // lay.expert_padding) * lay.expert_padding for n in totals]
        sim.segments[d] = (totals, [sum(padded[:l]) for l in range(L)])
    return sim


def rows_of(write, stride: int, skip: int = 0) -> dict:
    """A write (peer, src, length, dst) as {dst row byte: src row byte}; `skip` bytes of header first."""
    _, src, n, dst = (int(v) for v in write)
    assert (n - skip) % stride == 0, write
    return {dst + skip + i * stride: src + skip + i * stride for i in range((n - skip) // stride)}


@settings(max_examples=80, deadline=None)
@given(W=st.sampled_from([1, 2, 3, 4, 8, 16]), node=st.sampled_from([1, 2, 4]), L=st.sampled_from([1, 2, 3, 9]),
       T=st.integers(1, 40), K=st.integers(1, 8), private=st.sampled_from([None, 0, 1, 7]),
       pad=st.sampled_from([1, 4, 16]), seed=st.integers(0, 999))
def test_writes_equal_the_protocol_simulated_row_by_row(W, node, L, T, K, private, pad, seed):
    node = node if W % node == 0 else 1
    cfg = A2AConfig(max_num_tokens=T, num_experts=L * W, experts_per_token=K, hidden_dim=8,
                    in_dtype=torch.float32, max_private_tokens=private, expert_padding=pad)
    lay = cfg.layout(W, node)
    rng = np.random.default_rng(seed)
    hot = rng.integers(0, lay.num_experts)  # skewed: some peers beyond the private region, others not
    draws = np.where(rng.random((W, T * K)) < 0.5, hot, rng.integers(-1, lay.num_experts, (W, T * K)))
    experts = [[int(e) for e in row if e >= 0] for row in draws]
    counts = np.array([[ex.count(e) for e in range(lay.num_experts)] for ex in experts], dtype=np.int64)
    sim = simulate(experts, lay)
    routes = plan.route_matrix(counts, lay)
    assert routes.tolist() == [[sum(e // L == d for e in ex) for d in range(W)] for ex in experts]
    S, C = lay.dispatch_stride_bytes, lay.combine_stride_bytes
    for r in range(W):
        remote = [p for p in range(W) if not lay.same_node(r, p)]
        # One private write to every remote peer (zero rows too: it carries the count row and the immediate).
        priv = plan.private_writes(counts[r], r, lay)
        assert priv.dtype == np.int64 and priv[:, 0].tolist() == remote
        for w in priv:
            d = int(w[0])
            assert int(w[3]) == sim.header[r, d] and int(w[1]) == sim.stage_header[r, d], (r, d)
            assert rows_of(w, S, skip=lay.routing_row_bytes) == sim.private[r, d], (r, d)
        staged = plan.private_stage_rows(counts[r], r, lay)
        assert {j: int(staged[j]) for j in sim.send_row[r]} == sim.send_row[r], r
        rem = plan.remainder_writes(routes, r, lay)
        assert rem.dtype == np.int64 and rem[:, 0].tolist() == [d for d in remote if (r, d) in sim.remainder]
        for w in rem:
            assert rows_of(w, S) == sim.remainder[r, int(w[0])], (r, int(w[0]))
        # Combine: rank r as the expert side, one write to every remote home, zero-length ones kept.
        comb = plan.combine_writes(routes, r, lay)
        assert comb.dtype == np.int64 and comb[:, 0].tolist() == remote
        for w in comb:
            assert rows_of(w, C) == sim.combine[r, int(w[0])], (r, int(w[0]))
        assert plan.expected_dispatch_imms(routes, r, lay) == sim.imms.get(r, {})
        totals, starts = plan.expert_segments(counts, r, lay)
        assert (totals.tolist(), starts.tolist()) == sim.segments[r], r


def test_validate_counts_refuses_overflowing_rows():
    lay = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=2).layout(2)
    bad = np.zeros((2, 4), np.int64)
    bad[1, 0] = 5  # > T*K = 4
    try:
        plan.validate_counts(bad, lay)
    except ValueError as e:
        assert "ranks [1]" in str(e)
    else:
        raise AssertionError("no error")


def test_immediates_of_neighbouring_calls_differ_across_the_epoch_wrap():
    """The immediate carries the epoch's low IMM_EPOCH_BITS bits; counters are keyed by the exact value
    and purged when consumed, so only calls 2**IMM_EPOCH_BITS apart could share a key, and no peer runs
    that far ahead (each call needs every peer's data of the previous one)."""
    from moe_a2a.protocol.words import IMM_EPOCH_BITS

    wrap = 1 << IMM_EPOCH_BITS
    for e in (wrap - 2, wrap - 1, wrap, wrap + 1):
        for kind in Imm:
            for rank in (0, 7, 4095):
                a, b = encode_imm(kind, rank, e), encode_imm(kind, rank, e + 1)
                assert a != b and 0 <= a < 2**32
                assert decode_imm(a) == (int(kind), rank, e % wrap)
    assert encode_imm(Imm.DISPATCH, 3, wrap) == encode_imm(Imm.DISPATCH, 3, 0)  # the only aliasing


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 1 << 20), min_size=1, max_size=6), pieces=st.integers(1, 16),
       src=st.integers(0, 1 << 30), dst=st.integers(0, 1 << 30))
def test_pieces_of_a_write_tile_it_in_order(lengths, pieces, src, dst):
    """`plan.split_writes`: the pieces of each write, one per proxy, cover it exactly once, in order, starting at
    multiples of PIECE_ALIGN_BYTES from its start, source and destination advanced alike; a write of at least
    PIECE_ALIGN_BYTES per piece has no empty piece (a short one's first pieces may be)."""
    from moe_a2a.protocol.words import PIECE_ALIGN_BYTES

    writes = np.array([(i + 3, src + 16 * i, n, dst + 32 * i) for i, n in enumerate(lengths)], np.int64)
    parts = plan.split_writes(writes, pieces)
    assert parts.shape == (pieces, len(lengths), 4)
    for i, (peer, s0, n, d0) in enumerate(writes.tolist()):
        at = 0
        for j in range(pieces):
            p, s, m, d = parts[j, i].tolist()
            assert p == peer and s - s0 == d - d0 == at and m >= 0
            assert at % PIECE_ALIGN_BYTES == 0
            at += m
        assert at == n
        if n >= pieces * PIECE_ALIGN_BYTES:
            assert (parts[:, i, 2] > 0).all()
    assert (plan.split_writes(writes, 1)[0] == writes).all()
