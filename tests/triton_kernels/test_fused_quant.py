"""Dispatch pack with the fused fp8 quantisation against the documented formula, written here in plain torch.

The formula (moe_a2a/triton_kernels/quant.py, module docstring), per token and per block of `block`
elements: scale = amax / 448 (correctly rounded fp32), 1 where that is below 2**-126; with round_scale,
2 ** ceil(log2(scale)); fp8 = e4m3fn(clamp(x / scale, -448, 448)) with round-to-nearest-even; UE8M0 codes
= the power-of-two scale's biased exponent, one byte per block, padding bytes of the last int32 zero.
`torch_fp8_blocks` computes it with no code of the package (frexp / ldexp for the power of two, torch's
own fp8 cast for the rounding, itself checked on known ties below). The expected arena is then built
byte by byte: every live route's slot gets its token's fp8 bytes at [0, H), its scales from
`scale_offset_bytes` and the config's own scale column (the facade's token index); every other byte of
the arena keeps its poison. The fused pack must write exactly that arena, bitwise.
Runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from moe_a2a.config import A2AConfig, round_up
from moe_a2a.triton_kernels.dispatch import pack_tokens_by_expert
from moe_a2a.triton_kernels.quant import Fp8Quantize, check_fused_quantize

from ..conftest import TEST_DEVICE, examples
from .harness import POISON, SimWorld, bound_tensor, route_slots

DEVICE = torch.device(TEST_DEVICE)


@dataclass(frozen=True)
class FusedCase:
    T: int
    H: int
    K: int = 3
    E: int = 8
    dtype: torch.dtype = torch.bfloat16
    block: int = 128
    round_scale: bool = False
    ue8m0: bool = False
    extra_offset: int = 0        # scales this many 4-byte words after round_up(H, 4)
    mask_percent: int = 25       # routes set to -1
    bound_m: int | None = None
    split: bool = False          # only remote rows staged: a second buffer for the slots outside node_slots
    seed: int = 0

    @property
    def cfg(self) -> A2AConfig:
        # As the DeepEP facade: rows of H in_dtype elements plus one 4-byte column (the token index).
        return A2AConfig(max_num_tokens=max(self.T, 1), num_experts=self.E, experts_per_token=self.K,
                         hidden_dim=self.H, in_dtype=self.dtype, scale_block=self.H)

    @property
    def quantize(self) -> Fp8Quantize:
        return Fp8Quantize(scale_offset_bytes=round_up(self.H, 4) + 4 * self.extra_offset, block=self.block,
                           round_scale=self.round_scale, ue8m0=self.ue8m0)


def _fits(c: FusedCase) -> bool:
    q = c.quantize
    return q.row_bytes(c.H) <= c.H * c.dtype.itemsize


@st.composite
def fused_cases(draw) -> FusedCase:
    ue8m0 = draw(st.booleans())
    H = draw(st.one_of(
        st.integers(1, 6).map(lambda m: 128 * m),        # whole groups; 128, 256, 384, 640, 768: S % 4 != 0
        st.integers(2, 200).map(lambda h: 2 * h),        # a partial last group (masked tile columns)
    ))
    T = draw(st.integers(0, 6))
    case = FusedCase(
        T=T, H=H, K=draw(st.integers(1, 4)), E=draw(st.sampled_from([4, 8])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16, torch.float32])),
        block=draw(st.sampled_from([128, 128, 32])),       # 32: several groups per tile row chunk
        round_scale=ue8m0 or draw(st.booleans()), ue8m0=ue8m0,
        extra_offset=draw(st.sampled_from([0, 0, 1, 3])),
        mask_percent=draw(st.sampled_from([0, 25, 60])),
        bound_m=draw(st.one_of(st.none(), st.integers(0, T))),
        split=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))
    if not _fits(case):  # scales past the row's payload bytes: the small-H fp32-scale corner
        case = replace(case, extra_offset=0, block=128)
    return case


def _inputs(c: FusedCase):
    g = torch.Generator().manual_seed(c.seed)
    # Magnitudes over many binades (subnormal fp8 codes included), one all-zero token (scale 1).
    magnitude = torch.exp2(torch.empty(c.T, c.H).uniform_(-14, 6, generator=g))
    x = (torch.randn(c.T, c.H, generator=g).sign() * magnitude).to(c.dtype)
    if c.T > 1:
        x[1] = 0
    idx = torch.randint(0, c.E, (c.T, c.K), generator=g)
    idx[torch.rand(c.T, c.K, generator=g) * 100 < c.mask_percent] = -1
    ids = torch.arange(c.T, dtype=torch.int32).view(torch.float32).view(-1, 1)  # the facade's token-index column
    return x, idx, ids


def torch_fp8_blocks(x: torch.Tensor, block: int, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula in plain torch: (fp8 e4m3fn codes uint8 [T, H], scales float32 [T, ceil(H / block)])."""
    T, H = x.shape
    S = -(-H // block)
    blocks = torch.zeros(T, S * block, dtype=torch.float32)
    blocks[:, :H] = x.float()                                      # exact: bf16/fp16/fp32 -> fp32
    blocks = blocks.view(T, S, block)
    scale = blocks.abs().amax(-1) / 448.0                         # the zero padding never raises amax
    scale = torch.where(scale < 2.0 ** -126, torch.ones_like(scale), scale)
    if round_scale:  # scale = m * 2**e, m in [0.5, 1): a power of two when m == 0.5, else 2**e rounds it up
        m, e = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(m == 0.5, e - 1, e))
    q = (blocks / scale[..., None]).clamp(-448.0, 448.0).view(T, S * block)[:, :H]
    return q.to(torch.float8_e4m3fn).view(torch.uint8), scale


def test_torch_fp8_cast_rounds_to_nearest_even() -> None:
    """The oracle's one borrowed step: torch's e4m3fn cast rounds ties to even, subnormals included."""
    ties = torch.tensor([1.0625, 1.1875, 3 * 2.0 ** -10, 2.0 ** -10, 5 * 2.0 ** -10, 432.0, -1.0625])
    want = torch.tensor([1.0, 1.25, 2 * 2.0 ** -9, 0.0, 2 * 2.0 ** -9, 448.0, -1.0])
    assert torch.equal(ties.to(torch.float8_e4m3fn).float(), want)
    assert torch.tensor([2.0 ** -9, 448.0]).to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x01, 0x7E]


def expected_arena(c: FusedCase, cfg: A2AConfig, world: SimWorld, slot: torch.Tensor, node_slots=None) -> torch.Tensor:
    """The arena a fused pack of `c` into `world` must leave: poison but for each live route's slot."""
    q = c.quantize
    x, _, ids = _inputs(c)
    fp8, scale = torch_fp8_blocks(x, q.block, q.round_scale)
    S = q.num_scales(c.H)
    if q.ue8m0:  # scale = 2 ** (code - 127): frexp's exponent is log2(scale) + 1; padding bytes zero
        codes = torch.zeros(c.T, 4 * -(-S // 4), dtype=torch.uint8)
        codes[:, :S] = (torch.frexp(scale)[1] - 1 + 127).to(torch.uint8)
        scale_bytes = codes
    else:
        scale_bytes = scale.contiguous().view(torch.uint8)
    col = ids.contiguous().view(torch.uint8)                     # the config's scale column: 4 bytes a token
    want = torch.full_like(world.arena.cpu(), POISON)
    sd, off, col_at = cfg.dispatch_stride_bytes, q.scale_offset_bytes, cfg.dispatch_scale_offset_bytes
    for t, k in torch.nonzero(slot >= 0).tolist():
        j = int(slot[t, k])
        remote = node_slots is not None and not (node_slots[0] <= j < node_slots[1])
        row = (world.recv_bytes[0] if remote else world.send_bytes[0]) + j * sd
        want[row: row + c.H] = fp8[t]
        want[row + off: row + off + scale_bytes.shape[1]] = scale_bytes[t]
        want[row + col_at: row + col_at + 4] = col[t]
    return want


def _pack_fused(c: FusedCase, cfg: A2AConfig | None = None):
    """(arena after the fused pack, the arena it must be, the number of live routes)."""
    cfg = cfg or c.cfg
    x, idx, ids = _inputs(c)
    _, slot = route_slots(idx, cfg.num_experts, c.bound_m)          # the routing's plain-torch statement
    world = SimWorld.create(cfg, world_size=1, node_size=1, device=DEVICE)  # POISON everywhere
    extra, node_slots = {}, None
    n = int((slot >= 0).sum())
    if c.split:  # remote rows' staging: a region after the buffers, named as the recv buffer (one node's has no
        # remote regions: Layout.has_remote_peers)
        stage = world.arena.numel()
        arena = torch.full((stage + cfg.max_routes * cfg.dispatch_stride_bytes,), POISON, dtype=torch.uint8,
                           device=DEVICE)
        arena[:stage] = world.arena
        world = replace(world, arena=arena, recv_bytes=[stage])
        node_slots = [n // 3, n - n // 3]
        extra = dict(remote_send_offset_bytes=world.recv_bytes[0],
                     node_slots=torch.tensor(node_slots, dtype=torch.int32, device=DEVICE))
    pack_tokens_by_expert(x.to(DEVICE), ids.to(DEVICE), slot.to(DEVICE), world.arena, world.send_bytes[0], cfg,
                          bound_m=bound_tensor(c.bound_m, DEVICE), quantize=c.quantize, **extra)
    return world.arena.cpu(), expected_arena(c, cfg, world, slot, node_slots), n


def assert_same_arena(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = got != want
    assert not bool(diff.any()), (f"{int(diff.sum())} bytes differ, first at arena byte "
                                  f"{int(torch.nonzero(diff)[0])}")


def check_fused(c: FusedCase) -> None:
    got, want, n = _pack_fused(c)
    assert_same_arena(got, want)
    assert n == 0 or not torch.equal(want, torch.full_like(want, POISON))  # something was packed


@pytest.mark.timeout(120)
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fused_cases())
def test_fused_pack_writes_the_formula_s_bytes_and_nothing_else(case: FusedCase) -> None:
    check_fused(case)


def check_compact_rows(c: FusedCase) -> None:
    """A config whose rows carry just the quantised bytes (`A2AConfig.payload_bytes`) gets the same
    bytes in every slot, at its narrower stride."""
    cfg_c = replace(c.cfg, payload_bytes=c.quantize.row_bytes(c.H))
    assert cfg_c.dispatch_stride_bytes <= c.cfg.dispatch_stride_bytes
    got, want, _ = _pack_fused(replace(c, split=False), cfg_c)
    assert_same_arena(got, want)


@pytest.mark.timeout(120)
@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fused_cases())
def test_fused_pack_into_rows_of_only_the_quantised_bytes_writes_the_formula_s_bytes(case: FusedCase) -> None:
    check_compact_rows(case)


EDGE_CASES = [
    # DeepSeek decode row: H=7168 bf16, 56 groups (UE8M0: 14 int32, no padding), 7 chunks of 1024 elements.
    pytest.param(FusedCase(T=3, H=7168, K=8, E=16, round_scale=True, ue8m0=True, mask_percent=20),
                 id="H7168-UE8M0"),
    pytest.param(FusedCase(T=2, H=7168, K=4, E=8, mask_percent=0), id="H7168-FP32"),
    # H=7040: 55 groups (UE8M0 padding bytes), the last chunk of 896 elements: groups past S masked.
    pytest.param(FusedCase(T=2, H=7040, K=3, ue8m0=True, round_scale=True, bound_m=1, split=True),
                 id="H7040-UE8M0-PAD-BOUND-SPLIT"),
    # Every route masked: nothing written.
    pytest.param(FusedCase(T=4, H=256, mask_percent=100), id="ALL-MASKED"),
    # fp32 rows, scales well after the payload.
    pytest.param(FusedCase(T=5, H=384, dtype=torch.float32, extra_offset=40, round_scale=True), id="FP32-OFFSET"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", EDGE_CASES)
def test_fused_pack_edge_cases(case: FusedCase) -> None:
    check_fused(case)


# ---- validation: a ValueError naming the argument ---------------------------------------------
CFG = FusedCase(T=4, H=256).cfg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value, match", [
    ("fp8", "quantize: expected None, a quant.Fp8Quantize"),
    ({"block": 128}, "scale_offset_bytes required"),                            # a dict without the offset
    ({"scale_offset_bytes": 256, "scales": 1}, "keys"),                         # an unknown field
    (Fp8Quantize(scale_offset_bytes=256, block=96), "quantize.block"),          # not a power of two
    (Fp8Quantize(scale_offset_bytes=256, block=8192), "quantize.block"),        # past the tile's limit
    (Fp8Quantize(scale_offset_bytes=256, ue8m0=1), "quantize.ue8m0"),
    (Fp8Quantize(scale_offset_bytes=258), "quantize.scale_offset_bytes"),       # not a multiple of 4
    (Fp8Quantize(scale_offset_bytes=252), "quantize.scale_offset_bytes"),       # overlaps the fp8 payload
    (Fp8Quantize(scale_offset_bytes=508), "quantize: expected fp8 payload and scales within"),  # past 2H
])
def test_fused_quantize_rejects_bad_options(value, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_fused_quantize("quantize", value, CFG)


@pytest.mark.timeout(60)
def test_fused_quantize_options() -> None:
    # A dict is taken; ue8m0 implies round_scale, as in quantize_fp8.
    got = check_fused_quantize("quantize", {"scale_offset_bytes": 256, "ue8m0": True}, CFG)
    assert got == Fp8Quantize(scale_offset_bytes=256, round_scale=True, ue8m0=True)
    assert check_fused_quantize("quantize", None, CFG) is None
    # An fp8 config has no tokens to quantise.
    fp8 = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=3, hidden_dim=256,
                    in_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="in_dtype"):
        check_fused_quantize("quantize", Fp8Quantize(scale_offset_bytes=256), fp8)
    # The launcher checks it before anything is written.
    c = FusedCase(T=4, H=256)
    x, idx, ids = _inputs(c)
    _, slot = route_slots(idx, c.E)
    world = SimWorld.create(c.cfg, world_size=1, node_size=1, device=DEVICE)
    with pytest.raises(ValueError, match="quantize.scale_offset_bytes"):
        pack_tokens_by_expert(x.to(DEVICE), ids.to(DEVICE), slot.to(DEVICE), world.arena, world.send_bytes[0], c.cfg,
                              quantize={"scale_offset_bytes": 2})
    assert bool((world.arena == POISON).all())
