"""The protocol arithmetic: writes never overlap, stay inside buffers, and imm counts add up."""
import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from moe_a2a import plan
from moe_a2a.config import A2AConfig, Imm


@given(kind=st.sampled_from(list(Imm)), rank=st.integers(0, 4095), epoch=st.integers(1, 10**9))
def test_imm_round_trip(kind, rank, epoch):
    k, r, e = plan.split_imm(plan.make_imm(kind, rank, epoch))
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
    for d in range(W):
        spans = []  # (start, end) byte spans written into d's recv buffer during dispatch
        for s in range(W):
            for peer, src, n, dst in plan.private_writes(counts[s], s, lay) + plan.remainder_writes(counts, s, lay):
                assert 0 <= src and src + n <= lay.max_routes * lay.dispatch_stride_bytes
                if peer == d and n:
                    spans.append((dst, dst + n))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "dispatch writes overlap"
        assert all(e <= lay.recv_bytes for _, e in spans)
        # remote senders deliver exactly what the receiver expects to count
        exp = plan.expected_dispatch_imms(counts, d, lay)
        sent = {s: sum(1 for p, *_ in plan.private_writes(counts[s], s, lay) + plan.remainder_writes(counts, s, lay)
                       if p == d) for s in lay.remote_peers(d)}
        assert exp == sent
        # combine: d's writes land in each source's recv buffer inside [0, T*K) slots, disjoint per sender
    for s in range(W):
        spans = sorted((dst, dst + n) for d in range(W) for p, _, n, dst in plan.combine_writes(counts, d, lay)
                       if p == s and n)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert all(e <= lay.max_routes * lay.combine_stride_bytes for _, e in spans)


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
