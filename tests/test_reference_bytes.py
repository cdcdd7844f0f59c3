"""The specification of issue 32 ("fewer bytes") in moe_a2a/reference.py, against today's functions and
brute force: dispatch in one row per (token, rank) expands to exactly `reference.dispatch`; the combine
reduced at the sender equals the receiver-side `reference.combine` within a derived bound; fp8 combines
are within their bound of the exact sum; byte counts equal a count written out here; the EP2 ratio.

The bounds (u = unit roundoff of out_dtype: 2**-8 bf16, 2**-11 fp16, 2**-24 fp32; v = 2**-24, fp32;
g = K v / (1 - K v); for one output element S = sum_k w_k y_k exactly, A = sum_k |w_k y_k| over the live k):

- receiver-side (`combine`): products and adds in fp32 (at most K roundings per term), one cast:
  |R - S| <= u (|S| + g A) + g A.
- reduced at the sender: each rank's partial P_r (fp32, error <= g A_r) is rounded once to out_dtype
  (<= u |P_r^|), the home adds at most K rows in fp32 (<= g sum |B_r|) and casts once:
  |H - S| <= u (|S| + d A) + d A with d = u (1 + g) + g + g (1 + u)(1 + g), so
  |H - R| <= 2u |S| + (1 + u)(d + g) A   (to leading order: 2u|S| + u A, about 3 ulps of A).
- fp8 rows: e4m3 rounds to 3 mantissa bits (half an ulp: 2**-4 relative), subnormals to 2**-10 of the
  block scale (amax / 448); per route |deq(y) - y| <= 2**-4 |y| + 2**-10 scale (+ fp32 terms), so
  |R8 - S| <= u |S| + 1.01 (2**-4 A + 2**-10 sum_k |w_k| scale_k) + 3 g A; reduced at the sender the same
  with the partials' scales (at most K of them, each <= blockmax(A) / 448 (1 + g)).
Values here are in the normal range (no bf16 subnormal), which these relative bounds assume.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe_a2a import reference as R

from moe_a2a.config import A2AConfig
from .conftest import TEST_DEVICE

V = 2.0 ** -24
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def _routing(g: torch.Generator, W: int, T: int, K: int, E: int, masked: float, skew: float, dup: bool):
    """Per rank `[T, K]` int64: -1 with probability `masked`, else with probability `skew` one of the two
    hottest experts, else uniform; `dup`: slot 1 repeats slot 0 (a duplicate expert in a token's row)."""
    out = []
    for _ in range(W):
        idx = torch.randint(0, E, (T, K), generator=g)
        hot = torch.rand(T, K, generator=g) < skew
        idx[hot] = torch.randint(0, min(2, E), (int(hot.sum()),), generator=g)
        idx[torch.rand(T, K, generator=g) < masked] = -1
        if dup and K >= 2:
            idx[:, 1] = idx[:, 0]
        out.append(idx)
    return out


def _exact(cfg, indices, weights, expert_ys):
    """Per home rank, fp64 `[T, H]` S = sum_k w y and A = sum_k |w y| over the live k."""
    W = len(indices)
    L = cfg.layout(W).num_local_experts
    rows = R.expert_rows(cfg, indices)
    S, A = [], []
    for s in range(W):
        idx, w = indices[s], weights[s].double()
        acc = torch.zeros(idx.shape[0], cfg.hidden_dim, dtype=torch.float64)
        mag = torch.zeros_like(acc)
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    term = w[t, k] * expert_ys[e // L][rows[s][t, k]].double()
                    acc[t] += term
                    mag[t] += term.abs()
        S.append(acc)
        A.append(mag)
    return S, A


def _sender_vs_receiver_bound(u: float, K: int, S: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    g = K * V / (1 - K * V)
    d = u * (1 + g) + g + g * (1 + u) * (1 + g)
    return 2 * u * S.abs() + (1 + u) * (d + g) * A


def test_hand_worked_rows_per_rank_duplicates_and_expansion():
    # 2 ranks, 4 experts (2 local each). Rank 0 token 0 -> experts (1, 1) (a duplicate), rank 1 token 0 ->
    # (1, -1), token 1 -> (3, 0): token 1 of rank 1 goes once to rank 0 and once to rank 1.
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=2, hidden_dim=1,
                    in_dtype=torch.float32, expert_padding=2)
    xs = [torch.tensor([[10.0]]), torch.tensor([[20.0], [21.0]])]
    idx = [torch.tensor([[1, 1]]), torch.tensor([[1, -1], [3, 0]])]
    w = [torch.tensor([[0.5, 0.25]]), torch.tensor([[1.0, 9.0], [2.0, 3.0]])]
    sent = R.dispatch_rows_per_rank(cfg, xs, None, idx, w)
    assert [r.tokens.tolist() for r in sent[0]] == [[0], [0, 1]]   # rank 0 gets rank 0's t0 ONCE
    assert [r.tokens.tolist() for r in sent[1]] == [[], [1]]
    assert sent[0][1].weights.tolist() == [[1.0, 9.0], [2.0, 3.0]] and sent[0][0].indices.tolist() == [[1, 1]]
    got, want = R.expand_rank_rows(cfg, sent), R.dispatch(cfg, xs, None, idx)
    for (n1, x1, _), (n2, x2, _) in zip(got, want):
        assert torch.equal(n1, n2) and torch.equal(x1, x2)
    # expert 1's segment: rank0 t0 k0, rank0 t0 k1 (the duplicate: two slots from one row), rank1 t0
    assert got[0][1][:, 0].tolist() == [21.0, 0.0, 10.0, 10.0, 20.0, 0.0]
    ys = [x.to(torch.bfloat16) for _, x, _ in want]
    red = R.combine_reduced_at_sender(cfg, idx, w, ys)
    assert red[0].float().item() == 0.75 * 10 and red[1][:, 0].float().tolist() == [20.0, 2 * 21 + 3 * 21]
    parts = R.combine_partials_at_sender(cfg, idx, w, ys)
    assert parts[0][0][1].tolist() == [[7.5]]                        # 0.5*10 + 0.25*10 summed on rank 0
    assert parts[1][1][0].tolist() == [1] and parts[1][1][1].tolist() == [[42.0]]
    b = R.bytes_per_phase(cfg, idx, node_size=1, wire=R.WIRE_VARIANTS["sender_reduced"])
    d = R.row_bytes(cfg, R.WIRE_VARIANTS["sender_reduced"])
    assert d == {"dispatch": 16 + 32, "combine": 16}                   # 4 B payload -> 16; 2 (expert, pos) + 2 weights
    # rank 0 keeps its t0 and sends rank 1's t0, t1 their partials; rank 1 sends t0 to rank 0, t1 to both
    assert b[0] == {"dispatch": {"self": 48, "node": 0, "remote": 0}, "combine": {"self": 16, "node": 0, "remote": 32}}
    assert b[1] == {"dispatch": {"self": 48, "node": 0, "remote": 96}, "combine": {"self": 16, "node": 0, "remote": 0}}


@settings(max_examples=60, deadline=None)
@given(W=st.integers(1, 16), node=st.integers(1, 8), T=st.integers(0, 5), K=st.integers(1, 8),
       L=st.integers(1, 2), pad=st.sampled_from([1, 2]), masked=st.sampled_from([0.0, 0.3]),
       skew=st.sampled_from([0.0, 0.7]), dup=st.booleans(), scaled=st.booleans(),
       capacity=st.sampled_from([None, None, 1, 40]), seed=st.integers(0, 2**16))
def test_per_rank_dispatch_expands_to_the_reference_and_bytes_match_a_brute_force_count(
        W, node, T, K, L, pad, masked, skew, dup, scaled, capacity, seed):
    g = torch.Generator().manual_seed(seed)
    node = max(d for d in range(1, min(node, W) + 1) if W % d == 0)     # 1-8 ranks a node, dividing W
    E, H = W * L, 5
    in_dtype = torch.float8_e4m3fn if scaled else torch.bfloat16
    cfg = A2AConfig(max_num_tokens=5, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=in_dtype,
                    scale_block=2 if scaled else None, expert_padding=1 if capacity else pad,
                    expert_capacity=capacity)
    xs = [torch.randn(T, H, generator=g).to(in_dtype) for _ in range(W)]
    scales = [torch.rand(T, cfg.num_scales, generator=g) for _ in range(W)] if scaled else None
    idx = _routing(g, W, T, K, E, masked, skew, dup)
    sent = R.dispatch_rows_per_rank(cfg, xs, scales, idx)
    for r in range(W):
        for s in range(W):
            routed = [t for t in range(T) if any(e >= 0 and e // L == r for e in idx[s][t].tolist())]
            assert sent[r][s].tokens.tolist() == routed                  # once per (token, rank), token order
            assert sent[r][s].x.view(torch.uint8).equal(xs[s][routed].view(torch.uint8))
    try:
        want = R.dispatch(cfg, xs, scales, idx)
    except ValueError as e:            # an expert over expert_capacity: the expansion refuses it alike
        with pytest.raises(ValueError, match="expert_capacity"):
            R.expand_rank_rows(cfg, sent)
        assert "expert_capacity" in str(e)
        want = None
    for (n1, x1, s1), (n2, x2, s2) in zip(R.expand_rank_rows(cfg, sent) if want else [], want or []):
        assert torch.equal(n1, n2) and x1.view(torch.uint8).equal(x2.view(torch.uint8))
        assert (s1 is None and s2 is None) or torch.equal(s1, s2)

    # bytes: every (s, t, k) and every (s, t, rank) counted by hand
    for name, wire in R.WIRE_VARIANTS.items():
        size = R.row_bytes(cfg, wire)
        meta = 4 * K * (3 if wire.combine_rows == "rank" else 2)  # (local expert, position) per k [, weight]
        extra = -(-meta // 16) * 16 if wire.dispatch_rows == "rank" else 0
        assert size["dispatch"] == cfg.dispatch_stride_bytes + extra
        want = [{ph: {"self": 0, "node": 0, "remote": 0} for ph in ("dispatch", "combine")} for _ in range(W)]
        where = lambda a, b: "self" if a == b else ("node" if a // node == b // node else "remote")  # noqa: E731
        for s in range(W):
            for t in range(T):
                ranks = set()
                for e in idx[s][t].tolist():
                    if e < 0:
                        continue
                    r = e // L
                    ranks.add(r)
                    if wire.dispatch_rows == "route":
                        want[s]["dispatch"][where(s, r)] += size["dispatch"]
                    if wire.combine_rows == "route":
                        want[r]["combine"][where(r, s)] += size["combine"]
                for r in ranks:
                    if wire.dispatch_rows == "rank":
                        want[s]["dispatch"][where(s, r)] += size["dispatch"]
                    if wire.combine_rows == "rank":
                        want[r]["combine"][where(r, s)] += size["combine"]
        assert R.bytes_per_phase(cfg, idx, node, wire) == want, name


@settings(max_examples=50, deadline=None)
@given(W=st.integers(1, 8), T=st.integers(0, 4), K=st.integers(1, 8), L=st.integers(1, 2),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float32]), masked=st.sampled_from([0.0, 0.3]),
       skew=st.sampled_from([0.0, 0.8]), dup=st.booleans(), scale=st.sampled_from([1.0, 1e3]),
       seed=st.integers(0, 2**16))
def test_sender_reduced_combine_is_within_the_derived_bound_of_the_receiver_side_sum(
        W, T, K, L, out_dtype, masked, skew, dup, scale, seed):
    g = torch.Generator().manual_seed(seed)
    E, H = W * L, 16
    cfg = A2AConfig(max_num_tokens=4, num_experts=E, experts_per_token=K, hidden_dim=H,
                    in_dtype=torch.float32, out_dtype=out_dtype)
    idx = _routing(g, W, T, K, E, masked, skew, dup)
    rows = [x.shape[0] for _, x, _ in R.dispatch(cfg, [torch.zeros(T, H)] * W, None, idx)]
    ys = [(scale * torch.randn(n, H, generator=g)).to(out_dtype) for n in rows]
    w = [torch.rand(T, K, generator=g) * 2 - 0.5 for _ in range(W)]      # some negative: cancellation
    old = [torch.randn(T, H, generator=g).to(out_dtype) for _ in range(W)]
    receiver = R.combine(cfg, idx, w, ys)
    sender = R.combine_reduced_at_sender(cfg, idx, w, ys)
    S, A = _exact(cfg, idx, w, ys)
    u = UNIT[out_dtype]
    g_k = K * V / (1 - K * V)
    L_ = cfg.layout(W).num_local_experts
    for s in range(W):
        bound = _sender_vs_receiver_bound(u, K, S[s], A[s])
        assert bool(((sender[s].double() - receiver[s].double()).abs() <= bound).all()), s
        d = u * (1 + g_k) + g_k + g_k * (1 + u) * (1 + g_k)
        assert bool(((sender[s].double() - S[s]).abs() <= u * (S[s].abs() + d * A[s]) + d * A[s]).all())
        # a token whose live experts are all on one rank: one partial, bitwise today's sum
        for t in range(T):
            live = [e for e in idx[s][t].tolist() if e >= 0]
            if len({e // L_ for e in live}) <= 1:
                assert torch.equal(sender[s][t], receiver[s][t]), (s, t)
    # with the old value first (accumulate), masked tokens keep it
    acc = R.combine_reduced_at_sender(cfg, idx, w, ys, out_tokens=old)
    for s in range(W):
        dead = (idx[s] < 0).all(1)
        assert torch.equal(acc[s][dead], old[s][dead])
    # deterministic: the same call gives the same bits
    again = R.combine_reduced_at_sender(cfg, idx, w, ys)
    assert all(torch.equal(a, b) for a, b in zip(sender, again))


@settings(max_examples=30, deadline=None)
@given(W=st.integers(1, 4), T=st.integers(1, 4), K=st.integers(1, 8), H=st.sampled_from([64, 200, 256]),
       spread=st.sampled_from([0.0, 6.0]), seed=st.integers(0, 2**16))
def test_fp8_combines_are_within_their_bound_of_the_exact_sum(W, T, K, H, spread, seed):
    """`spread`: log2 range of per-element magnitudes (outliers within a block push others to subnormals)."""
    g = torch.Generator().manual_seed(seed)
    L = 2
    cfg = A2AConfig(max_num_tokens=4, num_experts=W * L, experts_per_token=K, hidden_dim=H,
                    in_dtype=torch.float32, out_dtype=torch.bfloat16)
    idx = _routing(g, W, T, K, W * L, 0.2, 0.3, False)
    rows = [x.shape[0] for _, x, _ in R.dispatch(cfg, [torch.zeros(T, H)] * W, None, idx)]
    ys = [(torch.randn(n, H, generator=g) * torch.exp2(spread * torch.rand(n, H, generator=g))).bfloat16()
          for n in rows]
    w = [torch.rand(T, K, generator=g) for _ in range(W)]
    S, A = _exact(cfg, idx, w, ys)
    u, g_k = UNIT[torch.bfloat16], K * V / (1 - K * V)
    # per route: scale_k of the block of each element, weighted
    Lr = cfg.layout(W).num_local_experts
    er = R.expert_rows(cfg, idx)
    for variant in ("route", "sender"):
        got = (R.combine_fp8(cfg, idx, w, ys) if variant == "route"
               else R.combine_reduced_at_sender(cfg, idx, w, ys, fp8=True))
        for s in range(W):
            sub = torch.zeros(T, H, dtype=torch.float64)
            for t in range(T):
                for k in range(K):
                    e = int(idx[s][t, k])
                    if e < 0:
                        continue
                    y = ys[e // Lr][er[s][t, k]].double()
                    bmax = torch.nn.functional.pad(y.abs(), (0, -H % 128)).reshape(-1, 128).amax(1)
                    sub[t] += abs(float(w[s][t, k])) * bmax.repeat_interleave(128)[:H] / 448
            if variant == "sender":   # the partials' scales: at most K of them, each <= blockmax(A) / 448
                amax = torch.nn.functional.pad(A[s], (0, -H % 128)).reshape(T, -1, 128).amax(2)
                sub = K * amax.repeat_interleave(128, dim=1)[:, :H] / 448 * (1 + g_k)
            bound = u * S[s].abs() + 1.01 * (2.0 ** -4 * A[s] + 2.0 ** -10 * sub) + 3 * g_k * A[s]
            err = (got[s].double() - S[s]).abs()
            assert bool((err <= bound).all()), (variant, s, float((err - bound).max()))


def test_fp8_blocks_are_the_dispatch_quantisation():
    """`reference.quantize_fp8_blocks` writes the bytes `triton_kernels.quant.quantize_fp8` writes."""
    from moe_a2a.triton_kernels.quant import quantize_fp8

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 300, generator=g) * torch.exp2(8 * torch.rand(3, 300, generator=g))
    x[1, :128] = 0.0
    x[2, 128:140] = 1e-38
    q, s = R.quantize_fp8_blocks(x)
    q2, s2 = (t.cpu() for t in quantize_fp8(x.to(TEST_DEVICE), 128))  # compiled kernels need device tensors
    assert q.view(torch.uint8).equal(q2.view(torch.uint8)) and torch.equal(s, s2)
    assert torch.equal(R.dequantize_fp8_blocks(q, s), q.float() * s.repeat_interleave(128, 1)[:, :300])


def test_ep2_prefill_bytes_fall_about_fourfold():
    """DeepSeek-V3 routing at EP2 (256 experts, top-8 of distinct experts, 4096 tokens a rank): per-route
    rows against one row per (token, rank) with the combine reduced at the sender. A token hits
    W (1 - C(E - L, K) / C(E, K)) ranks on average, so the rows fall by K / that: 8 / 1.9930 = 4.014."""
    E, K, W, T = 256, 8, 2, 4096
    cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=7168,
                    in_dtype=torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(0)
    idx = [torch.rand(T, E, generator=g).argsort(1)[:, :K] for _ in range(W)]
    L = E // W
    distinct = W * (1 - math.comb(E - L, K) / math.comb(E, K))
    assert distinct == pytest.approx(1.9930, abs=1e-4)
    total = {}
    for name in ("per_route", "sender_reduced", "sender_reduced_fp8"):
        b = R.bytes_per_phase(cfg, idx, node_size=W, wire=R.WIRE_VARIANTS[name])
        total[name] = {ph: sum(r[ph]["node"] + r[ph]["self"] for r in b) for ph in ("dispatch", "combine")}
        assert all(r[ph]["remote"] == 0 for r in b for ph in ("dispatch", "combine"))
    routes = sum(int((i >= 0).sum()) for i in idx)
    rank_rows = sum(int(h.sum()) for h in R.token_ranks(cfg, idx))
    assert rank_rows / (W * T) == pytest.approx(distinct, rel=0.01)
    d, c = (total["per_route"][ph] / total["sender_reduced"][ph] for ph in ("dispatch", "combine"))
    assert c == pytest.approx(routes / rank_rows) and c == pytest.approx(K / distinct, rel=0.01)
    assert d == pytest.approx(K / distinct * 7392 / 7456, rel=0.01)       # 64 B of ids and weights a row
    both = sum(total["per_route"].values()) / sum(total["sender_reduced"].values())
    assert 3.9 < both < 4.1
    fp8 = sum(total["per_route"].values()) / sum(total["sender_reduced_fp8"].values())
    assert 5.8 < fp8 < 6.2        # combine rows halved too: (7392 + 14336) / (7456 + 7392) x 4.01


def test_wire_rejects_a_sender_reduced_combine_without_rank_rows():
    with pytest.raises(ValueError, match="dispatch_rows='rank'"):
        R.Wire("route", "rank")
    with pytest.raises(ValueError):
        R.Wire("token")
    cfg = A2AConfig(max_num_tokens=1, num_experts=4, experts_per_token=1, hidden_dim=1)
    with pytest.raises(ValueError, match="node_size"):
        R.bytes_per_phase(cfg, [torch.zeros(1, 1, dtype=torch.int64)] * 4, node_size=3)
