"""route_tokens against a plain-torch oracle (stable argsort), reference.expert_rows and plan.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py). The interpreter's tl.sort costs
seconds per 1024 keys, so the two-launch path is reached with tiny blocks (`_block_routes=16`) and
only one test uses the decode size.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ..conftest import TEST_DEVICE, examples
from hypothesis import given, settings, strategies as st

from moe_a2a import reference
from moe_a2a.protocol import plan
from moe_a2a.config import A2AConfig
from moe_a2a.triton_kernels.routing import RankRoutes, route_tokens, validate_indices

# Forces the two-launch path (histogram + fix-up) with 16 routes per block, so several blocks and
# routes of one token straddling a block edge show up at small T.
MULTI = dict(_single_max_routes=0, _block_routes=16)
# Forces the one-program path whatever the size.
SINGLE = dict(_single_max_routes=1 << 30)


def oracle(indices: torch.Tensor, num_experts: int, bound_m: int | None = None):
    """counts and route_slot from a stable argsort over the live routes."""
    T, K = indices.shape
    flat = indices.reshape(-1).to(torch.int64)
    is_live = flat >= 0
    if bound_m is not None:
        is_live &= torch.arange(T * K) // K < bound_m
    expert = flat[is_live]
    counts = torch.bincount(expert, minlength=num_experts).to(torch.int32)
    order = torch.argsort(expert, stable=True)
    position = torch.empty_like(expert)
    position[order] = torch.arange(len(expert))
    slot = torch.full_like(flat, -1)
    slot[is_live] = position
    return counts, slot.reshape(T, K).to(torch.int32)


def check_invariants(indices, num_experts, counts, route_slot, bound_m=None):
    T, K = indices.shape
    live = indices.to(torch.int64) >= 0
    if bound_m is not None:
        live &= (torch.arange(T) < bound_m)[:, None]
    total = int(live.sum())
    assert int(counts.sum()) == total                     # counts sum == live routes
    assert torch.equal(counts.to(torch.int64),
                       torch.bincount(indices.to(torch.int64)[live], minlength=num_experts))
    assert bool((route_slot[~live] == -1).all())          # dead routes get -1
    slots = route_slot[live].to(torch.int64)
    assert torch.equal(torch.sort(slots).values, torch.arange(total))  # bijection onto [0, total)
    # Each expert's routes land inside its segment [psum_excl(counts)[e], psum_incl(counts)[e]).
    starts = torch.cumsum(counts.to(torch.int64), 0) - counts.to(torch.int64)
    e = indices.to(torch.int64)[live]
    assert bool(((slots >= starts[e]) & (slots < starts[e] + counts.to(torch.int64)[e])).all())


def make_indices(T, K, E, mask_p, dtype, gen):
    idx = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int64)
    idx[torch.rand(T, K, generator=gen) < mask_p] = -1
    return idx.to(dtype)


@pytest.mark.timeout(120)
@settings(deadline=None, max_examples=examples(30))
@given(
    T=st.integers(0, 24),
    K=st.integers(1, 9),
    E=st.sampled_from([1, 3, 7, 16, 100]),        # 3, 7, 100: not powers of two
    mask_p=st.sampled_from([0.0, 0.3, 1.0]),      # 1.0: every route masked
    dtype=st.sampled_from([torch.int32, torch.int64]),
    bound=st.one_of(st.none(), st.integers(0, 30)),  # bound_m below, at and above T
    multi=st.booleans(),                          # single-program vs two-launch path
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_oracle(T, K, E, mask_p, dtype, bound, multi, seed):
    gen = torch.Generator().manual_seed(seed)
    indices = make_indices(T, K, E, mask_p, dtype, gen)
    bound_m = None if bound is None else torch.tensor([bound], dtype=torch.int32)
    counts, route_slot = route_tokens(indices.to(TEST_DEVICE), E, bound_m=None if bound_m is None else bound_m.to(TEST_DEVICE),
                                      **(MULTI if multi else SINGLE))
    counts, route_slot = counts.cpu(), route_slot.cpu()
    want_counts, want_slot = oracle(indices, E, bound)
    assert torch.equal(counts, want_counts)
    assert torch.equal(route_slot, want_slot)
    check_invariants(indices, E, counts, route_slot, bound)


def _route(indices, E, **kw):
    """route_tokens on the test device (the interpreter in CI, compiled kernels on the GPU machine)."""
    counts, route_slot = route_tokens(indices.to(TEST_DEVICE), E, **kw)
    return counts.cpu(), route_slot.cpu()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("multi", [False, True], ids=["single", "multi"])
@pytest.mark.parametrize("case", ["one_expert", "duplicates", "last_expert", "all_masked"])
def test_edge_cases(case, multi):
    T, K, E = 20, 5, 7
    if case == "one_expert":      # skew: every route to expert 3, slots are plain row-major order
        indices = torch.full((T, K), 3, dtype=torch.int32)
    elif case == "duplicates":    # the same expert twice in one row is routed twice
        indices = torch.tensor([[2, 2, -1, 2, 0]] * T, dtype=torch.int64)
    elif case == "last_expert":   # expert E-1: the highest sort key below the dead-route keys
        indices = torch.full((T, K), E - 1, dtype=torch.int64)
        indices[::2, 1] = -1
    else:                         # nothing live: counts all zero, every slot -1
        indices = torch.full((T, K), -1, dtype=torch.int32)
    counts, route_slot = _route(indices, E, **(MULTI if multi else SINGLE))
    want_counts, want_slot = oracle(indices, E)
    assert torch.equal(counts, want_counts) and torch.equal(route_slot, want_slot)
    check_invariants(indices, E, counts, route_slot)
    if case == "one_expert":
        assert torch.equal(route_slot.reshape(-1), torch.arange(T * K, dtype=torch.int32))


@pytest.mark.timeout(120)
def test_decode_size_and_plan():
    """Decode shape (T=128, K=8, E=256: the default path, two launches with 64-route blocks) against
    reference.expert_rows (one rank, no padding: its rows are exactly the send slots) and
    plan.send_offsets (each destination rank's routes form one run starting there)."""
    cfg = A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=16)
    gen = torch.Generator().manual_seed(1)
    indices = torch.randint(0, 256, (128, 8), generator=gen, dtype=torch.int64)
    indices[torch.rand(128, 8, generator=gen) < 0.1] = -1
    counts, route_slot = _route(indices, cfg.num_experts)
    want_counts, want_slot = oracle(indices, cfg.num_experts)
    assert torch.equal(counts, want_counts) and torch.equal(route_slot, want_slot)
    rows = reference.expert_rows(cfg, [indices])[0]
    assert torch.equal(route_slot.to(torch.int64), rows)
    lay = cfg.layout(8)
    row = counts.numpy()
    offsets = plan.send_offsets(row, lay)
    n = plan.rank_counts(row, lay)
    dest = torch.where(indices >= 0, indices // lay.num_local_experts, -1)
    for d in range(lay.world_size):
        slots = np.sort(route_slot[dest == d].numpy())
        assert np.array_equal(slots, np.arange(offsets[d], offsets[d] + n[d]))


@pytest.mark.timeout(60)
def test_max_tokens_multi_block_vs_reference():
    """T = max_num_tokens on the two-launch path with many blocks (64 routes each), against
    reference.dispatch's counts (one rank hosts every expert)."""
    cfg = A2AConfig(max_num_tokens=96, num_experts=12, experts_per_token=4, hidden_dim=4,
                    in_dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    indices = torch.randint(-1, cfg.num_experts, (cfg.max_num_tokens, 4), generator=gen, dtype=torch.int32)
    counts, route_slot = _route(indices, cfg.num_experts, _single_max_routes=0, _block_routes=64)
    want_counts, want_slot = oracle(indices, cfg.num_experts)
    assert torch.equal(counts, want_counts) and torch.equal(route_slot, want_slot)
    x = torch.zeros(cfg.max_num_tokens, 4)
    ref_counts = reference.dispatch(cfg, [x], None, [indices])[0][0]
    assert torch.equal(counts, ref_counts)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("multi", [False, True], ids=["single", "multi"])
def test_caller_outputs_strided_counts(multi):
    """out_counts as a column of a larger matrix (a foreign strided view) is written in place;
    its neighbours are untouched; stale output contents do not leak."""
    T, K, E = 10, 3, 5
    indices = torch.randint(-1, E, (T, K), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    matrix = torch.full((E, 3), 77, dtype=torch.int32, device=TEST_DEVICE)
    out_slot = torch.full((T, K), 55, dtype=torch.int32, device=TEST_DEVICE)
    counts, route_slot = route_tokens(indices.to(TEST_DEVICE), E, out_counts=matrix[:, 1], out_route_slot=out_slot,
                                      **(MULTI if multi else SINGLE))
    want_counts, want_slot = oracle(indices, E)
    assert route_slot.data_ptr() == out_slot.data_ptr()
    matrix, out_slot = matrix.cpu(), out_slot.cpu()
    assert torch.equal(matrix[:, 1], want_counts) and torch.equal(out_slot, want_slot)
    assert bool((matrix[:, 0] == 77).all() and (matrix[:, 2] == 77).all())


@pytest.mark.timeout(120)
@settings(deadline=None, max_examples=examples(20))
@given(
    T=st.integers(0, 20),
    K=st.integers(1, 6),
    E=st.sampled_from([4, 12, 16]),
    lo_hi=st.tuples(st.integers(0, 16), st.integers(0, 16)),
    multi=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_node_slots_bound_the_routes_to_the_node_experts(T, K, E, lo_hi, multi, seed):
    """The slots of routes to experts [lo, hi) are exactly [node_slots[0], node_slots[1]) (staging only
    remote rows relies on it), on both launch paths."""
    lo, hi = sorted(min(v, E) for v in lo_hi)
    indices = make_indices(T, K, E, 0.2, torch.int32, torch.Generator().manual_seed(seed))
    node_slots = torch.full((2,), -7, dtype=torch.int32, device=TEST_DEVICE)
    counts, route_slot = _route(indices, E, out_node_slots=node_slots, node_experts=(lo, hi),
                                **(MULTI if multi else SINGLE))
    first, end = node_slots.cpu().tolist()
    assert (first, end) == (int(counts[:lo].sum()), int(counts[:hi].sum()))
    live = indices >= 0
    in_node = (indices >= lo) & (indices < hi)
    assert bool(((route_slot >= first) & (route_slot < end))[live].eq(in_node[live]).all())


@pytest.mark.timeout(120)
@settings(deadline=None, max_examples=examples(20))
@given(
    T=st.integers(0, 12),
    K=st.integers(1, 4),
    W_node=st.sampled_from([(2, 1), (4, 1), (4, 2), (8, 2), (4, 4)]),
    L=st.integers(1, 3),
    private=st.sampled_from([None, 0, 1, 3]),
    skew=st.booleans(),
    multi=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_send_rows_put_each_remote_peers_first_routes_in_its_private_staging_slot(T, K, W_node, L, private, skew,
                                                                                multi, seed):
    """out_send_row: the slot, but for the first P routes to each remote rank their row in its private
    staging slot (`plan.private_stage_rows`), so a private write reads one range; both launch paths."""
    W, node = W_node
    E = W * L
    lay = A2AConfig(max_num_tokens=max(T, 1), num_experts=E, experts_per_token=K, hidden_dim=8,
                    in_dtype=torch.float32, max_private_tokens=private).layout(W, node)
    gen = torch.Generator().manual_seed(seed)
    indices = make_indices(T, K, E, 0.2, torch.int32, gen)
    if skew:  # every route to one expert: its rank's private slot fills, the rest stays at its slots
        indices = torch.where(indices >= 0, torch.randint(0, E, (), generator=gen).to(torch.int32), indices)
    rank = int(torch.randint(0, W, (), generator=gen))
    send_row = torch.full((T, K), -7, dtype=torch.int32, device=TEST_DEVICE)
    counts, route_slot = _route(indices, E, out_send_row=send_row, private_stage=(lay, rank),
                                **(MULTI if multi else SINGLE))
    want = plan.private_stage_rows(counts.numpy().astype(np.int64), rank, lay)
    live = route_slot >= 0
    got = send_row.cpu()
    assert bool((got[~live] == -1).all())
    assert got[live].tolist() == want[route_slot[live].long().numpy()].tolist()
    # Distinct rows, inside what the pack may write (max_slots)
    rows = got[live].tolist()
    assert len(set(rows)) == len(rows) and all(0 <= v < lay.max_routes + lay.private_stage_rows for v in rows)


def first_route_ranks(indices: torch.Tensor, E: int, L: int, rank: int | None, node_size: int) -> torch.Tensor:
    """Per route: the rank its token's row goes to (its expert's rank, or `reference.relay_rank` of it for
    `rank`'s relay on another node) when no earlier live route of the token goes there, else -1."""
    T, K = indices.shape
    out = torch.full((T, K), -1, dtype=torch.int64)
    for t in range(T):
        seen = set()
        for k in range(K):
            e = int(indices[t, k])
            if not 0 <= e < E:
                continue
            q = e // L
            if rank is not None and q // node_size != rank // node_size:
                q = reference.relay_rank(rank, q // node_size, node_size)
            if q not in seen:
                seen.add(q)
                out[t, k] = q
    return out


# The routings of the per-rank rows' tests: tokens, top-k, (ranks, ranks a node), experts a rank, the relay's
# mapping, skew (every live route of a token to one expert), a random seed.
RANK_ROUTINGS = dict(T=st.integers(0, 20), K=st.integers(1, 9),
                     W_node=st.sampled_from([(1, 1), (2, 2), (3, 1), (4, 2), (6, 3), (8, 4)]),
                     L=st.sampled_from([1, 2, 3]), relay=st.booleans(), skew=st.booleans(), multi=st.booleans(),
                     seed=st.integers(0, 2**31 - 1))


def _rank_routing(T, K, W, node, L, relay, skew, dtype, seed):
    """(layout of per-rank rows, indices [T, K] with -1 routes, the generator after them) of `RANK_ROUTINGS`."""
    lay = A2AConfig(max_num_tokens=max(T, 1), num_experts=W * L, experts_per_token=K, hidden_dim=8,
                    in_dtype=torch.float32, dispatch_rows="rank", combine_rows="rank").layout(W, node, relay=relay)
    gen = torch.Generator().manual_seed(seed)
    indices = make_indices(T, K, W * L, 0.2, dtype, gen)
    if skew:  # duplicates: every live route of a token to one expert
        indices = torch.where(indices >= 0, indices[:, :1].clamp(min=0), indices)
    return lay, indices, gen


@pytest.mark.timeout(180)
@settings(deadline=None, max_examples=examples(25))
@given(**RANK_ROUTINGS, bound=st.one_of(st.none(), st.integers(0, 24)),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_rank_keys_route_each_tokens_first_route_per_rank(T, K, W_node, L, relay, skew, bound, dtype, multi, seed):
    """`rank_keys=(layout, rank)`: the routing of the ranks of each token's first route there (the relay's
    mapping with `layout.relay`), made inside the routing's own launches, equals `route_tokens` over those
    ranks computed apart; bad and -1 indices, duplicates, bound_m and both launch paths."""
    W, node = W_node
    E = W * L
    relay = relay and W > node
    lay, indices, gen = _rank_routing(T, K, W, node, L, relay, skew, dtype, seed)
    if T and K > 1:  # out of range: dead here (the routing of the routes reports them)
        indices[0, K - 1] = E + 3
    rank = int(torch.randint(0, W, (), generator=gen))
    bound_m = None if bound is None else torch.tensor([bound], dtype=torch.int32)
    kw = dict(bound_m=None if bound_m is None else bound_m.to(TEST_DEVICE), **(MULTI if multi else SINGLE))
    counts, slot = _route(indices, W, rank_keys=(lay, rank), **kw)
    keys = first_route_ranks(indices, E, L, rank if relay else None, node)
    want_counts, want_slot = _route(keys.to(dtype), W, **kw)
    assert torch.equal(counts, want_counts) and torch.equal(slot, want_slot)
    want_counts, want_slot = oracle(keys, W, bound)  # and the plain oracle of those keys
    assert torch.equal(counts, want_counts) and torch.equal(slot, want_slot)


@pytest.mark.timeout(240)
@settings(deadline=None, max_examples=examples(20))
@given(**RANK_ROUTINGS, bound=st.one_of(st.none(), st.integers(-1, 24)), staged=st.booleans())
def test_ranks_routed_beside_the_experts_equal_two_calls(T, K, W_node, L, relay, skew, bound, staged, multi, seed):
    """`route_tokens(ranks=RankRoutes(...))`: the experts' and the ranks' routing in the same launches write what
    the two calls apart write (counts, slots, node slots, the ranks' send rows, the published epoch); a bad
    bound_m writes -1 in both count rows and leaves every route dead."""
    W, node = W_node
    E = W * L
    relay = relay and W > node
    lay, indices, gen = _rank_routing(T, K, W, node, L, relay, skew, torch.int32, seed)
    rank = int(torch.randint(0, W, (), generator=gen))
    first = lay.node_of(rank) * node
    dev = TEST_DEVICE
    bound_m = None if bound is None else torch.tensor([bound], dtype=torch.int32, device=dev)

    def run(fused: bool):
        out = dict(counts=torch.full((E,), -7, dtype=torch.int32, device=dev),
                   slot=torch.full((T, K), -7, dtype=torch.int32, device=dev),
                   node_slots=torch.full((2,), -7, dtype=torch.int32, device=dev),
                   rank_counts=torch.full((W,), -7, dtype=torch.int32, device=dev),
                   rank_slot=torch.full((T, K), -7, dtype=torch.int32, device=dev),
                   rank_node_slots=torch.full((2,), -7, dtype=torch.int32, device=dev),
                   send_row=torch.full((T, K), -7, dtype=torch.int32, device=dev),
                   epoch=torch.zeros(1, dtype=torch.int64, device=dev),
                   ready=torch.zeros(1, dtype=torch.int64, device=dev),
                   bad_bound=torch.zeros(1, dtype=torch.int64, device=dev))
        stage = dict(out_send_row=out["send_row"], private_stage=(lay, rank)) if staged else {}
        ranks = RankRoutes(lay, out["rank_counts"], out["rank_slot"], rank=rank if relay else None,
                           out_node_slots=out["rank_node_slots"], node_ranks=(first, first + node), **stage)
        common = dict(bound_m=bound_m, **(MULTI if multi else SINGLE))
        experts = dict(out_counts=out["counts"], out_route_slot=out["slot"], epoch=out["epoch"], ready=out["ready"],
                       bad_bound_m=out["bad_bound"] if bound is not None else None,
                       out_node_slots=out["node_slots"], node_experts=lay.node_experts(rank), **common)
        if fused:
            route_tokens(indices.to(dev), E, ranks=ranks, **experts)
        else:
            route_tokens(indices.to(dev), E, **experts)
            route_tokens(indices.to(dev), W, **ranks.routing_args(), bad_bound_m=experts["bad_bound_m"], **common)
        return {k: v.cpu() for k, v in out.items()}

    got, want = run(True), run(False)
    if bound is not None and not 0 <= bound <= T:
        assert bool((got["rank_counts"] == -1).all()) and bool((got["rank_slot"] == -1).all())
        assert bool((got["counts"] == -1).all()) and bool((got["slot"] == -1).all())
    for k in got:
        assert torch.equal(got[k], want[k]), k
    assert int(got["ready"]) == int(got["epoch"]) == 1


@pytest.mark.timeout(240)
def test_ranks_routed_beside_the_experts_over_more_blocks_than_a_histogram_step():
    """68 blocks of 16 routes (more than the fix-up reads of the ranks' histogram a step): the same counts and
    slots as the two calls apart."""
    T, K, W, node, L = 136, 8, 8, 4, 2
    lay, indices, _ = _rank_routing(T, K, W, node, L, True, False, torch.int32, 3)
    dev, kw = TEST_DEVICE, dict(_single_max_routes=0, _block_routes=16)
    got = [torch.empty(n, dtype=torch.int32, device=dev) for n in ((W * L,), (T, K), (W,), (T, K))]
    route_tokens(indices.to(dev), W * L, got[0], got[1], ranks=RankRoutes(lay, got[2], got[3], rank=5), **kw)
    want = route_tokens(indices.to(dev), W * L, **kw) + route_tokens(indices.to(dev), W, rank_keys=(lay, 5), **kw)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.timeout(60)
def test_rank_routes_key_a_new_view_of_the_same_rows_alike():
    """A remembered launch's key holds `RankRoutes`' tensors by address, dtype, shape and strides: each call's new
    view of the same rows (`opened[:T]`) hits the launch the last call remembered; other rows do not."""
    cfg = A2AConfig(max_num_tokens=8, num_experts=8, experts_per_token=2, hidden_dim=8, in_dtype=torch.float32,
                    dispatch_rows="rank", combine_rows="rank")
    lay = cfg.layout(4, 2)
    counts, slots = torch.zeros(4, 4, dtype=torch.int32), torch.zeros(8, 2, dtype=torch.int32)
    one, two = (RankRoutes(lay, counts[0], slots[:6], out_send_row=slots[2:], private_stage=(lay, 0))
                for _ in range(2))
    assert one.key() == two.key() and hash(one.key()) == hash(two.key())
    assert RankRoutes(lay, counts[1], slots[:6]).key() != RankRoutes(lay, counts[0], slots[:6]).key()
    assert RankRoutes(lay, counts[0], slots[:5]).key() != RankRoutes(lay, counts[0], slots[:6]).key()


@pytest.mark.timeout(60)
def test_ranks_refuse_rank_keys_and_a_layout_of_other_experts():
    cfg = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=8, in_dtype=torch.float32,
                    dispatch_rows="rank", combine_rows="rank")
    lay = cfg.layout(4, 2)
    idx = torch.zeros(4, 2, dtype=torch.int32)
    ranks = RankRoutes(lay, torch.zeros(4, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="ranks: expected None with rank_keys"):
        route_tokens(idx, 4, rank_keys=(lay, 0), ranks=ranks)
    with pytest.raises(ValueError, match="ranks: expected the RankRoutes of a layout of 16 experts"):
        route_tokens(torch.zeros(64, 2, dtype=torch.int32), 16, ranks=dataclasses.replace(
            ranks, out_slot=torch.zeros(64, 2, dtype=torch.int32)))
    with pytest.raises(ValueError, match="ranks.out_counts"):
        route_tokens(torch.zeros(64, 2, dtype=torch.int32), 8, ranks=RankRoutes(
            lay, torch.zeros(3, dtype=torch.int32), torch.zeros(64, 2, dtype=torch.int32)))


@pytest.mark.timeout(60)
def test_rank_keys_refuse_a_layout_of_another_world():
    lay = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=8,
                    in_dtype=torch.float32, dispatch_rows="rank", combine_rows="rank").layout(4, 2, relay=True)
    idx = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="rank_keys: expected .layout, rank. of a layout of 8 ranks"):
        route_tokens(idx, 8, rank_keys=(lay, 0))
    with pytest.raises(ValueError, match="rank_keys"):
        route_tokens(idx, 4, rank_keys=(lay, 9))


@pytest.mark.timeout(60)
def test_bad_arguments():
    idx = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices: expected dtype"):
        route_tokens(idx.float(), 4)
    with pytest.raises(ValueError, match="indices: expected a .T, K. tensor"):
        route_tokens(idx.reshape(-1), 4)
    with pytest.raises(ValueError, match="contiguous"):
        route_tokens(torch.zeros(2, 4, dtype=torch.int32).t(), 4)
    with pytest.raises(ValueError, match="num_experts"):
        route_tokens(idx, 0)
    with pytest.raises(ValueError, match="out_counts"):
        route_tokens(idx, 4, out_counts=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_route_slot"):
        route_tokens(idx, 4, out_route_slot=torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="bound_m"):
        route_tokens(idx, 4, bound_m=torch.tensor([1], dtype=torch.int64))
    with pytest.raises(ValueError, match="out_node_slots"):
        route_tokens(idx, 4, out_node_slots=torch.zeros(3, dtype=torch.int32), node_experts=(0, 2))
    with pytest.raises(ValueError, match="node_experts"):
        route_tokens(idx, 4, out_node_slots=torch.zeros(2, dtype=torch.int32), node_experts=(3, 5))


@pytest.mark.timeout(30)
def test_validate_indices():
    validate_indices(torch.tensor([[-1, 0], [3, 2]]), 4)
    validate_indices(torch.zeros(0, 3, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"indices\[1, 0\] = 4"):
        validate_indices(torch.tensor([[-1, 0], [4, 2]]), 4)
    with pytest.raises(ValueError, match=r"indices\[0, 1\] = -2"):
        validate_indices(torch.tensor([[0, -2]], dtype=torch.int32), 4)


@pytest.mark.parametrize("path", [SINGLE, MULTI], ids=["one-launch", "two-launch"])
@pytest.mark.parametrize("bound", [-1, 0, 5, 6, 7, 2**31 - 1], ids=lambda b: f"bound={b}")
def test_a_bound_m_outside_0_T_aborts_the_call_on_the_device(path, bound):
    """CUDA graphs: a device-side token count outside [0, T] writes the abort mark (a count row of -1,
    every route dead) and records itself; inside it, nothing is recorded and the counts are exact."""
    from moe_a2a.protocol.words import decode_bad_bound_m

    T, K, E = 6, 3, 8
    indices = (torch.arange(T * K, device=TEST_DEVICE).view(T, K) * 5 % E).to(torch.int32)
    bound_m = torch.tensor([bound], dtype=torch.int32, device=TEST_DEVICE)
    word = torch.zeros(1, dtype=torch.int64, device=TEST_DEVICE)
    counts, route_slot = route_tokens(indices, E, bound_m=bound_m, bad_bound_m=word, **path)
    if 0 <= bound <= T:
        assert int(word[0]) == 0
        live = indices[:bound].flatten().cpu()
        assert counts.cpu().tolist() == torch.bincount(live.long(), minlength=E).tolist()
    else:
        assert decode_bad_bound_m(int(word[0])) == bound
        assert counts.cpu().tolist() == [-1] * E
        assert (route_slot == -1).all()
