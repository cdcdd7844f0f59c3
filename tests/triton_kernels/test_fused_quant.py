"""Dispatch pack with the fused fp8 quantisation against `quantize_fp8` + the plain pack, bitwise.

The plain path is what the DeepEP facade did before the fusion: quantise x into a staging row of the
payload's bytes (fp8 at [0, H), scales from `scale_offset_bytes`), then pack the staging rows as if they
were rows of in_dtype. The fused pack must write the same bytes into every slot (payload, scales, the
config's own scale column) and nothing else: the rest of a slot's payload bytes, and every slot no live
route names, keep the arena's poison. Runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from moe_a2a.config import A2AConfig, round_up
from moe_a2a.triton_kernels.dispatch import pack_tokens_by_expert
from moe_a2a.triton_kernels.quant import Fp8Quantize, check_fused_quantize, quantize_fp8

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


def _pack_both(c: FusedCase):
    """(arena of the plain path, arena of the fused path, cfg, slot, the two buffer offsets)."""
    cfg, q = c.cfg, c.quantize
    x, idx, ids = _inputs(c)
    _, slot = route_slots(idx, cfg.num_experts, c.bound_m)
    # Staging rows of the payload's bytes, zeroed, as the facade's were.
    stage = torch.zeros(c.T, cfg.x_bytes, dtype=torch.uint8, device=DEVICE)
    S = q.num_scales(c.H)
    off = q.scale_offset_bytes
    scale = stage[:, off:off + 4 * -(-S // 4)].view(torch.int32) if q.ue8m0 else stage[:, off:off + 4 * S].view(torch.float32)
    quantize_fp8(x.to(DEVICE), q.block, out=stage[:, :c.H].view(torch.float8_e4m3fn), out_scale=scale,
                 round_scale=q.round_scale, ue8m0=q.ue8m0)
    stage_rows = stage.view(c.dtype)

    arenas = []
    for fused in (False, True):
        world = SimWorld.create(cfg, world_size=1, node_size=1, device=DEVICE)  # POISON everywhere
        send = world.send_bytes[0]
        extra = {}
        if c.split:  # the recv buffer after the send buffer serves as the remote rows' staging buffer
            assert world.layout.recv_bytes >= cfg.max_routes * cfg.dispatch_stride_bytes
            n = int((slot >= 0).sum())
            extra = dict(remote_send_offset_bytes=world.recv_bytes[0],
                         node_slots=torch.tensor([n // 3, n - n // 3], dtype=torch.int32, device=DEVICE))
        rows = x if fused else stage_rows
        pack_tokens_by_expert(rows.to(DEVICE), ids.to(DEVICE), slot.to(DEVICE), world.arena, send, cfg,
                              bound_m=bound_tensor(c.bound_m, DEVICE), quantize=q if fused else None, **extra)
        arenas.append(world.arena.cpu())
    return arenas[0], arenas[1], cfg, slot, world


def check_fused(c: FusedCase) -> None:
    plain, fused, cfg, slot, world = _pack_both(c)
    q = c.quantize
    # Which bytes of a slot's payload the fused pack writes: the fp8 bytes and the scales.
    written = torch.zeros(cfg.dispatch_stride_bytes, dtype=torch.bool)
    written[:c.H] = True
    written[q.scale_offset_bytes:q.row_bytes(c.H)] = True
    written[cfg.x_bytes:] = True  # the config's scale column and the row's tail: as the plain pack
    want = plain.clone()
    sd = cfg.dispatch_stride_bytes
    n = int((slot >= 0).sum())  # slots 0..n-1, each in the send buffer or (split) the remote one
    starts = [world.send_bytes[0]] + ([world.recv_bytes[0]] if c.split else [])
    for base in starts:
        for j in range(n):
            row = want[base + j * sd: base + (j + 1) * sd]
            row[~written] = POISON
    diff = fused != want
    assert not bool(diff.any()), (f"{int(diff.sum())} bytes differ, first at arena byte "
                                  f"{int(torch.nonzero(diff)[0])}")
    assert n == 0 or not torch.equal(plain, torch.full_like(plain, POISON))  # something was packed


@pytest.mark.timeout(120)
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fused_cases())
def test_fused_pack_writes_the_bytes_of_quantize_fp8_then_pack(case: FusedCase) -> None:
    check_fused(case)


def check_compact_rows(c: FusedCase) -> None:
    """A config whose rows carry just the quantised bytes (`A2AConfig.payload_bytes`) gets, in every
    slot at its narrower stride, the same fp8 bytes, scales and scale column as the whole-row config."""
    q = c.quantize
    cfg_c = replace(c.cfg, payload_bytes=q.row_bytes(c.H))
    _, wide, cfg, slot, world = _pack_both(replace(c, split=False))
    x, idx, ids = _inputs(c)
    narrow_world = SimWorld.create(cfg_c, world_size=1, node_size=1, device=DEVICE)
    pack_tokens_by_expert(x.to(DEVICE), ids.to(DEVICE), slot.to(DEVICE), narrow_world.arena,
                          narrow_world.send_bytes[0], cfg_c, bound_m=bound_tensor(c.bound_m, DEVICE), quantize=q)
    narrow = narrow_world.arena.cpu()
    assert cfg_c.dispatch_stride_bytes <= cfg.dispatch_stride_bytes
    used = q.row_bytes(c.H)
    for j in range(int((slot >= 0).sum())):
        w0 = world.send_bytes[0] + j * cfg.dispatch_stride_bytes
        n0 = narrow_world.send_bytes[0] + j * cfg_c.dispatch_stride_bytes
        got, want = narrow[n0:n0 + cfg_c.dispatch_stride_bytes], wide[w0:w0 + cfg.dispatch_stride_bytes]
        assert torch.equal(got[:c.H], want[:c.H]), j                                  # fp8 bytes
        assert torch.equal(got[q.scale_offset_bytes:used], want[q.scale_offset_bytes:used]), j  # scales
        s0 = cfg_c.dispatch_scale_offset_bytes
        assert torch.equal(got[s0:s0 + 4], want[cfg.dispatch_scale_offset_bytes:][:4]), j  # the token index


@pytest.mark.timeout(120)
@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fused_cases())
def test_fused_pack_into_rows_of_only_the_quantised_bytes_sends_the_same_bytes(case: FusedCase) -> None:
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
