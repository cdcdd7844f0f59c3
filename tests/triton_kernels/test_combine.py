"""Combine kernels (pack by source, weighted reduce) against `reference.combine`, over simulated ranks.

Full round trip: dispatch (kernels + torch-copy transport) -> toy expert -> combine. The data movement
is checked bitwise by the dispatch tests; here the weighted sum is compared with the reference to one
rounding of out_dtype (in the interpreter it is bitwise equal; on GPU an FMA may move the fp32 sum by
an ulp), and tokens >= bound_m must be untouched.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_a2a import reference
from moe_a2a.protocol import plan
from moe_a2a.triton_kernels.combine import pack_combine_by_source, reduce_combined_tokens

from ..conftest import TEST_DEVICE, examples
from .harness import (FP8, Case, cases, live_indices, make_inputs, route_slots, run_combine,
                      run_dispatch, to_cpu, to_device)

# One rounding of out_dtype (relative), plus a little for fp32 sums near zero.
RTOL = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}
ATOL = 1e-5


def toy_expert(case: Case, rank: int, counts: torch.Tensor, expert_x: torch.Tensor,
               expert_x_scale: torch.Tensor | None) -> torch.Tensor:
    """expert_y = x * scale[0] * 0.5 + (global expert + 1) / 4, in out_dtype. The expert term makes two
    routes of one token to different experts give different rows, so a row mix-up cannot cancel."""
    cfg, lay = case.cfg, case.world().layout
    totals, starts = plan.expert_segments(counts.numpy().astype(np.int64), rank, lay)
    R = expert_x.shape[0]
    y = expert_x.float() * 0.5
    if expert_x_scale is not None:
        y = y * torch.nan_to_num(expert_x_scale[:, :1], nan=0.0)
    bias = torch.zeros(R, 1)
    for l in range(lay.num_local_experts):
        bias[int(starts[l]):int(starts[l] + totals[l])] = (rank * lay.num_local_experts + l + 1) / 4
    y = torch.where(bias > 0, y + bias, torch.zeros(()))   # padding / unused rows: 0
    return y.to(cfg.out_dtype)


class CombineRun(NamedTuple):
    """One dispatch -> expert -> combine of a case (`run_dispatch_expert_combine`), every tensor on the CPU."""
    bound_ms: list
    dispatched: object      # harness.run_dispatch's result
    expert_ys: list         # [R, H] per rank
    weights: list           # [T, K] float32 per rank, NaN at masked routes
    old: list               # [T, H] out_dtype per rank: what `out_tokens` held before an accumulating combine
    got: list               # [T, H] per rank
    live: list              # [T, K] per rank: indices with tokens past bound_m dead
    used_rows: list         # rows of each rank's expert output that hold routes (padding included)


def run_dispatch_expert_combine(case: Case, world, expert, accumulate: bool, device: str) -> CombineRun:
    """Dispatch the case's inputs, run `expert(case, rank, counts, x, x_scale)` on each rank's rows, combine
    them with random weights (NaN where a route is masked: never read) into random old tokens or fresh ones."""
    cfg, W = world.cfg, case.world_size
    xs, scales, indices = make_inputs(case, payload="values")
    bound_ms = list(case.bound_m)
    dispatched = to_cpu(run_dispatch(world, [x.to(device) for x in xs],
                                     [s if s is None else s.to(device) for s in scales], indices, bound_ms))
    expert_ys = [expert(case, r, dispatched.counts, dispatched.expert_x[r], dispatched.expert_x_scale[r])
                 for r in range(W)]
    gen = torch.Generator().manual_seed(case.seed + 1)
    weights = [torch.rand(T, cfg.experts_per_token, generator=gen) for T in case.num_tokens]
    for w, idx in zip(weights, indices):
        w[idx < 0] = float("nan")   # weights of masked routes must never be read
    old = [(torch.randn(T, cfg.hidden_dim, generator=gen)).to(cfg.out_dtype) for T in case.num_tokens]

    got = run_combine(world, to_device(dispatched, device), [w.to(device) for w in weights],
                      [y.to(device) for y in expert_ys],
                      out_tokens=[o.to(device) for o in old] if accumulate else None,
                      accumulate=accumulate, bound_ms=bound_ms)
    live = [live_indices(idx, b) for idx, b in zip(indices, bound_ms)]
    used = [int(sum(-(-int(n) // cfg.expert_padding) * cfg.expert_padding for n in dispatched.num_tokens[r]))
            if cfg.expert_capacity is None else world.layout.max_dispatch_rows for r in range(W)]
    return CombineRun(bound_ms, dispatched, expert_ys, weights, old, [g.cpu() for g in got], live, used)


def check_combine(case: Case, accumulate: bool, device: str = TEST_DEVICE) -> None:
    cfg, W = case.cfg, case.world_size
    bound_ms, _, expert_ys, weights, old, got, live, R_used = run_dispatch_expert_combine(
        case, case.world(device), toy_expert, accumulate, device)
    want = reference.combine(cfg, live, [torch.nan_to_num(w, nan=0.0) for w in weights],
                             [expert_ys[r][:R_used[r]] for r in range(W)], old if accumulate else None)
    for r in range(W):
        T = case.num_tokens[r]
        n_live = T if bound_ms[r] is None else min(bound_ms[r], T)
        torch.testing.assert_close(got[r][:n_live].float(), want[r][:n_live].float(),
                                   rtol=RTOL[cfg.out_dtype], atol=ATOL, msg=f"rank {r}")
        untouched = old[r] if accumulate else None
        if untouched is not None:
            assert torch.equal(got[r][n_live:].view(torch.uint8), untouched[n_live:].view(torch.uint8)), r
        else:
            assert bool((got[r][n_live:].view(torch.uint8) == 0xA5).all()), r


@pytest.mark.timeout(150)
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), accumulate=st.booleans())
def test_combine_matches_reference(case: Case, accumulate: bool) -> None:
    check_combine(case, accumulate)


EDGE_CASES = [
    # Every route to one expert of rank 3; 2 nodes: 3 sources stage remotely, 3 push same-node.
    pytest.param(Case(world_size=6, node_size=3, num_local_experts=1, experts_per_token=4, max_num_tokens=3,
                      num_tokens=(3,) * 6, bound_m=(None,) * 6, in_dtype=FP8, scale_block=16,
                      max_private_tokens=1, routing="one_expert"), False, id="W6-N3-FP8-ONE_EXPERT"),
    # W=8, all remote, masked + duplicates, bound_m < T, fp16 out, accumulate.
    pytest.param(Case(world_size=8, node_size=1, num_local_experts=2, experts_per_token=5, max_num_tokens=4,
                      num_tokens=(4, 3, 0, 4, 4, 1, 4, 2), bound_m=(3, None, None, 0, 4, None, 2, None),
                      hidden_dim=24, in_dtype=torch.bfloat16, out_dtype=torch.float16, expert_padding=16,
                      routing="duplicates", mask_percent=30, index_dtype=torch.int32), True,
                 id="W8-N1-BF16-FP16OUT-DUP-MASKED-BOUND-ACC"),
    # T=0 everywhere: reduce launches nothing, pack moves nothing.
    pytest.param(Case(world_size=2, node_size=2, num_tokens=(0, 0), bound_m=(None, None)), True, id="W2-T0"),
    # Decode-shaped row: H=7168, bf16 out (7 reduce chunks of 1024).
    pytest.param(Case(world_size=2, node_size=1, num_local_experts=4, experts_per_token=8, max_num_tokens=2,
                      num_tokens=(2, 2), bound_m=(None, None), hidden_dim=7168, in_dtype=FP8, scale_block=128,
                      routing="topk"), False, id="W2-H7168-FP8-BF16OUT"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, accumulate", EDGE_CASES)
def test_combine_edge_cases(case: Case, accumulate: bool) -> None:
    check_combine(case, accumulate)


@pytest.mark.gpu(reason="the edge cases with compiled kernels")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, accumulate", EDGE_CASES)
def test_combine_edge_cases_gpu(case: Case, accumulate: bool) -> None:
    check_combine(case, accumulate, "cuda")


# ---- validation ---------------------------------------------------------------------------------
def _reduce_args(case: Case = Case()):
    cfg, world = case.cfg, case.world()
    dev = world.arena.device
    _, slot = route_slots(make_inputs(case)[2][0], cfg.num_experts)
    return dict(out_tokens=torch.zeros(4, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev), route_slot=slot.to(dev),
                weights=torch.ones(4, cfg.experts_per_token, device=dev), recv_base=world.arena,
                recv_offset_bytes=world.recv_bytes[0], cfg=cfg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, bad", [
    ("out_tokens", lambda a: a["out_tokens"].float()),
    ("out_tokens", lambda a: a["out_tokens"][:, :3]),
    ("route_slot", lambda a: a["route_slot"][:3]),
    ("weights", lambda a: a["weights"].double()),
    ("weights", lambda a: a["weights"][:, :1]),
    ("recv_base", lambda a: a["recv_base"].view(torch.int8)),
    ("recv_offset_bytes", lambda a: a["recv_offset_bytes"] + 1),   # not element aligned
    ("accumulate", lambda a: 1),
    ("bound_m", lambda a: torch.tensor([[1]], dtype=torch.int32)),
])
def test_reduce_rejects_bad_input(name, bad) -> None:
    args = _reduce_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=name):
        reduce_combined_tokens(**args)


def _pack_combine_args(case: Case = Case()):
    cfg, world = case.cfg, case.world()
    lay, dev = world.layout, world.arena.device
    return dict(expert_y=torch.zeros(lay.max_dispatch_rows, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev),
                counts=torch.zeros(2, cfg.num_experts, dtype=torch.int32, device=dev), rank=1, base=world.arena,
                peer_recv_bytes=world.peer_table(1, world.recv_bytes), stage_bytes=world.send_bytes[1],
                cfg=cfg, layout=lay)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, bad", [
    ("expert_y", lambda a: a["expert_y"].half()),
    ("expert_y", lambda a: a["expert_y"][:, :7]),
    ("counts", lambda a: a["counts"].T.contiguous()),
    ("rank", lambda a: -1),
    ("base", lambda a: a["base"][:8].view(torch.int64)),
    ("peer_recv_bytes", lambda a: a["peer_recv_bytes"][:1]),
    ("stage_bytes", lambda a: torch.tensor(0)),
])
def test_pack_combine_rejects_bad_input(name, bad) -> None:
    args = _pack_combine_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=name):
        pack_combine_by_source(**args)
