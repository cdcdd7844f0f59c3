"""Dispatch kernels (pack, unpack) against `reference.dispatch`, bitwise, over simulated ranks.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py). The transport between ranks is the
torch-copy harness of `harness.py`, driven by `plan`'s writes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from moe_a2a import reference
from moe_a2a.protocol import plan
from moe_a2a.triton_kernels.dispatch import pack_tokens_by_expert, unpack_tokens_by_expert

from ..conftest import TEST_DEVICE, examples
from .harness import FP8, POISON, Case, cases, live_indices, make_inputs, route_slots, run_dispatch, to_cpu


def check_dispatch(case: Case, device: str = TEST_DEVICE) -> None:
    cfg, W = case.cfg, case.world_size
    world = case.world(device)
    lay = world.layout
    xs, scales, indices = make_inputs(case, payload="bytes")
    got = run_dispatch(world, [x.to(device) for x in xs], [s if s is None else s.to(device) for s in scales],
                       indices, list(case.bound_m))
    got = to_cpu(got)
    live = [live_indices(idx, b) for idx, b in zip(indices, case.bound_m)]
    want = reference.dispatch(cfg, xs, scales if cfg.has_scales else None, live)

    # Invariants of the routing the kernels consumed.
    num_live = [int((idx >= 0).sum()) for idx in live]
    assert got.counts.sum(1).tolist() == num_live                 # every live route counted once
    for r in range(W):
        slot = got.route_slot[r]
        assert torch.equal(slot >= 0, live[r] >= 0)
        assert sorted(slot[slot >= 0].tolist()) == list(range(num_live[r]))   # a permutation of slots
    totals = sum(int(n.sum()) for n in got.num_tokens)
    assert totals == sum(num_live)                                  # nothing lost, nothing doubled

    counts_np = got.counts.numpy().astype(np.int64)
    for r in range(W):
        n_ref, x_ref, s_ref = want[r]
        assert torch.equal(got.num_tokens[r], n_ref), r
        # out_source_ranges: (begin << 32) | count per (local expert, source), begin = earlier sources' rows.
        c = got.counts[:, r * lay.num_local_experts:(r + 1) * lay.num_local_experts].t().long()
        assert torch.equal(got.source_ranges[r], ((c.cumsum(1) - c) << 32) | c), r
        totals, starts = plan.expert_segments(counts_np, r, lay)
        assert got.num_tokens[r].tolist() == totals.tolist()
        x_u8 = got.expert_x[r].view(torch.uint8)
        written = torch.zeros(x_u8.shape[0], dtype=torch.bool)
        for l in range(lay.num_local_experts):
            a, n = int(starts[l]), int(totals[l])
            written[a:a + n] = True
            assert torch.equal(x_u8[a:a + n], x_ref[a:a + n].view(torch.uint8)), (r, l)
            if cfg.has_scales:
                assert torch.equal(got.expert_x_scale[r][a:a + n].view(torch.int32),
                                   s_ref[a:a + n].view(torch.int32)), (r, l)
        # Padding rows and rows past the received ones are left untouched.
        assert bool((x_u8[~written] == POISON).all()), r
        if cfg.has_scales:
            assert bool(got.expert_x_scale[r][~written].isnan().all()), r


@pytest.mark.timeout(120)
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_dispatch_matches_reference(case: Case) -> None:
    check_dispatch(case)


# Named edge cases, always run (hypothesis may or may not draw them).
EDGE_CASES = [
    # W=8 over 2 nodes, every route to one expert, no private region: only the remainder path.
    pytest.param(Case(world_size=8, node_size=4, num_local_experts=1, experts_per_token=3, max_num_tokens=3,
                      num_tokens=(3,) * 8, bound_m=(None,) * 8, in_dtype=FP8, scale_block=16,
                      max_private_tokens=0, routing="one_expert"), id="W8-N4-FP8-ONE_EXPERT-P0"),
    # W=8 all remote, private region of 1 row: private + remainder for every source, bound_m < T.
    pytest.param(Case(world_size=8, node_size=1, num_local_experts=2, experts_per_token=4, max_num_tokens=4,
                      num_tokens=(4, 0, 4, 2, 4, 4, 1, 4), bound_m=(2, None, 0, None, 4, 3, None, None),
                      hidden_dim=33, in_dtype=torch.float32, max_private_tokens=1, expert_padding=4,
                      routing="duplicates", mask_percent=30, index_dtype=torch.int32),
                 id="W8-N1-FP32-DUP-MASKED-P1-BOUND"),
    # T=0 on every rank: nothing routed, counts zero, nothing written.
    pytest.param(Case(world_size=4, node_size=2, num_tokens=(0,) * 4, bound_m=(None,) * 4),
                 id="W4-N2-T0"),
    # Single rank: self is the only (same-node) source; K=9 > E=3 with padding 128.
    pytest.param(Case(world_size=1, node_size=1, experts_per_token=9, max_num_tokens=5, num_tokens=(5,),
                      bound_m=(None,), hidden_dim=5, in_dtype=FP8, scale_block=None, expert_padding=128),
                 id="W1-K9-H5-PAD128"),
    # Decode-shaped row (H=7168 fp8 + 56 scales): 16-byte aligned rows, several copy chunks.
    pytest.param(Case(world_size=2, node_size=1, num_local_experts=4, experts_per_token=8, max_num_tokens=2,
                      num_tokens=(2, 2), bound_m=(None, 1), hidden_dim=7168, in_dtype=FP8, scale_block=128,
                      routing="topk"), id="W2-H7168-FP8-S56"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", EDGE_CASES)
def test_dispatch_edge_cases(case: Case) -> None:
    check_dispatch(case)


@pytest.mark.gpu(reason="the edge cases with compiled kernels")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", EDGE_CASES)
def test_dispatch_edge_cases_gpu(case: Case) -> None:
    check_dispatch(case, "cuda")


# ---- validation: bad input is refused with a ValueError naming the argument ---------------------
def _pack_args(cfg_case: Case = Case()):
    """Arguments of one rank's pack, every tensor on the test device (the arena's)."""
    cfg = cfg_case.cfg
    world = cfg_case.world()
    dev = world.arena.device
    xs, scales, indices = make_inputs(cfg_case)
    _, slot = route_slots(indices[0], cfg.num_experts)
    return dict(x=xs[0].to(dev), x_scale=None if scales[0] is None else scales[0].to(dev), route_slot=slot.to(dev),
                send_base=world.arena, send_offset_bytes=world.send_bytes[0], cfg=cfg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, bad", [
    ("x", lambda a: a["x"].float()),                                   # wrong dtype
    ("x", lambda a: a["x"][:, :-1]),                                   # wrong hidden size
    ("route_slot", lambda a: a["route_slot"].float()),
    ("route_slot", lambda a: a["route_slot"][:, :1]),                   # wrong K
    ("send_base", lambda a: a["send_base"].view(torch.int8)),
    ("send_offset_bytes", lambda a: 1.5),
    ("bound_m", lambda a: torch.tensor([1], dtype=torch.int64)),
])
def test_pack_rejects_bad_input(name, bad) -> None:
    args = _pack_args()
    bound = args.pop("bound_m", None)
    if name == "bound_m":
        bound = bad(args)
    else:
        args[name] = bad(args)
    with pytest.raises(ValueError, match=name):
        pack_tokens_by_expert(**args, bound_m=bound)


def test_pack_rejects_scales_mismatch() -> None:
    args = _pack_args(Case(in_dtype=FP8, scale_block=16))
    args["x_scale"] = None
    with pytest.raises(ValueError, match="x_scale"):
        pack_tokens_by_expert(**args)
    args = _pack_args()
    args["x_scale"] = torch.zeros(4, 3, device=args["x"].device)
    with pytest.raises(ValueError, match="x_scale"):
        pack_tokens_by_expert(**args)


def _unpack_args(case: Case = Case(in_dtype=FP8, scale_block=16)):
    cfg, world = case.cfg, case.world()
    lay, dev = world.layout, world.arena.device
    R = lay.max_dispatch_rows
    return dict(out_expert_num_tokens=torch.zeros(lay.num_local_experts, dtype=torch.int32, device=dev),
                out_expert_x=torch.zeros(R, cfg.hidden_dim, dtype=cfg.in_dtype, device=dev),
                out_expert_x_scale=torch.zeros(R, cfg.num_scales, device=dev),
                counts=torch.zeros(2, cfg.num_experts, dtype=torch.int32, device=dev),
                rank=0, base=world.arena, peer_send_bytes=world.peer_table(0, world.send_bytes),
                recv_bytes=world.recv_bytes[0], cfg=cfg, layout=lay)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, bad", [
    ("out_expert_num_tokens", lambda a: a["out_expert_num_tokens"].long()),
    ("out_expert_x", lambda a: a["out_expert_x"].view(torch.uint8)),
    ("out_expert_x_scale", lambda a: a["out_expert_x_scale"][:, :1]),
    ("counts", lambda a: a["counts"].long()),
    ("counts", lambda a: a["counts"][:1]),
    ("rank", lambda a: 2),
    ("peer_send_bytes", lambda a: a["peer_send_bytes"].int()),
    ("layout", lambda a: Case(max_num_tokens=8).cfg.layout(2)),
])
def test_unpack_rejects_bad_input(name, bad) -> None:
    args = _unpack_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=name):
        unpack_tokens_by_expert(**args)


@pytest.mark.timeout(60)
def test_pack_split_sends_the_node_slots_to_one_buffer_and_the_rest_to_the_other() -> None:
    """Only remote rows staged: slots in [node_slots[0], node_slots[1]) land in the send buffer, every
    other slot in the remote (staging) buffer, at the same slot offset; nothing else is written."""
    case = Case()
    args = _pack_args(case)
    cfg, arena = args["cfg"], args["send_base"]
    lay = case.world().layout
    n = int((args["route_slot"] >= 0).sum())
    lo, hi = n // 3, n - n // 3
    # The second buffer: the recv buffer that follows this send buffer in the harness arena (page
    # aligned, room for more than T*K dispatch rows).
    remote = args["send_offset_bytes"] + lay.send_bytes
    assert lay.recv_bytes >= cfg.max_routes * cfg.dispatch_stride_bytes
    arena.zero_()
    pack_tokens_by_expert(**args, remote_send_offset_bytes=remote,
                          node_slots=torch.tensor([lo, hi], dtype=torch.int32, device=arena.device))
    sd, xb = cfg.dispatch_stride_bytes, cfg.x_bytes
    a = arena.cpu()
    for s in range(n):
        in_node = lo <= s < hi
        node_row = a[args["send_offset_bytes"] + s * sd: args["send_offset_bytes"] + s * sd + xb]
        remote_row = a[remote + s * sd: remote + s * sd + xb]
        assert bool(node_row.any()) == in_node and bool(remote_row.any()) == (not in_node), s
    with pytest.raises(ValueError, match="both or neither"):
        pack_tokens_by_expert(**args, remote_send_offset_bytes=remote)


