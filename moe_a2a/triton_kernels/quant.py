"""fp8 e4m3 block quantisation of tokens before dispatch.

For every token row and every block of `block` consecutive hidden elements (the last block may be
shorter when H is not a multiple of `block`):

    scale   = amax(|x_block|) / 448                      (fp32, correctly rounded division)
    scale   = 1.0 if scale < 2**-126 (the smallest normal fp32; covers all-zero blocks)
    x_fp8   = e4m3fn(clamp(x / scale, -448, 448))          (x / scale correctly rounded, then RNE)

The guard keeps every division on normal numbers: a block whose amax is below 448 * 2**-126 ≈ 5e-36
(in particular an all-zero block) gets scale 1, and its values, all smaller than the smallest e4m3
subnormal, quantise to ±0 — dequantisation gives ±0 for them, an absolute error below 5e-36.
`tl.div_rn` is used instead of `/` because Triton lowers fp32 `/` to an approximate division on
NVIDIA GPUs; with it the result is bit-identical to the same formula in torch.

Two ways to produce the fp8 byte, chosen by the launcher:
- on GPU, `.to(tl.float8e4nv)` (a `cvt.rn.satfinite` instruction; the clamp makes saturation moot);
- on CPU (`TRITON_INTERPRET=1`), the interpreter's fp8 cast flushes e4m3 subnormals to zero, so the
  kernel computes the encoding with integer arithmetic and stores it through a uint8 view. Tests check
  this path bitwise against torch's `.to(torch.float8_e4m3fn)`, and on a GPU the two paths against
  each other.

Memory traffic per token: H * itemsize read, H bytes + 4 * ceil(H / block) bytes written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import ceil_div, next_power_of_2
from . import _checks as check

FP8_E4M3_MAX = 448.0


@triton.jit(do_not_specialize=["num_tokens"])  # one binary for every T (decode/prefill alike)
def _quantize_fp8_kernel(
    x_ptr,            # (T, H) bf16/fp16/fp32, last stride 1
    out_ptr,          # (T, H) float8_e4m3fn, or its uint8 view when FP8_VIA_BITS; last stride 1
    scale_ptr,        # (T, S) float32, S = ceil(H / block), any strides
    bound_m_ptr,      # (1,) int32 live token count; read only when HAS_BOUND_M
    num_tokens,       # T
    hidden,           # H
    block,            # elements per scale
    stride_x_t,       # elements
    stride_out_t,     # elements
    stride_scale_t,   # elements
    stride_scale_s,   # elements
    BLOCK_T: tl.constexpr,     # token rows per program
    BLOCK_C: tl.constexpr,     # next_pow2(block): one scale block per program
    HAS_BOUND_M: tl.constexpr,
    FP8_VIA_BITS: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), S): one program per BLOCK_T tokens x one scale block."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_live_tokens = num_tokens
    if HAS_BOUND_M:
        num_live_tokens = tl.minimum(tl.load(bound_m_ptr), num_tokens)
    rows = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    col_start = pid_s * block
    cols = col_start + tl.arange(0, BLOCK_C)
    row_ok = rows < num_live_tokens
    mask = row_ok[:, None] & (cols[None, :] < tl.minimum(col_start + block, hidden))
    x = tl.load(x_ptr + rows[:, None] * stride_x_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.div_rn(amax, 448.0)
    scale = tl.where(scale >= 1.1754943508222875e-38, scale, 1.0)  # 2**-126, see the overview
    q = tl.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)

    out_offs = rows[:, None] * stride_out_t + cols[None, :]
    if FP8_VIA_BITS:
        bits = q.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = tl.abs(q)
        abits = a.to(tl.int32, bitcast=True)
        # Normal e4m3 (|q| >= 2**-6): keep 3 of fp32's 23 mantissa bits with round-half-even on the
        # raw bits (a carry correctly bumps the exponent), then rebias the exponent from 127 to 7.
        rounded = abits + 0x7FFFF + ((abits >> 20) & 1)
        normal = (rounded >> 20) - (120 << 3)
        # Subnormal e4m3 (|q| < 2**-6, steps of 2**-9): the code is RNE(|q| * 512); adding and
        # removing 2**23 rounds to an integer with the FPU's round-half-even (|q| * 512 is exact).
        subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        code = sign | tl.where(a >= 0.015625, normal, subnormal)
        tl.store(out_ptr + out_offs, code.to(tl.uint8), mask=mask)
    else:
        tl.store(out_ptr + out_offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + rows * stride_scale_t + pid_s * stride_scale_s, scale, mask=row_ok)


def quantize_fp8(
    x: torch.Tensor,
    block: int = 128,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    bound_m: torch.Tensor | None = None,
    *,
    _fp8_via_bits: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `x` to fp8 e4m3 with one fp32 scale per `block` elements of a row.

    Args:
        x: `[num_tokens, H]` bf16/fp16/fp32, last stride 1, finite values.
        block: elements per scale (any positive int; H need not be a multiple).
        out: optional `[num_tokens, H]` float8_e4m3fn, last stride 1.
        out_scale: optional `[num_tokens, ceil(H / block)]` float32, any strides.
        bound_m: optional `[1]` int32 device tensor: rows >= min(bound_m, T) are not written.

    Returns `(x_fp8, scale)`; `dequantize_fp8(x_fp8, scale, block)` approximates x.
    One launch, no CPU sync; safe in a CUDA graph when the outputs are given.
    `_fp8_via_bits` forces the integer encoding (default: on CPU only); for tests.
    """
    check.tensor("x", x, dtypes=(torch.bfloat16, torch.float16, torch.float32), shape=("T", "H"))
    check.integer("block", block, lo=1)
    T, H = x.shape
    S = ceil_div(H, block)
    device = x.device
    if out is None:
        out = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=device)
    else:
        check.tensor("out", out, dtypes=(torch.float8_e4m3fn,), shape=(T, H), device=device)
    if out_scale is None:
        out_scale = torch.empty(T, S, dtype=torch.float32, device=device)
    else:
        check.tensor("out_scale", out_scale, dtypes=(torch.float32,), shape=(T, S), device=device, strides="any")
    check.bound_m(bound_m, device)
    if T == 0 or H == 0:
        return out, out_scale

    via_bits = device.type != "cuda" if _fp8_via_bits is None else bool(_fp8_via_bits)
    block_c = next_power_of_2(block)
    # ~4096 elements per program: 32 rows x 128 at the usual block, 8 KB of bf16 in flight.
    block_t = max(1, min(next_power_of_2(T), 4096 // block_c))
    grid = (ceil_div(T, block_t), S)
    _quantize_fp8_kernel[grid](
        x, out.view(torch.uint8) if via_bits else out, out_scale,
        bound_m if bound_m is not None else out_scale,  # never read without HAS_BOUND_M
        T, H, block, x.stride(0), out.stride(0), out_scale.stride(0), out_scale.stride(1),
        BLOCK_T=block_t, BLOCK_C=block_c, HAS_BOUND_M=bound_m is not None, FP8_VIA_BITS=via_bits,
        num_warps=4,
    )
    return out, out_scale


def dequantize_fp8(
    x_fp8: torch.Tensor, scale: torch.Tensor, block: int = 128, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch inverse for tests and debugging: `x_fp8 * scale` per block, cast to out_dtype."""
    check.tensor("x_fp8", x_fp8, shape=("T", "H"), strides="any")
    check.tensor("scale", scale, shape=(x_fp8.shape[0], ceil_div(x_fp8.shape[1], block)), strides="any")
    H = x_fp8.shape[1]
    full = scale.float().repeat_interleave(block, dim=1)[:, :H]
    return (x_fp8.float() * full).to(out_dtype)


__all__ = ["quantize_fp8", "dequantize_fp8", "FP8_E4M3_MAX"]
