"""The executable specification checked against hand-worked examples and invariants."""
import torch
from hypothesis import given, settings, strategies as st

from moe_a2a import reference
from moe_a2a.config import A2AConfig


def test_hand_worked_dispatch_order_padding_and_duplicates():
    # 2 ranks, 4 experts (2 local each), padding 2. Rank 0 token 0 -> experts (1, 1) (a duplicate),
    # rank 1 token 0 -> (1, -1), token 1 -> (3, 0).
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=2, hidden_dim=1,
                    in_dtype=torch.float32, expert_padding=2)
    xs = [torch.tensor([[10.0]]), torch.tensor([[20.0], [21.0]])]
    idx = [torch.tensor([[1, 1]]), torch.tensor([[1, -1], [3, 0]])]
    (n0, x0, _), (n1, x1, _) = reference.dispatch(cfg, xs, None, idx)
    assert n0.tolist() == [1, 3] and n1.tolist() == [0, 1]
    # expert 0: [21, pad]; expert 1: rank0 t0 k0, rank0 t0 k1, rank1 t0 -> [10, 10, 20, pad]
    assert x0[:, 0].tolist() == [21.0, 0.0, 10.0, 10.0, 20.0, 0.0]
    assert x1[:, 0].tolist() == [21.0, 0.0]  # expert 2 empty (no rows), expert 3: [21, pad]
    out = reference.combine(cfg, idx, [torch.tensor([[0.5, 0.25]]), torch.tensor([[1.0, 9.0], [2.0, 3.0]])],
                            [x0.to(torch.bfloat16), x1.to(torch.bfloat16)])
    assert out[0].float().item() == 0.75 * 10 and out[1][:, 0].float().tolist() == [20.0, 2 * 21 + 3 * 21]


@settings(max_examples=25, deadline=None)
@given(W=st.integers(1, 4), T=st.integers(0, 6), K=st.integers(1, 4), L=st.integers(1, 3),
       pad=st.sampled_from([1, 3]), seed=st.integers(0, 1000))
def test_counts_rows_and_weighted_sum_invariants(W, T, K, L, pad, seed):
    g = torch.Generator().manual_seed(seed)
    E = W * L
    cfg = A2AConfig(max_num_tokens=6, num_experts=E, experts_per_token=K, hidden_dim=3,
                    in_dtype=torch.float32, out_dtype=torch.float32, expert_padding=pad)
    xs = [torch.randn(T, 3, generator=g) for _ in range(W)]
    idx = [torch.randint(-1, E, (T, K), generator=g) for _ in range(W)]
    out = reference.dispatch(cfg, xs, None, idx)
    assert sum(int(n.sum()) for n, _, _ in out) == sum(int((i >= 0).sum()) for i in idx)
    for n, x, _ in out:
        assert x.shape[0] == sum((int(c) + pad - 1) // pad * pad for c in n)
    # identity experts and weights summing per token: combine returns sum_k w * x over live k
    w = [torch.rand(T, K, generator=g) for _ in range(W)]
    got = reference.combine(cfg, idx, w, [x for _, x, _ in out])
    for s in range(W):
        want = (w[s] * (idx[s] >= 0)).sum(1, keepdim=True) * xs[s]
        torch.testing.assert_close(got[s], want, atol=1e-5, rtol=1e-5)


def test_fixed_capacity_rows_start_at_l_times_c_and_overflow_is_refused():
    import pytest
    import torch

    from moe_a2a import reference
    from moe_a2a.config import A2AConfig

    cfg = A2AConfig(max_num_tokens=3, num_experts=4, experts_per_token=2, hidden_dim=4, in_dtype=torch.float32,
                    expert_capacity=4)
    xs = [torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * s for s in range(2)]
    idx = [torch.tensor([[1, 0], [1, -1], [3, 1]]), torch.tensor([[0, 0], [-1, -1], [2, 3]])]
    (n0, x0, _), (n1, x1, _) = reference.dispatch(cfg, xs, None, idx)
    assert n0.tolist() == [3, 3] and x0.shape == (8, 4) and n1.tolist() == [1, 2]
    assert torch.equal(x0[0], xs[0][0]) and torch.equal(x0[1], xs[1][0]) and torch.equal(x0[2], xs[1][0])
    assert torch.equal(x0[4], xs[0][0]) and torch.equal(x0[5], xs[0][1]) and torch.equal(x0[6], xs[0][2])
    assert bool((x0[3] == 0).all()) and bool((x0[7] == 0).all())  # past each expert's count
    assert torch.equal(x1[4], xs[0][2]) and torch.equal(x1[5], xs[1][2])  # expert 3 = local 1 of rank 1
    rows = reference.expert_rows(cfg, idx)
    assert rows[0].tolist() == [[4, 0], [5, -1], [4, 6]]
    small = A2AConfig(max_num_tokens=3, num_experts=4, experts_per_token=2, hidden_dim=4, in_dtype=torch.float32,
                      expert_capacity=2)
    with pytest.raises(ValueError, match="expert_capacity"):
        reference.dispatch(small, xs, None, idx)
