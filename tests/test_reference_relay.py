"""The relay's specification in moe_a2a/reference.py (issue 46): the dispatch through relays delivers exactly
`reference.dispatch`; the relay combine is deterministic, invariant where it must be, and within a derived
bound of `reference.combine`; its byte counts equal the rows it returns and reproduce issue 46's table.

The bound (notation of tests/test_reference_bytes.py: u = unit roundoff of out_dtype, v = 2**-24,
g = K v / (1 - K v); per output element S = sum_k w_k y_k exactly, A = sum_k |w_k y_k| over the live k).
Every fp32 operation of the relay combine is a node of one summation tree over the token's live products:
a product w_k y_k (one rounding), the adds of a rank's partial (k order), the relay's adds of its node's
partials (rank order), the home's adds of at most K rows (node order). An add of +0 (each sum starts there)
is exact, so the products of node m (K_m of them) reach that node's row through at most K_m <= K fp32
roundings: |Q_m - S_m| <= g A_m, then ONE rounding to out_dtype (<= u |Q_m|), and the home adds at most K
rows in fp32 (<= g sum |B_m|) and casts once. That is the sender-reduced combine's chain, so its bound holds:
  |relay - S| <= u (|S| + d A) + d A, d = u (1 + g) + g + g (1 + u)(1 + g),
  |relay - combine| <= 2u |S| + (1 + u)(d + g) A   (about 3 ulps of A in bf16: 2u|S| + u A).
fp8 rows (every row reaching a home; partials to the relay stay fp32): at most K rows, each scale <=
blockmax(A) (1 + g) / 448, so test_reference_bytes' sender-reduced fp8 bound against S holds as stated there;
against `combine` add combine's own u (|S| + g A) + g A.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe_a2a import reference as R
from moe_a2a.config import A2AConfig
from .test_reference_bytes import UNIT, V, _exact, _sender_vs_receiver_bound


def _routing(g: torch.Generator, W: int, T: int, K: int, E: int, masked: float, skew: str, dup: bool):
    """Per rank `[T, K]` int64: uniform; `skew="one"`: every route to expert 0, `"half"`: half the routes to
    it; -1 with probability `masked`; `dup`: slot 1 repeats slot 0 (a duplicate expert in a token's top-k)."""
    out = []
    for _ in range(W):
        idx = torch.randint(0, E, (T, K), generator=g)
        if skew != "uniform":
            idx[torch.rand(T, K, generator=g) < (1.0 if skew == "one" else 0.5)] = 0
        idx[torch.rand(T, K, generator=g) < masked] = -1
        if dup and K >= 2:
            idx[:, 1] = idx[:, 0]
        out.append(idx)
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _same(a, b) -> bool:
    """Two `dispatch` results, bitwise."""
    return all(torch.equal(n1, n2) and _bits(x1).equal(_bits(x2))
               and ((s1 is None and s2 is None) or torch.equal(s1, s2))
               for (n1, x1, s1), (n2, x2, s2) in zip(a, b, strict=True))


def test_hand_worked_two_nodes_of_two():
    # W = 4 as 2 nodes x 2 ranks, 8 experts (2 a rank). Rank 0 token 0 -> (2, 7, 6): ranks 1, 3, 3;
    # token 1 -> (5, 5, -1): rank 2 twice (a duplicate). Rank 3 token 0 -> (0, 3, 4): ranks 0, 1, 2.
    cfg = A2AConfig(max_num_tokens=2, num_experts=8, experts_per_token=3, hidden_dim=1, in_dtype=torch.float32)
    xs = [torch.tensor([[10.0], [11.0]]), torch.zeros(0, 1), torch.zeros(0, 1), torch.tensor([[30.0]])]
    idx = [torch.tensor([[2, 7, 6], [5, 5, -1]]), torch.zeros(0, 3, dtype=torch.int64),
           torch.zeros(0, 3, dtype=torch.int64), torch.tensor([[0, 3, 4]])]
    w = [torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, 9.0]]), torch.zeros(0, 3), torch.zeros(0, 3),
         torch.tensor([[1.0, 10.0, 100.0]])]
    got = R.dispatch_relay(cfg, xs, None, idx, node_size=2, weights=w)
    assert _same(got.out, R.dispatch(cfg, xs, None, idx))
    # rank 0's relay on node 1 is rank 2 (local index 0): both tokens once, ids of node 1 only
    assert sorted(got.network) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    hop = got.network[(0, 2)]
    assert hop.tokens.tolist() == [0, 1] and hop.indices.tolist() == [[-1, 7, 6], [5, 5, -1]]
    assert hop.weights.tolist() == w[0].tolist()
    # rank 3's relay on node 0 is rank 1: token 0 (ids 0, 3 there)
    assert got.network[(3, 1)].indices.tolist() == [[0, 3, -1]]
    # the relay (rank 2) keeps token 1 (expert 5: local to it) and forwards token 0 to rank 3
    assert got.received[2][0].tokens.tolist() == [1] and got.received[3][0].tokens.tolist() == [0]
    assert got.received[1][0].indices.tolist() == [[2, 7, 6]]   # same node: today's per-rank row
    assert got.received[0][3].x.tolist() == [[30.0]]             # forwarded by rank 1

    ys = [x.clone() for _, x, _ in got.out]                      # identity experts, fp32 out: exact sums
    cfg32 = A2AConfig(max_num_tokens=2, num_experts=8, experts_per_token=3, hidden_dim=1,
                      in_dtype=torch.float32, out_dtype=torch.float32)
    rows = R.combine_relay_rows(cfg32, idx, w, ys, node_size=2)
    assert rows.partials[(3, 0)][1].tolist() == [[50.0]]          # rank 3: 2*10 + 3*10 for token 0
    assert rows.relay_rows[(2, 0)][0].tolist() == [0, 1]          # one row per (token, node 1) to rank 0
    assert rows.relay_rows[(2, 0)][1].tolist() == [[50.0], [0.75 * 11]]
    assert rows.relay_rows[(1, 3)][1].tolist() == [[330.0]]       # node 0's ranks 0 and 1 summed at rank 1
    out = R.combine_relay(cfg32, idx, w, ys, node_size=2)
    assert out[0][:, 0].tolist() == [60.0, 0.75 * 11]             # t0: rank 1's 10, then node 1's 50
    assert out[3][:, 0].tolist() == [3330.0]                      # node 0's 330, then its own rank 2's 3000

    size = R.relay_row_bytes(cfg, fp8=False)
    assert size == {"dispatch": 16 + 48, "combine": 16, "partial": 16}   # 3 (expert, position) + 3 weights
    b = R.relay_bytes_per_phase(cfg, idx, node_size=2)
    # rank 0: keeps nothing, t0 to rank 1 (node), both tokens to relay 2 (network, one write); as the relay of
    # rank 2 (no tokens) it forwards nothing. Combine: rank 0 holds rank 3's expert 0 (fp32 partial to relay 1)
    assert b[0] == {"dispatch": {"self": 0, "node": 64, "remote": 128, "fanout": 0},
                    "combine": {"self": 0, "node": 0, "partials": 16, "remote": 0},
                    "writes": {"dispatch": 1, "combine": 0}}
    # rank 2 relays rank 0's two tokens: forwards t0 to rank 3; sends two combine rows to rank 0 (and rank 3,
    # of its node, its partial of expert 4)
    assert b[2]["dispatch"]["fanout"] == 64 and b[2]["combine"] == {"self": 0, "node": 16, "partials": 0, "remote": 32}
    assert b[1]["combine"]["remote"] == 16 and b[1]["writes"] == {"dispatch": 0, "combine": 1}
    assert R.bytes_per_node(b, 2)[0]["dispatch"]["remote"] == 128 + 0


@settings(max_examples=40, deadline=None)
@given(nodes=st.integers(2, 4), node_size=st.integers(1, 4), T=st.integers(0, 4), K=st.integers(1, 8),
       L=st.integers(1, 2), pad=st.sampled_from([1, 2]), masked=st.sampled_from([0.0, 0.3]),
       skew=st.sampled_from(["uniform", "half", "one"]), dup=st.booleans(), scaled=st.booleans(),
       capacity=st.sampled_from([None, None, None, 2]), seed=st.integers(0, 2**16))
def test_relay_dispatch_is_the_reference_and_its_bytes_are_its_rows(
        nodes, node_size, T, K, L, pad, masked, skew, dup, scaled, capacity, seed):
    g = torch.Generator().manual_seed(seed)
    W, H = nodes * node_size, 5
    E = W * L
    in_dtype = torch.float8_e4m3fn if scaled else torch.bfloat16
    cfg = A2AConfig(max_num_tokens=4, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=in_dtype,
                    scale_block=2 if scaled else None, expert_padding=1 if capacity else pad,
                    expert_capacity=capacity)
    xs = [torch.randn(T, H, generator=g).to(in_dtype) for _ in range(W)]
    scales = [torch.rand(T, cfg.num_scales, generator=g) for _ in range(W)] if scaled else None
    idx = _routing(g, W, T, K, E, masked, skew, dup)
    w = [torch.rand(T, K, generator=g) for _ in range(W)]
    try:
        want = R.dispatch(cfg, xs, scales, idx)
    except ValueError as e:           # an expert over expert_capacity: the relay refuses it alike
        assert "expert_capacity" in str(e)
        with pytest.raises(ValueError, match="expert_capacity"):
            R.dispatch_relay(cfg, xs, scales, idx, node_size, w)
        return
    got = R.dispatch_relay(cfg, xs, scales, idx, node_size, w)
    assert _same(got.out, want)

    node = lambda r: r // node_size  # noqa: E731
    per_rank = R.dispatch_rows_per_rank(cfg, xs, scales, idx, w)
    assert sorted(got.network) == sorted((s, R.relay_rank(s, n, node_size)) for s in range(W)
                                         for n in range(nodes) if n != node(s))
    for (s, q), hop in got.network.items():
        assert q % node_size == s % node_size                                   # rail-aligned
        n = node(q)
        routed = [t for t in range(T) if any(e >= 0 and node(e // L) == n for e in idx[s][t].tolist())]
        assert hop.tokens.tolist() == routed                                    # once per (token, node)
        assert _bits(hop.x).equal(_bits(xs[s][routed]))
        assert scales is None or torch.equal(hop.x_scale, scales[s][routed])
        on_n = [[e if e >= 0 and node(e // L) == n else -1 for e in idx[s][t].tolist()] for t in routed]
        assert hop.indices.tolist() == on_n and torch.equal(hop.weights, w[s][routed])
    for r in range(W):
        for s in range(W):
            a, b = got.received[r][s], per_rank[r][s]
            assert torch.equal(a.tokens, b.tokens) and _bits(a.x).equal(_bits(b.x))
            if node(s) == node(r):
                assert torch.equal(a.indices, b.indices)
            else:                                                               # forwarded: node ids only
                assert torch.equal(a.indices, R._only_on(cfg, b.indices, node(r) * node_size, node_size, W))
                hop = got.network[(s, R.relay_rank(s, node(r), node_size))]
                assert set(a.tokens.tolist()) <= set(hop.tokens.tolist())

    # bytes: counted from the rows returned here
    for fp8 in (False, True):
        size = R.relay_row_bytes(cfg, fp8)
        ys = [torch.zeros(x.shape[0], H, dtype=cfg.out_dtype) for _, x, _ in want]
        crow = R.combine_relay_rows(cfg, idx, w, ys, node_size, fp8)
        b = R.relay_bytes_per_phase(cfg, idx, node_size, fp8)
        today = R.bytes_per_phase(cfg, idx, node_size, R.Wire("rank", "rank", fp8))
        for q in range(W):
            assert {k: b[q][ph][k] for ph in ("dispatch", "combine") for k in ("self", "node")} == \
                {k: today[q][ph][k] for ph in ("dispatch", "combine") for k in ("self", "node")}
            mine = [(s, hop) for (s, qq), hop in got.network.items() if s == q]
            assert b[q]["dispatch"]["remote"] == sum(len(h.tokens) for _, h in mine) * size["dispatch"]
            assert b[q]["writes"]["dispatch"] == sum(len(h.tokens) > 0 for _, h in mine)
            fwd = sum(len(got.received[r][s].tokens) for r in range(W) if node(r) == node(q) and r != q
                      for s in range(W) if node(s) != node(q) and R.relay_rank(s, node(q), node_size) == q)
            assert b[q]["dispatch"]["fanout"] == fwd * size["dispatch"]
            back = [(s, t) for (qq, s), (t, _) in crow.relay_rows.items() if qq == q]
            assert b[q]["combine"]["remote"] == sum(len(t) for _, t in back) * size["combine"]
            assert b[q]["writes"]["combine"] == sum(len(t) > 0 for _, t in back)
            part = sum(len(t) for (r, s), (t, _) in crow.partials.items()
                       if r == q and node(s) != node(q) and R.relay_rank(s, node(q), node_size) != q)
            assert b[q]["combine"]["partials"] == part * size["partial"]
        # the fan-out (kept rows included) delivers exactly the per-rank rows that crossed nodes before
        remote_rank_rows = sum(t["dispatch"]["remote"] for t in today) // size["dispatch"]
        kept = sum(len(got.received[r][s].tokens) for r in range(W) for s in range(W)
                   if node(s) != node(r) and R.relay_rank(s, node(r), node_size) == r)
        assert sum(x["dispatch"]["fanout"] for x in b) // size["dispatch"] + kept == remote_rank_rows
        per_node = R.bytes_per_node(b, node_size)
        assert sum(n["dispatch"]["remote"] for n in per_node) == sum(x["dispatch"]["remote"] for x in b)


@settings(max_examples=40, deadline=None)
@given(nodes=st.integers(2, 4), node_size=st.integers(1, 4), T=st.integers(0, 4), K=st.integers(1, 8),
       L=st.integers(1, 2), out_dtype=st.sampled_from([torch.bfloat16, torch.float32]), fp8=st.booleans(),
       masked=st.sampled_from([0.0, 0.3]), skew=st.sampled_from(["uniform", "half", "one"]), dup=st.booleans(),
       scale=st.sampled_from([1.0, 1e3]), seed=st.integers(0, 2**16))
def test_relay_combine_is_within_the_derived_bound_deterministic_and_degenerates_to_the_sender_reduce(
        nodes, node_size, T, K, L, out_dtype, fp8, masked, skew, dup, scale, seed):
    g = torch.Generator().manual_seed(seed)
    W, H = nodes * node_size, 16
    E = W * L
    out_dtype = torch.bfloat16 if fp8 else out_dtype
    cfg = A2AConfig(max_num_tokens=4, num_experts=E, experts_per_token=K, hidden_dim=H,
                    in_dtype=torch.float32, out_dtype=out_dtype)
    idx = _routing(g, W, T, K, E, masked, skew, dup)
    rows = [x.shape[0] for _, x, _ in R.dispatch(cfg, [torch.zeros(T, H)] * W, None, idx)]
    ys = [(scale * torch.randn(n, H, generator=g)).to(out_dtype) for n in rows]
    w = [torch.rand(T, K, generator=g) * 2 - 0.5 for _ in range(W)]       # some negative: cancellation
    relay = R.combine_relay(cfg, idx, w, ys, node_size, fp8=fp8)
    receiver = R.combine(cfg, idx, w, ys)
    S, A = _exact(cfg, idx, w, ys)
    u, g_k = UNIT[out_dtype], K * V / (1 - K * V)
    d = u * (1 + g_k) + g_k + g_k * (1 + u) * (1 + g_k)
    for s in range(W):
        err_ref = (relay[s].double() - receiver[s].double()).abs()
        if fp8:
            amax = torch.nn.functional.pad(A[s], (0, -H % 128)).reshape(T, -(-H // 128), 128).amax(2)
            sub = K * amax.repeat_interleave(128, dim=1)[:, :H] / 448 * (1 + g_k)
            to_exact = u * S[s].abs() + 1.01 * (2.0 ** -4 * A[s] + 2.0 ** -10 * sub) + 3 * g_k * A[s]
            assert bool(((relay[s].double() - S[s]).abs() <= to_exact).all())
            assert bool((err_ref <= to_exact + u * (S[s].abs() + g_k * A[s]) + g_k * A[s]).all())
            continue
        assert bool((err_ref <= _sender_vs_receiver_bound(u, K, S[s], A[s])).all()), s
        assert bool(((relay[s].double() - S[s]).abs() <= u * (S[s].abs() + d * A[s]) + d * A[s]).all())
        for t in range(T):                  # live experts all on one rank: one rounding of today's fp32 sum
            if len({e // L for e in idx[s][t].tolist() if e >= 0}) <= 1:
                assert torch.equal(relay[s][t], receiver[s][t]), (s, t)

    # run to run, and the same rows as the sender-reduced combine for homes of the experts' node
    again = R.combine_relay(cfg, idx, w, ys, node_size, fp8=fp8)
    assert all(_bits(a).equal(_bits(b)) for a, b in zip(relay, again))
    rows_ = R.combine_relay_rows(cfg, idx, w, ys, node_size, fp8)
    today = R.combine_partials_at_sender(cfg, idx, w, ys, fp8)
    for (r, s), (t, row) in rows_.node_rows.items():
        assert torch.equal(t, today[r][s][0]) and _bits(row).equal(_bits(today[r][s][1]))
    # one node, or one rank a node: the sender-reduced combine, bitwise
    sender = R.combine_reduced_at_sender(cfg, idx, w, ys, fp8=fp8)
    for ns in (1, W):
        assert all(_bits(a).equal(_bits(b)) for a, b in zip(R.combine_relay(cfg, idx, w, ys, ns, fp8=fp8), sender))
    # with the old value first (accumulate), tokens with no live route keep it
    old = [torch.randn(T, H, generator=g).to(out_dtype) for _ in range(W)]
    acc = R.combine_relay(cfg, idx, w, ys, node_size, out_tokens=old, fp8=fp8)
    for s in range(W):
        dead = (idx[s] < 0).all(1)
        assert torch.equal(acc[s][dead], old[s][dead])


def _rank_order_preserving(g: torch.Generator, idx: torch.Tensor, L: int) -> torch.Tensor:
    """Per token, a random permutation of its K slots that keeps the relative order of the routes to each
    rank (dead slots form one group): `new[t] = idx[t, perm[t]]`."""
    T, K = idx.shape
    perm = torch.empty(T, K, dtype=torch.int64)
    for t in range(T):
        group = [int(e) // L if e >= 0 else -1 for e in idx[t]]
        order = torch.randperm(K, generator=g).tolist()
        slots = {gr: sorted(k for k in range(K) if group[k] == gr) for gr in set(group)}
        perm[t] = torch.tensor([slots[group[k]].pop(0) for k in order])
    return perm


@settings(max_examples=25, deadline=None)
@given(nodes=st.integers(2, 4), node_size=st.integers(1, 4), T=st.integers(1, 4), K=st.integers(1, 8),
       L=st.integers(1, 2), fp8=st.booleans(), dup=st.booleans(), seed=st.integers(0, 2**16))
def test_permutations_that_must_not_matter(nodes, node_size, T, K, L, fp8, dup, seed):
    """(1) Reordering a token's K slots, keeping the order of its routes to each rank, leaves the dispatch
    and the relay combine bitwise unchanged (`combine`'s k-order sum is not: the relay's order is by rank
    and node). (2) Permuting a home rank's tokens permutes its combined rows, bitwise, when each expert's
    output row is a function of its input row."""
    g = torch.Generator().manual_seed(seed)
    W, H = nodes * node_size, 8
    E = W * L
    cfg = A2AConfig(max_num_tokens=4, num_experts=E, experts_per_token=K, hidden_dim=H,
                    in_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    xs = [torch.randn(T, H, generator=g).bfloat16() for _ in range(W)]
    idx = _routing(g, W, T, K, E, 0.2, "uniform", dup)
    w = [torch.rand(T, K, generator=g) for _ in range(W)]
    a_e, b_e = torch.randn(E, H, generator=g), torch.randn(E, H, generator=g)

    def experts(out):      # per rank, each row through its expert: y = a_e * x + b_e (rows are unpadded)
        ys = []
        for r, (n, x, _) in enumerate(out):
            e = torch.repeat_interleave(torch.arange(r * L, (r + 1) * L), n.long())
            ys.append((a_e[e] * x.float() + b_e[e]).bfloat16())
        return ys

    base = R.dispatch_relay(cfg, xs, None, idx, node_size).out
    want = R.combine_relay(cfg, idx, w, experts(base), node_size, fp8=fp8)
    perms = [_rank_order_preserving(g, i, L) for i in idx]
    idx_p = [i.gather(1, p) for i, p in zip(idx, perms)]
    w_p = [x.gather(1, p) for x, p in zip(w, perms)]
    moved = R.dispatch_relay(cfg, xs, None, idx_p, node_size).out
    assert _same(moved, base)
    got = R.combine_relay(cfg, idx_p, w_p, experts(moved), node_size, fp8=fp8)
    assert all(_bits(a).equal(_bits(b)) for a, b in zip(got, want))

    sigma = [torch.randperm(T, generator=g) for _ in range(W)]
    pick = lambda ts: [t[p] for t, p in zip(ts, sigma)]  # noqa: E731
    out = R.dispatch_relay(cfg, pick(xs), None, pick(idx), node_size).out
    got = R.combine_relay(cfg, pick(idx), pick(w), experts(out), node_size, fp8=fp8)
    assert all(_bits(a).equal(_bits(b[p])) for a, b, p in zip(got, want, sigma))


@pytest.mark.parametrize("W, issue", [(16, 3.3), (32, 2.0), (64, 1.45)])
def test_network_bytes_fall_as_issue_46_s_table(W, issue):
    """Uniform routing of 256 experts, top-8 distinct, 8 GPUs a node, 128 tokens a rank, seed 0: network bytes
    of one row per (token, rank) against one per (token, node) fall by remote ranks / remote nodes a token
    hits, (W - 8) p_rank / ((W/8 - 1) p_node), p = 1 - C(E - experts there, K) / C(E, K) (the same row size:
    the relay's row is the per-rank row); the writes a proxy posts fall from W - 8 to W/8 - 1."""
    E, K, node, T = 256, 8, 8, 128
    cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=7168,
                    in_dtype=torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(0)
    idx = [torch.rand(T, E, generator=g).argsort(1)[:, :K] for _ in range(W)]
    p_rank = 1 - math.comb(E - E // W, K) / math.comb(E, K)
    p_node = 1 - math.comb(E - E * node // W, K) / math.comb(E, K)
    expect = (W - node) * p_rank / ((W // node - 1) * p_node)
    for fp8 in (False, True):
        relay = R.bytes_per_node(R.relay_bytes_per_phase(cfg, idx, node, fp8), node)
        per_rank = R.bytes_per_node(R.bytes_per_phase(cfg, idx, node, R.Wire("rank", "rank", fp8)), node)
        for ph in ("dispatch", "combine"):
            ratio = sum(n[ph]["remote"] for n in per_rank) / sum(n[ph]["remote"] for n in relay)
            assert ratio == pytest.approx(expect, rel=0.01) and ratio == pytest.approx(issue, rel=0.03), (ph, ratio)
    ranks = R.relay_bytes_per_phase(cfg, idx, node)
    assert all(r["writes"] == {"dispatch": W // node - 1, "combine": W // node - 1} for r in ranks)
    pairs = R.rows_per_pair(cfg, idx, "rank")
    remote = [int(sum(int(pairs[s, r]) > 0 for r in range(W) if r // node != s // node)) for s in range(W)]
    assert remote == [W - node] * W                              # one write per remote rank before


def test_node_size_must_divide_the_world():
    cfg = A2AConfig(max_num_tokens=1, num_experts=4, experts_per_token=1, hidden_dim=1, in_dtype=torch.float32)
    idx = [torch.zeros(1, 1, dtype=torch.int64)] * 4
    with pytest.raises(ValueError, match="node_size"):
        R.dispatch_relay(cfg, [torch.zeros(1, 1)] * 4, None, idx, node_size=3)
    with pytest.raises(ValueError, match="node_size"):
        R.relay_bytes_per_phase(cfg, idx, node_size=0)
    assert [R.relay_rank(s, 1, 4) for s in range(8)] == [4, 5, 6, 7, 4, 5, 6, 7]
