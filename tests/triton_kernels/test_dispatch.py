"""Dispatch kernels (pack, unpack) against `reference.dispatch`, bitwise, over simulated ranks.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py). The transport between ranks is the
torch-copy harness of `harness.py`, driven by `plan`'s writes.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_a2a import reference
from moe_a2a.protocol import plan
from moe_a2a.runtime.checks import check_dispatch_outputs
from moe_a2a.triton_kernels.dispatch import pack_tokens_by_expert, unpack_tokens_by_expert
from moe_a2a.triton_kernels.quant import Fp8Quantize

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




# ---- scales into a 3-D [L, C, S] output of any strides (expert_capacity C) -----------------------
SCALE_POISON = 0x7FBADBAD  # an int32 fill (a NaN's bits): an element the unpack should not write keeps it


def _scale_outputs(L: int, C: int, S: int, layout: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, storage)`: a `[L, C, S]` float32 view laid out as `layout` says, and its whole 1-D storage;
    every element SCALE_POISON."""
    shape = {"deep_ep": (L, S, -(-C // 4) * 4),  # DeepEP's: the transpose of [L, S, C4], C4 = C rounded up to 4
             "contiguous": (L, C, S),            # plain row-major [L, C, S]
             "scale_major": (S, L, C + 1)}[layout]  # [S, L, C] storage one element in: every stride differs
    storage = torch.full((int(np.prod(shape)),), SCALE_POISON, dtype=torch.int32, device=device).view(torch.float32)
    t = storage.view(shape)
    out = {"deep_ep": lambda: t[:, :, :C].transpose(1, 2), "contiguous": lambda: t,
           "scale_major": lambda: t[:, :, 1:].permute(1, 2, 0)}[layout]()
    return out, storage


def check_scales_3d(case: Case, layout: str, device: str = TEST_DEVICE) -> None:
    """The unpack's 3-D scale output equals (bitwise) its 2-D one re-laid-out: rows below each expert's
    count written at [l, c, :]; every other element of the tensor's storage untouched."""
    cfg, world = case.cfg, case.world(device)
    lay, C, S = world.layout, case.expert_capacity, case.cfg.num_scales
    L = lay.num_local_experts
    xs, scales, indices = make_inputs(case, payload="bytes")
    got = run_dispatch(world, [x.to(device) for x in xs], [s.to(device) for s in scales], indices,
                       list(case.bound_m))
    for me in range(case.world_size):
        # The arena still holds every rank's rows: unpack them again, the scales into the 3-D tensor.
        out3, storage = _scale_outputs(L, C, S, layout, device)
        num = torch.zeros(L, dtype=torch.int32, device=device)
        ex = torch.full_like(got.expert_x[me].view(torch.uint8), POISON).view(cfg.in_dtype)
        unpack_tokens_by_expert(num, ex, out3, got.counts, me, world.arena, world.peer_table(me, world.send_bytes),
                                world.recv_bytes[me], cfg, lay)
        assert torch.equal(num, got.num_tokens[me]), me
        assert torch.equal(ex.view(torch.uint8), got.expert_x[me].view(torch.uint8)), me
        want = got.expert_x_scale[me].reshape(L, C, S).cpu().view(torch.int32)   # the 2-D output's rows
        live = (torch.arange(C)[None, :] < num.cpu()[:, None])[:, :, None].expand(L, C, S)  # rows received
        got3 = out3.cpu().view(torch.int32)
        assert torch.equal(got3[live], want[live]), me
        # Every other element of the storage (rows past the count, the layout's padding) is untouched.
        where = torch.arange(storage.numel()).as_strided(out3.shape, out3.stride(), out3.storage_offset())
        untouched = torch.ones(storage.numel(), dtype=torch.bool)
        untouched[where[live]] = False
        assert bool((storage.cpu().view(torch.int32)[untouched] == SCALE_POISON).all()), me


# (L, C, S): C not a multiple of 4 (DeepEP's layout pads the column stride), C = 1, S = 1.
SCALE_3D_CASES = [
    # W=2 all remote, top-k routing (at most 6 rows an expert): C=7, S=3.
    pytest.param(Case(world_size=2, node_size=1, num_local_experts=3, experts_per_token=2, max_num_tokens=3,
                      num_tokens=(3, 2), bound_m=(None, None), hidden_dim=40, in_dtype=FP8, scale_block=16,
                      routing="topk", expert_capacity=7), id="W2-N1-L3-C7-S3"),
    # W=4 over 2 nodes (pulled and proxied rows), one expert takes every route: C=W*T*K=24, S=9, bound_m.
    pytest.param(Case(world_size=4, node_size=2, num_local_experts=2, experts_per_token=3, max_num_tokens=2,
                      num_tokens=(2, 2, 1, 2), bound_m=(None, 1, None, None), hidden_dim=136, in_dtype=FP8,
                      scale_block=16, routing="one_expert", max_private_tokens=1, expert_capacity=24),
                 id="W4-N2-L2-C24-S9-ONE_EXPERT"),
    # One rank, one token, top-1: C=1, S=1 (bf16 rows with one fp32 scale).
    pytest.param(Case(world_size=1, node_size=1, num_local_experts=2, experts_per_token=1, max_num_tokens=1,
                      num_tokens=(1,), bound_m=(None,), hidden_dim=24, in_dtype=torch.bfloat16, scale_block=32,
                      expert_capacity=1), id="W1-L2-C1-S1"),
    # Decode-shaped rows (H=7168 fp8 + 56 scales), C=5 (DeepEP's layout pads the column stride to 8).
    pytest.param(Case(world_size=2, node_size=1, num_local_experts=2, experts_per_token=2, max_num_tokens=2,
                      num_tokens=(2, 2), bound_m=(None, None), hidden_dim=7168, in_dtype=FP8, scale_block=128,
                      routing="topk", expert_capacity=5), id="W2-H7168-C5-S56"),
    # More local experts than programs (3 in the interpreter): a program's scale pass takes several.
    pytest.param(Case(world_size=2, node_size=1, num_local_experts=8, experts_per_token=4, max_num_tokens=16,
                      num_tokens=(16, 11), bound_m=(None, None), hidden_dim=48, in_dtype=FP8, scale_block=16,
                      routing="topk", expert_capacity=32), id="W2-N1-L8-C32-S3"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["deep_ep", "contiguous", "scale_major"])
@pytest.mark.parametrize("case", SCALE_3D_CASES)
def test_unpack_scales_into_a_3d_output(case: Case, layout: str) -> None:
    check_scales_3d(case, layout)


@st.composite
def capacity_cases(draw) -> Case:
    """`cases()` with scales and a capacity that fits every route (C % 4 drawn: 0 to 3 past the worst)."""
    case = draw(cases(max_world=4))
    worst = case.world_size * case.max_num_tokens * case.experts_per_token
    return dataclasses.replace(case, in_dtype=FP8, scale_block=draw(st.sampled_from([8, 16, 128])),
                               expert_padding=1, expert_capacity=worst + draw(st.integers(0, 3)))


@pytest.mark.timeout(180)
@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=capacity_cases(), layout=st.sampled_from(["deep_ep", "contiguous", "scale_major"]))
def test_unpack_scales_into_a_3d_output_drawn(case: Case, layout: str) -> None:
    check_scales_3d(case, layout)


@pytest.mark.gpu(reason="the 3-D scale output with compiled kernels")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", SCALE_3D_CASES)
def test_unpack_scales_into_a_3d_output_gpu(case: Case) -> None:
    check_scales_3d(case, "deep_ep", "cuda")


# The words of a fused fp8 quantisation's scales out of each received row's payload (the facade's fp8 rows):
# the unpack copies words, so the rows here are random bytes with "scales" at the Fp8Quantize's offset.
QUANT_SCALE_CASES = [
    # H=40 bf16 rows; fp32 scales of 16-element blocks (3 words) or UE8M0 (1 word) at byte 40; C=7.
    pytest.param(Case(world_size=2, node_size=1, num_local_experts=3, experts_per_token=2, max_num_tokens=3,
                      num_tokens=(3, 2), bound_m=(None, 1), hidden_dim=40, routing="topk", expert_capacity=7),
                 Fp8Quantize(scale_offset_bytes=40, block=16), id="W2-H40-C7-FP32x3"),
    pytest.param(Case(world_size=2, node_size=1, num_local_experts=3, experts_per_token=2, max_num_tokens=3,
                      num_tokens=(3, 2), bound_m=(None, 1), hidden_dim=40, routing="topk", expert_capacity=7),
                 Fp8Quantize(scale_offset_bytes=40, block=16, ue8m0=True), id="W2-H40-C7-UE8M0x1"),
    # The facade's decode rows: H=7168, 56 fp32 scales (or 14 UE8M0 words) at byte 7168, pulled and
    # proxied sources, C=6 (DeepEP's layout pads to 8); rows also carry a scale column (the token index).
    pytest.param(Case(world_size=4, node_size=2, num_local_experts=1, experts_per_token=2, max_num_tokens=1,
                      num_tokens=(1, 1, 1, 1), bound_m=(None,) * 4, hidden_dim=7168, scale_block=7168,
                      routing="topk", expert_capacity=6),
                 Fp8Quantize(scale_offset_bytes=7168, block=128), id="W4-N2-H7168-C6-FP32x56"),
    pytest.param(Case(world_size=4, node_size=2, num_local_experts=1, experts_per_token=2, max_num_tokens=1,
                      num_tokens=(1, 1, 1, 1), bound_m=(None,) * 4, hidden_dim=7168, scale_block=7168,
                      routing="topk", expert_capacity=6),
                 Fp8Quantize(scale_offset_bytes=7168, block=128, ue8m0=True), id="W4-N2-H7168-C6-UE8M0x14"),
    # More local experts than programs (3 in the interpreter) and experts of more rows than a scale tile.
    pytest.param(Case(world_size=2, node_size=1, num_local_experts=8, experts_per_token=4, max_num_tokens=16,
                      num_tokens=(16, 11), bound_m=(None, None), hidden_dim=40, routing="topk", expert_capacity=32),
                 Fp8Quantize(scale_offset_bytes=40, block=16), id="W2-N1-L8-C32-FP32x3"),
]


def check_quantized_scales(case: Case, quantize: Fp8Quantize, layout: str, device: str = TEST_DEVICE) -> None:
    """`unpack(quantize=, out_quantized_scale=)` writes each received row's scale words (bytes
    [scale_offset_bytes, + scale_bytes) of its payload) to `[l, c, :]` of a 3-D output of any strides (or
    row i of a 2-D one), bitwise; nothing else of the output's storage; the rows and scale column as without."""
    cfg, world = case.cfg, case.world(device)
    lay, C, H = world.layout, case.expert_capacity, cfg.hidden_dim
    L, n, off = lay.num_local_experts, quantize.scale_bytes(H) // 4, quantize.scale_offset_bytes
    xs, scales, indices = make_inputs(case, payload="bytes")
    got = run_dispatch(world, [x.to(device) for x in xs], [s if s is None else s.to(device) for s in scales],
                       indices, list(case.bound_m))
    for me in range(case.world_size):
        if layout == "2d":
            storage = torch.full((L * C, n + 2), SCALE_POISON, dtype=torch.int32, device=device)
            out = storage[:, 1:1 + n]
            storage = storage.view(-1)
        else:
            out, storage = _scale_outputs(L, C, n, layout, device)
            out, storage = out.view(torch.int32), storage.view(torch.int32)
            if not quantize.ue8m0:
                out = out.view(torch.float32)   # fp32 scales land in float32, UE8M0 words in int32
        num = torch.zeros(L, dtype=torch.int32, device=device)
        ex = torch.full_like(got.expert_x[me].view(torch.uint8), POISON).view(cfg.in_dtype)
        exs = None if got.expert_x_scale[me] is None else torch.full_like(got.expert_x_scale[me], float("nan"))
        unpack_tokens_by_expert(num, ex, exs, got.counts, me, world.arena, world.peer_table(me, world.send_bytes),
                                world.recv_bytes[me], cfg, lay, quantize=quantize, out_quantized_scale=out)
        assert torch.equal(num, got.num_tokens[me]), me
        assert torch.equal(ex.view(torch.uint8), got.expert_x[me].view(torch.uint8)), me
        if exs is not None:
            assert torch.equal(exs.view(torch.int32), got.expert_x_scale[me].view(torch.int32)), me
        rows = got.expert_x[me].view(torch.uint8).cpu()[:, off:off + 4 * n].contiguous().view(torch.int32)
        want = rows.view(L, C, n)
        live = (torch.arange(C)[None, :] < num.cpu()[:, None])[:, :, None].expand(L, C, n)
        got3 = out.view(torch.int32).cpu().view(L, C, n) if layout == "2d" else out.view(torch.int32).cpu()
        assert torch.equal(got3[live], want[live]), me
        shape3 = (L, C, n)
        strides3 = (C * out.stride(0), out.stride(0), out.stride(1)) if layout == "2d" else out.stride()
        where = torch.arange(storage.numel()).as_strided(shape3, strides3, out.storage_offset())
        untouched = torch.ones(storage.numel(), dtype=torch.bool)
        untouched[where[live]] = False
        assert bool((storage.cpu()[untouched] == SCALE_POISON).all()), me


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["deep_ep", "scale_major", "2d"])
@pytest.mark.parametrize("case, quantize", QUANT_SCALE_CASES)
def test_unpack_quantized_scales_out_of_the_payload(case: Case, quantize: Fp8Quantize, layout: str) -> None:
    check_quantized_scales(case, quantize, layout)


@pytest.mark.gpu(reason="the quantised scales' output with compiled kernels")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, quantize", QUANT_SCALE_CASES)
def test_unpack_quantized_scales_out_of_the_payload_gpu(case: Case, quantize: Fp8Quantize) -> None:
    check_quantized_scales(case, quantize, "deep_ep", "cuda")


@pytest.mark.timeout(60)
def test_unpack_rejects_bad_quantized_scale_output() -> None:
    case = Case(in_dtype=torch.bfloat16, hidden_dim=40, expert_capacity=8)
    args = _unpack_args(case)
    args["out_expert_x_scale"] = None
    q = Fp8Quantize(scale_offset_bytes=40, block=16)   # 3 fp32 words
    dev = args["base"].device
    bads = [
        (dict(quantize=q), "out_quantized_scale", "both or neither"),
        (dict(out_quantized_scale=torch.zeros(3, 8, 3, device=dev)), "out_quantized_scale", "both or neither"),
        (dict(quantize=q, out_quantized_scale=torch.zeros(3, 8, 4, device=dev)), "out_quantized_scale", "shape"),
        (dict(quantize=q, out_quantized_scale=torch.zeros(3, 8, 3, dtype=torch.float64, device=dev)),
         "out_quantized_scale", "dtype"),
        (dict(quantize=Fp8Quantize(scale_offset_bytes=72, block=16), out_quantized_scale=torch.zeros(3, 8, 3,
              device=dev)), "quantize", "within a row"),                            # scales past the payload
    ]
    for extra, name, match in bads:
        with pytest.raises(ValueError, match=name) as err:
            unpack_tokens_by_expert(**args, **extra)
        assert re.search(match, str(err.value)), str(err.value)
    no_cap = _unpack_args(Case(in_dtype=torch.bfloat16, hidden_dim=40))
    no_cap["out_expert_x_scale"] = None
    with pytest.raises(ValueError, match="out_quantized_scale.*needs A2AConfig.expert_capacity"):
        unpack_tokens_by_expert(**no_cap, quantize=q, out_quantized_scale=torch.zeros(3, 8, 3, device=dev))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, bad, match", [
    # 3-D without expert_capacity: the rows are compact, there is no [L, C] to address.
    (Case(in_dtype=FP8, scale_block=16), lambda a, L, C, S: torch.zeros(L, 4, S, device=a["base"].device),
     "needs A2AConfig.expert_capacity"),
    (Case(in_dtype=FP8, scale_block=16, expert_capacity=16),                   # C + 1 rows an expert
     lambda a, L, C, S: torch.zeros(L, C + 1, S, device=a["base"].device), r"\[3, 16, 3\]"),
    (Case(in_dtype=FP8, scale_block=16, expert_capacity=16),                   # a scale column short
     lambda a, L, C, S: torch.zeros(L, C, S - 1, device=a["base"].device), "shape"),
    (Case(in_dtype=FP8, scale_block=16, expert_capacity=16),                   # int32 (bits are fine 2-D too)
     lambda a, L, C, S: torch.zeros(L, C, S, dtype=torch.int32, device=a["base"].device), "float32"),
])
def test_unpack_rejects_bad_3d_scales(case: Case, bad, match) -> None:
    args = _unpack_args(case)
    lay = args["layout"]
    args["out_expert_x_scale"] = bad(args, lay.num_local_experts, lay.expert_capacity, case.cfg.num_scales)
    with pytest.raises(ValueError, match="out_expert_x_scale") as err:
        unpack_tokens_by_expert(**args)
    assert re.search(match, str(err.value)), str(err.value)


@pytest.mark.timeout(60)
def test_dispatch_output_checks_take_3d_scales_only_with_a_capacity() -> None:
    """`AllToAll.dispatch`'s boundary check (runtime/checks.py) agrees with the launcher's."""
    dev = torch.device(TEST_DEVICE)
    for C in (None, 6):
        case = Case(in_dtype=FP8, scale_block=16, expert_capacity=C)
        cfg, lay = case.cfg, case.cfg.layout(2)
        L, S = lay.num_local_experts, cfg.num_scales
        num = torch.zeros(L, dtype=torch.int32, device=dev)
        ex = torch.zeros(lay.max_dispatch_rows, cfg.hidden_dim, dtype=cfg.in_dtype, device=dev)
        deep_ep = _scale_outputs(L, C or 4, S, "deep_ep", dev)[0]
        if C:
            check_dispatch_outputs(cfg, lay, dev, num, ex, deep_ep)
            check_dispatch_outputs(cfg, lay, dev, num, ex, torch.zeros(lay.max_dispatch_rows, S, device=dev))
            bads = [(torch.zeros(L, C, S + 1, device=dev), r"\[3, 6, 3\]"),
                    (torch.zeros(L, C, S, dtype=torch.float64, device=dev), "dtype"),
                    (torch.zeros(L, C, S, device=dev).unsqueeze(0), "got")]
        else:
            bads = [(deep_ep, "without A2AConfig.expert_capacity")]
        for bad, match in bads:
            with pytest.raises(ValueError, match="out_expert_x_scale") as err:
                check_dispatch_outputs(cfg, lay, dev, num, ex, bad)
            assert re.search(match, str(err.value)), str(err.value)
    # Per-rank rows (their expand takes [R, S] scales only): refused at the boundary, not in the receive half.
    cfg = dataclasses.replace(Case(in_dtype=FP8, scale_block=16, expert_capacity=6).cfg, dispatch_rows="rank")
    lay = cfg.layout(2, 2)
    num = torch.zeros(lay.num_local_experts, dtype=torch.int32, device=dev)
    ex = torch.zeros(lay.max_dispatch_rows, cfg.hidden_dim, dtype=cfg.in_dtype, device=dev)
    with pytest.raises(ValueError, match="out_expert_x_scale.*not taken with dispatch_rows='rank'"):
        check_dispatch_outputs(cfg, lay, dev, num, ex, _scale_outputs(lay.num_local_experts, 6, 3, "deep_ep", dev)[0])


def test_pack_row_meta_comes_from_row_meta_args() -> None:
    """The pack's per-rank metadata arguments: only `rank_rows.row_meta_args`' dict, which checks its tensors."""
    from moe_a2a.config import A2AConfig
    from moe_a2a.triton_kernels.rank_rows import row_meta_args

    cfg = A2AConfig(max_num_tokens=4, num_experts=4, experts_per_token=2, hidden_dim=16, in_dtype=torch.float32,
                    dispatch_rows="rank", combine_rows="rank")
    lay = cfg.layout(2)
    x = torch.zeros(4, 16, device=TEST_DEVICE)
    slots = torch.full((4, 2), -1, dtype=torch.int32, device=TEST_DEVICE)
    base = torch.zeros(lay.send_rows * cfg.dispatch_stride_bytes, dtype=torch.uint8, device=TEST_DEVICE)
    with pytest.raises(ValueError, match=re.escape("row_meta: expected rank_rows.row_meta_args(...)")):
        pack_tokens_by_expert(x, None, slots, base, 0, cfg, row_meta={"meta_sender": 0})
    indices = torch.zeros(4, 2, dtype=torch.int32, device=TEST_DEVICE)
    counts = torch.zeros(4, dtype=torch.int32, device=TEST_DEVICE)
    with pytest.raises(ValueError, match="weights"):
        row_meta_args(indices, slots, counts, None, cfg, lay)  # the combine reduced at the experts' rank needs them
    with pytest.raises(ValueError, match="counts"):
        row_meta_args(indices, slots, counts[:3], torch.ones(4, 2, device=TEST_DEVICE), cfg, lay)
    meta = row_meta_args(indices, slots, counts, torch.ones(4, 2, device=TEST_DEVICE), cfg, lay)
    assert meta["RANK_META"] and meta["META_WEIGHTS"] and meta["META_OFFSET_BYTES"] == cfg.rank_meta_offset_bytes
