"""The protocol arithmetic: writes never overlap, stay inside buffers, and imm counts add up."""
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
                assert 0 <= src and src + n <= lay.max_routes * lay.dispatch_stride_bytes
                if peer == d:  # the count row, then the rows: one write, never empty
                    assert dst == lay.private_header_offset_bytes(s)
                    spans.append((dst, dst + lay.routing_row_bytes + n))
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


# The writes spelled out one peer at a time from the per-rank definitions: the specification the
# proxy's vectorised versions (all peers at once) must match exactly.
def _private_by_peer(counts, r, lay):
    n, off, P, S = plan.rank_counts(counts[r], lay), plan.send_offsets(counts[r], lay), lay.private_rows, \
        lay.dispatch_stride_bytes
    # the count row lands in the last 4E bytes of r's header rows, its rows right after them
    head = lay.private_offset_bytes + (r * (lay.header_rows + P) + lay.header_rows) * S - 4 * lay.num_experts
    return [(d, off[d] * S, min(n[d], P) * S, head) for d in lay.remote_peers(r)]


def _remainder_by_peer(counts, r, lay):
    n, off, P, S = plan.rank_counts(counts[r], lay), plan.send_offsets(counts[r], lay), lay.private_rows, \
        lay.dispatch_stride_bytes
    return [(d, (off[d] + P) * S, (n[d] - P) * S, plan.remainder_offsets(plan.recv_counts(counts, d, lay), lay)[r] * S)
            for d in lay.remote_peers(r) if n[d] > P]


def _combine_by_peer(counts, r, lay):
    n, S = plan.recv_counts(counts, r, lay), lay.combine_stride_bytes
    stage = plan.combine_stage_offsets(n)
    return [(s, lay.combine_stage_offset_bytes + stage[s] * S, n[s] * S,
             lay.combine_recv_offset_bytes + plan.send_offsets(counts[s], lay)[r] * S)
            for s in lay.remote_peers(r)]


@settings(max_examples=80, deadline=None)
@given(W=st.sampled_from([1, 2, 3, 4, 8, 16]), node=st.sampled_from([1, 2, 4]), L=st.sampled_from([1, 2, 3, 9]),
       T=st.integers(1, 40), K=st.integers(1, 8), private=st.sampled_from([None, 0, 1, 7]), seed=st.integers(0, 999))
def test_vectorised_writes_equal_the_per_peer_definitions(W, node, L, T, K, private, seed):
    node = node if W % node == 0 else 1
    cfg = A2AConfig(max_num_tokens=T, num_experts=L * W, experts_per_token=K, hidden_dim=8,
                    in_dtype=torch.float32, max_private_tokens=private)
    lay = cfg.layout(W, node)
    rng = np.random.default_rng(seed)
    hot = rng.integers(0, lay.num_experts)  # skewed: some peers beyond the private region, others not
    experts = np.where(rng.random((W, T * K)) < 0.5, hot, rng.integers(-1, lay.num_experts, (W, T * K)))
    counts = np.stack([np.bincount(e[e >= 0], minlength=lay.num_experts) for e in experts]).astype(np.int64)
    routes = plan.route_matrix(counts, lay)
    assert (routes == np.stack([plan.rank_counts(c, lay) for c in counts])).all()
    for r in range(W):
        for got, want in ((plan.private_writes(counts[r], r, lay), _private_by_peer(counts, r, lay)),
                          (plan.remainder_writes(routes, r, lay), _remainder_by_peer(counts, r, lay)),
                          (plan.combine_writes(routes, r, lay), _combine_by_peer(counts, r, lay))):
            assert got.dtype == np.int64 and got.shape == (len(want), 4)
            assert got.tolist() == [[int(v) for v in w] for w in want]
        n = plan.recv_counts(counts, r, lay)
        assert plan.expected_dispatch_imms(routes, r, lay) == {s: 1 + int(n[s] > lay.private_rows)
                                                               for s in lay.remote_peers(r)}


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
