"""quantize_fp8 against the same formula in torch, bitwise on the fp8 bytes and the scales.

Inputs are built on the CPU (seeded generators), moved to TEST_DEVICE for the kernel (tests/conftest.py:
the interpreter on CPU in CI, compiled kernels on cuda), and the results come back to the CPU, where the
reference formula runs."""
from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe_a2a.triton_kernels.quant import dequantize_fp8, quantize_fp8, ue8m0_to_float

from ..conftest import TEST_DEVICE, examples

DEVICE = torch.device(TEST_DEVICE)


def quantize_on_device(x: torch.Tensor, block: int = 128, **kwargs):
    """quantize_fp8 of the CPU tensor `x` run on TEST_DEVICE; (x_fp8, scale) back on the CPU."""
    q, scale = quantize_fp8(x.to(DEVICE), block, **kwargs)
    return q.cpu(), scale.cpu()


def torch_quantize(x: torch.Tensor, block: int, round_scale: bool = False):
    """The documented formula: scale = amax/448 (1 below the smallest normal fp32), RNE cast of the
    clamped quotient. torch's fp32 division is correctly rounded, like tl.div_rn. `round_scale`:
    DeepEP's `2 ** ceil(log2(scale))`, in float64 (exact for fp32 inputs)."""
    T, H = x.shape
    S = -(-H // block)
    padded = torch.nn.functional.pad(x.float(), (0, S * block - H)).reshape(T, S, block)
    scale = padded.abs().amax(-1) / 448.0
    scale = torch.where(scale >= 2.0**-126, scale, torch.ones_like(scale))
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale.double()))).float()
    q = (padded / scale[..., None]).clamp(-448.0, 448.0).reshape(T, S * block)[:, :H]
    return q.to(torch.float8_e4m3fn), scale


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor):
    diff = got.view(torch.uint8) != want.view(torch.uint8)
    assert not bool(diff.any()), f"{int(diff.sum())} bytes differ, first at {torch.nonzero(diff)[0].tolist()}"


@pytest.mark.timeout(120)
@settings(deadline=None, max_examples=examples(25))
@given(
    T=st.integers(0, 6),
    H=st.integers(1, 300),
    block=st.sampled_from([1, 7, 32, 128]),       # 7: not a power of two (masked tile columns)
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    log_range=st.sampled_from([(-3, 3), (-12, -6), (2, 4)]),  # small values exercise subnormal codes
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_torch_formula(T, H, block, dtype, log_range, seed):
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.empty(T, H).uniform_(*log_range, generator=gen))
    x = (torch.randn(T, H, generator=gen).sign() * magnitude).to(dtype)
    q, scale = quantize_on_device(x, block)
    want_q, want_scale = torch_quantize(x, block)
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (T, -(-H // block))
    assert_same_bytes(q, want_q)
    assert torch.equal(scale, want_scale)
    # Round trip: e4m3 keeps 3 mantissa bits (relative error <= 2**-4 for normals) and subnormal
    # steps of 2**-9 * scale (absolute error <= 2**-10 * scale).
    back = dequantize_fp8(q, scale, block)
    full_scale = scale.repeat_interleave(block, dim=1)[:, :H]
    err = (back - x.float()).abs()
    bound = torch.maximum(x.float().abs() * 2.0**-4, full_scale * 2.0**-10) * (1 + 1e-6)
    assert bool((err <= bound).all())


def torch_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """DeepEP's packed UE8M0 layout of power-of-two scales `[T, S]`: the byte of block j is
    `log2(scale) + 127`, at byte j of the row in memory (int32 column j // 4, byte j % 4, little-endian);
    padding bytes 0. Returns int32 `[T, ceil(S / 4)]`."""
    T, S = scale.shape
    codes = torch.zeros(T, 4 * -(-S // 4), dtype=torch.uint8)
    codes[:, :S] = (torch.log2(scale.double()).round().to(torch.int64) + 127).to(torch.uint8)
    return codes.view(torch.int32)


def deep_ep_cast_back_scales(codes: torch.Tensor) -> torch.Tensor:
    """How DeepEP's own test reads UE8M0 scales: each byte shifted into an fp32 exponent field."""
    return (codes.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


@pytest.mark.timeout(120)
@settings(deadline=None, max_examples=examples(20))
@given(
    T=st.integers(0, 5),
    H=st.integers(1, 700),
    block=st.sampled_from([7, 32, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    log_range=st.sampled_from([(-3, 3), (-30, -20), (2, 12)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_scale_and_ue8m0_match_torch_formula(T, H, block, dtype, log_range, seed):
    """Powers-of-two scales (round_scale) and their UE8M0 codes (ue8m0) against DeepEP's formula in
    torch: the same fp8 bytes from both, the codes packed in DeepEP's layout, dequantised within fp8
    tolerance."""
    assert sys.byteorder == "little"  # the layout is bytes in memory order; the int32 view assumes it
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.empty(T, H).uniform_(*log_range, generator=gen))
    x = (torch.randn(T, H, generator=gen).sign() * magnitude).to(dtype)
    if T and H > 1:
        x[0, 0] = 0.0
        x[:, -1] = 448.0 * 2.0 ** -5  # an exact power of two times 448: its block's scale stays 2**-5
    want_q, want_scale = torch_quantize(x, block, round_scale=True)
    q, scale = quantize_on_device(x, block, round_scale=True)
    assert_same_bytes(q, want_q)
    assert torch.equal(scale, want_scale)
    q8, codes = quantize_on_device(x, block, ue8m0=True)
    S = -(-H // block)
    assert codes.dtype == torch.int32 and tuple(codes.shape) == (T, -(-S // 4))
    assert_same_bytes(q8, want_q)
    assert torch.equal(codes, torch_ue8m0(want_scale))
    assert torch.equal(ue8m0_to_float(codes, S), want_scale)
    assert torch.equal(deep_ep_cast_back_scales(codes)[:, :S], want_scale)
    back = dequantize_fp8(q8, codes, block)
    full_scale = want_scale.repeat_interleave(block, dim=1)[:, :H]
    err = (back - x.float()).abs()
    bound = torch.maximum(x.float().abs() * 2.0**-4, full_scale * 2.0**-10) * (1 + 1e-6)
    assert bool((err <= bound).all())


@pytest.mark.timeout(60)
def test_ue8m0_into_caller_rows_with_bound_m():
    """UE8M0 codes written into a strided caller tensor (rows of a wider byte buffer, as the DeepEP
    facade stages them): the padding bytes zeroed, rows >= bound_m untouched; bad shapes refused."""
    T, H, block = 5, 640, 128                      # 5 blocks: two int32 per row, 3 padding bytes
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    rows = torch.full((T, 2 * H), 0xEE, dtype=torch.uint8, device=DEVICE)
    out = rows[:, :H].view(torch.float8_e4m3fn)
    codes = rows[:, H:H + 8].view(torch.int32)
    bound_m = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    quantize_fp8(x.to(DEVICE), block, out=out, out_scale=codes, bound_m=bound_m, ue8m0=True)
    rows = rows.cpu()
    want_q, want_scale = torch_quantize(x[:3], block, round_scale=True)
    assert_same_bytes(rows[:3, :H].view(torch.float8_e4m3fn), want_q)
    assert torch.equal(rows[:3, H:H + 8], torch_ue8m0(want_scale).view(torch.uint8))  # padding: 0
    assert bool((rows[:3, H + 8:] == 0xEE).all()) and bool((rows[3:] == 0xEE).all())
    with pytest.raises(ValueError, match="out_scale"):
        quantize_fp8(x, block, out_scale=torch.zeros(T, 5, dtype=torch.int32), ue8m0=True)
    with pytest.raises(ValueError, match="out_scale"):
        quantize_fp8(x, block, out_scale=torch.zeros(T, 2), ue8m0=True)


@pytest.mark.timeout(60)
def test_encoding_every_code_tie_and_neighbour():
    """A row whose first element is 448 gets scale exactly 1, so the kernel encodes the other
    elements as given: every e4m3 value, every midpoint (ties go to even; the midpoint above 448
    would round to 480, the clamp keeps it at 448) and their fp32 neighbours, against torch's cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = torch.unique(codes[torch.isfinite(codes)])          # sorted, -448 .. 448
    mids = (finite[1:] + finite[:-1]) / 2
    values = torch.cat([finite, mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                        torch.nextafter(mids, torch.full_like(mids, -1e9)),
                        torch.tensor([-0.0, 2.0**-10, -(2.0**-10), 2.0**-11, 447.9, -447.9, 2.0**-9 * 1.5])])
    x = torch.cat([torch.full((1,), 448.0), values])[None, :]
    q, scale = quantize_on_device(x, block=x.shape[1])
    assert torch.equal(scale, torch.ones(1, 1))
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert_same_bytes(q, want)


@pytest.mark.timeout(60)
def test_zero_and_tiny_blocks_get_scale_one():
    x = torch.zeros(2, 20)
    x[1, :10] = 1e-38     # amax / 448 is below the smallest normal fp32: scale 1, bytes 0
    x[1, 10:] = 3.0
    q, scale = quantize_on_device(x, block=10)
    assert torch.equal(scale, torch.tensor([[1.0, 1.0], [1.0, 3.0 / 448.0]]))
    assert not bool(q.view(torch.uint8)[:, :10].any())
    assert torch.equal(dequantize_fp8(q, scale, 10)[1, 10:], torch.full((10,), 3.0))


@pytest.mark.timeout(60)
def test_decode_row_width_bf16():
    """H = 7168 at block 128: 56 scales per token (the DeepSeek decode shape, fewer tokens)."""
    x = torch.randn(4, 7168, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q, scale = quantize_on_device(x)
    want_q, want_scale = torch_quantize(x, 128)
    assert_same_bytes(q, want_q)
    assert torch.equal(scale, want_scale)


@pytest.mark.timeout(60)
def test_caller_outputs_and_bound_m():
    """Caller-allocated outputs (scale as a transposed, strided view); rows >= bound_m untouched."""
    T, H, block = 6, 40, 16
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(6))
    out_dev = torch.full((T, H), 0x11, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    scale_t_dev = torch.full((3, T), -1.0, device=DEVICE)
    bound_m = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    q, scale = quantize_fp8(x.to(DEVICE), block, out=out_dev, out_scale=scale_t_dev.t(), bound_m=bound_m)
    assert q.data_ptr() == out_dev.data_ptr() and scale.data_ptr() == scale_t_dev.data_ptr()
    out, scale_t = out_dev.cpu(), scale_t_dev.cpu()
    want_q, want_scale = torch_quantize(x[:4], block)
    assert_same_bytes(out[:4], want_q)
    assert torch.equal(scale_t.t()[:4], want_scale)
    assert bool((out.view(torch.uint8)[4:] == 0x11).all()) and bool((scale_t.t()[4:] == -1.0).all())


@pytest.mark.timeout(60)
def test_bad_arguments():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="x: expected dtype"):
        quantize_fp8(x.to(torch.int32))
    with pytest.raises(ValueError, match="block"):
        quantize_fp8(x, 0)
    with pytest.raises(ValueError, match="last stride"):
        quantize_fp8(torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match="out:"):
        quantize_fp8(x, 4, out=torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="out_scale"):
        quantize_fp8(x, 4, out_scale=torch.zeros(2, 3))


@pytest.mark.timeout(120)
@pytest.mark.gpu(reason="compares the native fp8 cast with the integer encoding the CPU tests check")
def test_gpu_native_cast_equals_bit_encoding():
    gen = torch.Generator().manual_seed(7)
    magnitude = torch.exp2(torch.empty(64, 1000).uniform_(-14, 4, generator=gen))
    x = (torch.randn(64, 1000, generator=gen).sign() * magnitude).to(torch.bfloat16).cuda()
    q_native, s_native = quantize_fp8(x, 128, _fp8_via_bits=False)
    q_bits, s_bits = quantize_fp8(x, 128, _fp8_via_bits=True)
    want_q, want_s = torch_quantize(x.cpu(), 128)
    assert_same_bytes(q_native.cpu(), want_q)
    assert_same_bytes(q_bits.cpu(), want_q)
    assert torch.equal(s_native.cpu(), want_s) and torch.equal(s_bits.cpu(), want_s)
    want_q, want_s = torch_quantize(x.cpu(), 128, round_scale=True)
    for via_bits in (False, True):
        q, codes = quantize_fp8(x, 128, ue8m0=True, _fp8_via_bits=via_bits)
        assert_same_bytes(q.cpu(), want_q)
        assert torch.equal(codes.cpu(), torch_ue8m0(want_s))
