"""fp8 combine (`A2AConfig(combine_fp8=True)`): pack quantises, reduce dequantises, against
`reference.combine_fp8` and `reference.quantize_fp8_blocks`, over simulated ranks (harness.py).

- the `_details.py` helpers alone: every slot's fp8 bytes and scales are `reference.quantize_fp8_blocks`'s
  bytes, and every e4m3 code decodes as torch decodes it;
- the round trip dispatch -> toy expert -> combine: every received slot holds the quantised expert output
  row, bitwise, and the combined tokens are `reference.combine_fp8`'s, bitwise in the interpreter (on a
  GPU an FMA may move the fp32 sum, as for the plain combine: test_combine.py's tolerance).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_a2a import reference
from moe_a2a.config import COMBINE_FP8_BLOCK, A2AConfig, round_up
from moe_a2a.triton_kernels import _details as d
from moe_a2a.triton_kernels.combine import reduce_combined_tokens

from ..conftest import TEST_DEVICE, examples
from .harness import FP8, Case, SimWorld, cases
from .test_combine import ATOL, RTOL, _reduce_args, run_dispatch_expert_combine, toy_expert


# ---- sizes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("H", [1, 5, 16, 127, 128, 129, 200, 7168])
def test_fp8_slot_is_the_reference_row_size(H: int) -> None:
    cfg = A2AConfig(hidden_dim=H, combine_fp8=True)
    assert COMBINE_FP8_BLOCK == reference.FP8_BLOCK
    assert cfg.combine_stride_bytes == reference.row_bytes(cfg, reference.Wire(combine_fp8=True))["combine"]
    assert cfg.combine_scale_offset_bytes == round_up(H, 16) and cfg.combine_stride_bytes % 16 == 0
    assert cfg.y_bytes == 2 * H  # expert_y stays bf16


# ---- the _details.py helpers ----------------------------------------------------------------------
@triton.jit
def _roundtrip_kernel(src_ptr, slots_ptr, out_ptr, R, stride_src, H: tl.constexpr, SC_BYTES: tl.constexpr,
                      SCALE_OFFSET_BYTES: tl.constexpr, BLOCK_R: tl.constexpr, G: tl.constexpr,
                      BLOCK_H: tl.constexpr, VIA_BITS: tl.constexpr):
    """One program: quantise R rows into slots SC_BYTES apart, then load them back dequantised."""
    rows = tl.arange(0, BLOCK_R).to(tl.int64)
    is_row = rows < R
    d.fp8_quantize_rows(src_ptr, rows * stride_src, slots_ptr, rows * SC_BYTES, is_row, H, SCALE_OFFSET_BYTES,
                        BLOCK_R, G, 128, VIA_BITS)
    for c0 in range(0, H, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        mask = is_row[:, None] & (cols < H)[None, :]
        y = d.fp8_load_dequantized(slots_ptr, rows * SC_BYTES, c0, is_row, H, BLOCK_H, SCALE_OFFSET_BYTES, 128,
                                   VIA_BITS)
        tl.store(out_ptr + rows[:, None] * H + cols[None, :], y, mask=mask)


def _rows(H: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows that reach every branch of the encoding: normal and subnormal fp8 codes (a block whose amax is
    far above its other elements), exact ties, an all-zero block, a block too small for a normal scale
    (scale 1), large values, both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, H, generator=g) * torch.exp2(torch.randint(-12, 8, (6, H), generator=g).float())
    x[1] = torch.randn(H, generator=g) * 1e-3
    x[1, ::97] = 300.0                                   # amax far above the rest: subnormal codes
    x[2] = 0.0
    x[3] = torch.randn(H, generator=g) * 1e-39 if dtype == torch.float32 else 0.0  # scale 1 (fp32 only)
    x[4] = torch.arange(H) % 17 - 8.0                    # small integers: exact, some ties after scaling
    x[5, : min(H, 128)] = -448.0
    return x.to(dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("H", [1, 40, 128, 200, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_helpers_quantise_as_the_reference(H: int, dtype: torch.dtype) -> None:
    cfg = A2AConfig(hidden_dim=H, out_dtype=dtype, combine_fp8=True)
    x = _rows(H, dtype, H)
    R, sc = x.shape[0], cfg.combine_stride_bytes
    slots = torch.full((R * sc,), 0xA5, dtype=torch.uint8, device=TEST_DEVICE)
    out = torch.empty(R, H, dtype=torch.float32, device=TEST_DEVICE)
    block_h = min(triton.next_power_of_2(H), 256)
    G = 2 if H > 128 else 1
    _roundtrip_kernel[(1,)](x.to(TEST_DEVICE), slots, out, R, x.stride(0), H=H, SC_BYTES=sc,
                            SCALE_OFFSET_BYTES=cfg.combine_scale_offset_bytes, BLOCK_R=8, G=G, BLOCK_H=block_h,
                            VIA_BITS=TEST_DEVICE != "cuda")
    q, scale = reference.quantize_fp8_blocks(x)
    got = slots.cpu().view(R, sc)
    assert torch.equal(got[:, :H], q.view(torch.uint8)), "fp8 bytes"
    off = cfg.combine_scale_offset_bytes
    assert torch.equal(got[:, off: off + 4 * scale.shape[1]].contiguous().view(torch.float32), scale), "scales"
    assert torch.equal(out.cpu(), reference.dequantize_fp8_blocks(q, scale)), "dequantised"


@triton.jit
def _decode_kernel(codes_ptr, out_ptr, VIA_BITS: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, d.fp8_e4m3_load(codes_ptr, i, i < 256, VIA_BITS))


@pytest.mark.timeout(60)
def test_every_e4m3_code_decodes_as_torch() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32, device=TEST_DEVICE)
    _decode_kernel[(1,)](codes.to(TEST_DEVICE), out, VIA_BITS=TEST_DEVICE != "cuda")
    want = codes.view(torch.float8_e4m3fn).float()
    got = out.cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.where(want.isnan(), 0.0, got).view(torch.int32),
                       torch.where(want.isnan(), 0.0, want).view(torch.int32))  # -0.0 stays -0.0


# ---- the round trip over simulated ranks ------------------------------------------------------------
def fp8_expert(case: Case, rank: int, counts, expert_x, expert_x_scale) -> torch.Tensor:
    """test_combine's toy expert, each element scaled by a power of two in [2**-10, 2**2] (deterministic per
    rank): rows with a wide spread inside a block, so the quantisation uses subnormal codes too."""
    y = toy_expert(case, rank, counts, expert_x, expert_x_scale)
    g = torch.Generator().manual_seed(case.seed * 31 + rank)
    return (y.float() * torch.exp2(torch.randint(-10, 3, y.shape, generator=g).float())).to(y.dtype)


def check_combine_fp8(case: Case, accumulate: bool, device: str = TEST_DEVICE) -> None:
    cfg, W = dataclasses.replace(case.cfg, combine_fp8=True), case.world_size
    world = SimWorld.create(cfg, W, case.node_size, device)
    lay = world.layout
    run = run_dispatch_expert_combine(case, world, fp8_expert, accumulate, device)
    bound_ms, dispatched, expert_ys, weights, old, got, live, R_used = run
    # Every live route's slot in its home's recv buffer holds the quantised row of its expert output.
    rows = reference.expert_rows(cfg, live)
    arena = world.arena.cpu()
    H, sc, off = cfg.hidden_dim, cfg.combine_stride_bytes, cfg.combine_scale_offset_bytes
    L = lay.num_local_experts
    for s in range(W):
        slot = dispatched.route_slot[s].cpu().to(torch.int64)
        t, k = torch.nonzero(live[s] >= 0, as_tuple=True)
        if not len(t):
            continue
        e = live[s][t, k].to(torch.int64)
        y = torch.stack([expert_ys[int(r)][int(i)] for r, i in zip(e // L, rows[s][t, k])])
        q, scale = reference.quantize_fp8_blocks(y)
        start = world.recv_bytes[s] + lay.combine_recv_offset_bytes + slot[t, k] * sc
        have = arena[start[:, None] + torch.arange(off + 4 * scale.shape[1])]
        assert torch.equal(have[:, :H], q.view(torch.uint8)), f"home {s}: fp8 bytes"
        assert torch.equal(have[:, off:].contiguous().view(torch.float32), scale), f"home {s}: scales"

    want = reference.combine_fp8(cfg, live, [torch.nan_to_num(w, nan=0.0) for w in weights],
                                 [expert_ys[r][:R_used[r]] for r in range(W)], old if accumulate else None)
    for r in range(W):
        T = case.num_tokens[r]
        n_live = T if bound_ms[r] is None else min(bound_ms[r], T)
        if device == "cpu":  # the interpreter rounds each operation as the reference does
            assert torch.equal(got[r][:n_live].view(torch.uint8), want[r][:n_live].view(torch.uint8)), f"rank {r}"
        else:
            torch.testing.assert_close(got[r][:n_live].float(), want[r][:n_live].float(),
                                       rtol=RTOL[cfg.out_dtype], atol=ATOL, msg=f"rank {r}")
        if accumulate:
            assert torch.equal(got[r][n_live:].view(torch.uint8), old[r][n_live:].view(torch.uint8)), r
        else:
            assert bool((got[r][n_live:].view(torch.uint8) == 0xA5).all()), r


@pytest.mark.timeout(150)
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), accumulate=st.booleans())
def test_fp8_combine_matches_reference(case: Case, accumulate: bool) -> None:
    check_combine_fp8(case, accumulate)


EDGE_CASES = [
    # Every route to one expert of rank 3; 2 nodes: 3 sources stage remotely, 3 push same-node.
    pytest.param(Case(world_size=6, node_size=3, num_local_experts=1, experts_per_token=4, max_num_tokens=3,
                      num_tokens=(3,) * 6, bound_m=(None,) * 6, hidden_dim=136, in_dtype=FP8, scale_block=16,
                      max_private_tokens=1, routing="one_expert"), False, id="W6-N3-FP8-ONE_EXPERT-H136"),
    # W=8, all remote, -1 routes + duplicates, bound_m < T, fp16 out, accumulate, H < one scale block.
    pytest.param(Case(world_size=8, node_size=1, num_local_experts=2, experts_per_token=5, max_num_tokens=4,
                      num_tokens=(4, 3, 0, 4, 4, 1, 4, 2), bound_m=(3, None, None, 0, 4, None, 2, None),
                      hidden_dim=24, in_dtype=torch.bfloat16, out_dtype=torch.float16, expert_padding=16,
                      routing="duplicates", mask_percent=30, index_dtype=torch.int32), True,
                 id="W8-N1-BF16-FP16OUT-DUP-MASKED-BOUND-ACC"),
    # fp32 expert outputs, 3 ranks on one node, a fixed expert capacity.
    pytest.param(Case(world_size=3, node_size=3, num_local_experts=2, experts_per_token=3, max_num_tokens=5,
                      num_tokens=(5, 2, 5), bound_m=(None, 1, None), hidden_dim=300, out_dtype=torch.float32,
                      expert_capacity=45, mask_percent=30), True, id="W3-N3-FP32OUT-CAPACITY-ACC"),
    # T=0 everywhere: reduce launches nothing, pack moves nothing.
    pytest.param(Case(world_size=2, node_size=2, num_tokens=(0, 0), bound_m=(None, None)), True, id="W2-T0"),
    # Decode-shaped row: H=7168, bf16 out (56 scale blocks; 7 reduce chunks of 1024).
    pytest.param(Case(world_size=2, node_size=1, num_local_experts=4, experts_per_token=8, max_num_tokens=2,
                      num_tokens=(2, 2), bound_m=(None, None), hidden_dim=7168, in_dtype=FP8, scale_block=128,
                      routing="topk"), False, id="W2-H7168-FP8-BF16OUT"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, accumulate", EDGE_CASES)
def test_fp8_combine_edge_cases(case: Case, accumulate: bool) -> None:
    check_combine_fp8(case, accumulate)


@pytest.mark.gpu(reason="the edge cases with compiled kernels (the native fp8 conversions)")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, accumulate", EDGE_CASES)
def test_fp8_combine_edge_cases_gpu(case: Case, accumulate: bool) -> None:
    check_combine_fp8(case, accumulate, "cuda")


# ---- validation -------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_fp8_reduce_needs_word_aligned_rows() -> None:
    """bf16 rows need 2-byte alignment; fp8 rows carry fp32 scales, so 4."""
    case = Case()
    args = _reduce_args(case)
    args["cfg"] = dataclasses.replace(case.cfg, combine_fp8=True)
    args["recv_offset_bytes"] += 2
    with pytest.raises(ValueError, match="recv_offset_bytes"):
        reduce_combined_tokens(**args)
