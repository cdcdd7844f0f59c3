"""fp8 e4m3 block quantisation of tokens before dispatch.

For every token row and every block of `block` consecutive hidden elements (the last block may be
shorter when H is not a multiple of `block`):

    scale   = amax(|x_block|) / 448                      (fp32, correctly rounded division)
    scale   = 1.0 if scale < 2**-126 (the smallest normal fp32; covers all-zero blocks)
    x_fp8   = e4m3fn(clamp(x / scale, -448, 448))          (x / scale correctly rounded, then RNE)

With `round_scale=True` the scale is then rounded up to a power of two, `2 ** ceil(log2(scale))`
(DeepEP's `round_scale`; exact: the fp32 bits with the mantissa cleared and the exponent bumped when
the mantissa was not zero), so dividing by it is exact and `|x / scale| <= 448` still holds. With
`ue8m0=True` (which implies `round_scale`) the scales are written as UE8M0 codes, the biased fp32
exponent byte `e` of the power-of-two scale (`scale = 2 ** (e - 127)`), packed four per int32 in
DeepEP's layout: int32 column `j // 4` of a row holds scale block `j` in its byte `j % 4` (little-endian,
so a `uint8` view of the int32 tensor lists the codes in block order), `ceil(ceil(H / block) / 4)`
int32 per token; the padding bytes of the last int32 (when the block count is not a multiple of 4) are
written as zero.

The guard keeps every division on normal numbers: a block whose amax is below 448 * 2**-126 ≈ 5e-36
(in particular an all-zero block) gets scale 1, and its values, all smaller than the smallest e4m3
subnormal, quantise to ±0 — dequantisation gives ±0 for them, an absolute error below 5e-36.
`tl.div_rn` is used instead of `/` because Triton lowers fp32 `/` to an approximate division on
NVIDIA GPUs; with it the result is bit-identical to the same formula in torch.

Two ways to produce the fp8 byte, chosen by the launcher:
- on GPU, `.to(tl.float8e4nv)` (a `cvt.rn.satfinite` instruction; the clamp makes saturation moot);
- on CPU (`TRITON_INTERPRET=1`), the interpreter's fp8 cast flushes e4m3 subnormals to zero, so the
  kernel computes the encoding with integer arithmetic. Tests check this path bitwise against torch's
  `.to(torch.float8_e4m3fn)`, and on a GPU the two paths against each other.

The `@triton.jit` math is in `_details.py` (`fp8_block_quantize`, `fp8_e4m3_store`, `ue8m0_code`), the
one copy: dispatch pack's fused quantisation (`dispatch.pack_tokens_by_expert(quantize=...)`) calls the
same helpers, so its bytes are these by construction.

Memory traffic per token: H * itemsize read, H bytes + 4 * ceil(H / block) bytes written (UE8M0:
ceil(H / block) bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ..config import A2AConfig, ceil_div, next_power_of_2
from . import _checks as check
from ._quant_kernels import _quantize_fp8_kernel

FP8_E4M3_MAX = 448.0


def quantize_fp8(
    x: torch.Tensor,
    block: int = 128,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    bound_m: torch.Tensor | None = None,
    *,
    round_scale: bool = False,
    ue8m0: bool = False,
    _fp8_via_bits: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `x` to fp8 e4m3 with one scale per `block` elements of a row.

    Args:
        x: `[num_tokens, H]` bf16/fp16/fp32, last stride 1, finite values.
        block: elements per scale (any positive int; H need not be a multiple).
        out: optional `[num_tokens, H]` float8_e4m3fn, last stride 1.
        out_scale: optional `[num_tokens, ceil(H / block)]` float32, any strides; with `ue8m0`,
            `[num_tokens, ceil(ceil(H / block) / 4)]` int32, last stride 1.
        bound_m: optional `[1]` int32 device tensor: rows >= min(bound_m, T) are not written.
        round_scale: scales rounded up to powers of two (module docstring).
        ue8m0: scales as UE8M0 exponent bytes packed four per int32 (implies `round_scale`).

    Returns `(x_fp8, scale)`; `dequantize_fp8(x_fp8, scale, block)` approximates x (either scale form).
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
    round_scale, ue8m0 = bool(round_scale) or bool(ue8m0), bool(ue8m0)
    if ue8m0:
        S4 = ceil_div(S, 4)
        if out_scale is None:
            out_scale = torch.empty(T, S4, dtype=torch.int32, device=device)
        else:
            check.tensor("out_scale", out_scale, dtypes=(torch.int32,), shape=(T, S4), device=device)
    elif out_scale is None:
        out_scale = torch.empty(T, S, dtype=torch.float32, device=device)
    else:
        check.tensor("out_scale", out_scale, dtypes=(torch.float32,), shape=(T, S), device=device, strides="any")
    check.bound_m(bound_m, device)
    if T == 0 or H == 0:
        return out, out_scale
    if ue8m0:  # byte j of a row is block j's code: a uint8 view, strides in bytes
        codes = out_scale if out_scale.stride(-1) == 1 else \
            out_scale.as_strided((T, S4), (out_scale.stride(0), 1))  # S4 == 1: the last stride is moot
        scale_arg = codes.view(torch.uint8)
        stride_scale_t, stride_scale_s = scale_arg.stride(0), 1
    else:
        scale_arg = out_scale
        stride_scale_t, stride_scale_s = out_scale.stride(0), out_scale.stride(1)

    via_bits = device.type != "cuda" if _fp8_via_bits is None else bool(_fp8_via_bits)
    block_c = next_power_of_2(block)
    # ~4096 elements per program: 32 rows x 128 at the usual block, 8 KB of bf16 in flight.
    block_t = max(1, min(next_power_of_2(T), 4096 // block_c))
    grid = (ceil_div(T, block_t), S)
    _quantize_fp8_kernel[grid](
        x, out.view(torch.uint8), scale_arg,
        bound_m if bound_m is not None else out,  # never read without HAS_BOUND_M
        T, H, block, x.stride(0), out.stride(0), stride_scale_t, stride_scale_s,
        BLOCK_T=block_t, BLOCK_C=block_c, HAS_BOUND_M=bound_m is not None, FP8_VIA_BITS=via_bits,
        ROUND_SCALE=round_scale, UE8M0=ue8m0, num_warps=4,
    )
    return out, out_scale


def dequantize_fp8(
    x_fp8: torch.Tensor, scale: torch.Tensor, block: int = 128, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch inverse for tests and debugging: `x_fp8 * scale` per block, cast to out_dtype.
    `scale` is float32 `[T, ceil(H / block)]` or, UE8M0, int32 `[T, ceil(ceil(H / block) / 4)]`."""
    check.tensor("x_fp8", x_fp8, shape=("T", "H"), strides="any")
    S = ceil_div(x_fp8.shape[1], block)
    if scale.dtype == torch.int32:
        check.tensor("scale", scale, shape=(x_fp8.shape[0], ceil_div(S, 4)), strides="any")
        scale = ue8m0_to_float(scale, S)
    check.tensor("scale", scale, shape=(x_fp8.shape[0], S), strides="any")
    H = x_fp8.shape[1]
    full = scale.float().repeat_interleave(block, dim=1)[:, :H]
    return (x_fp8.float() * full).to(out_dtype)


def ue8m0_to_float(codes: torch.Tensor, num_scales: int) -> torch.Tensor:
    """UE8M0 codes packed four per int32 (`[T, ceil(S / 4)]`, byte j of a row = block j) as float32
    scales `[T, S]`: `2 ** (code - 127)` (plain torch; for tests and dequantisation)."""
    check.tensor("codes", codes, dtypes=(torch.int32,), shape=("T", ceil_div(num_scales, 4)), strides="any")
    shifts = torch.arange(4, dtype=torch.int32, device=codes.device) * 8
    byte = (codes.unsqueeze(-1) >> shifts) & 0xFF                      # little-endian bytes, [T, S4, 4]
    byte = byte.reshape(codes.shape[0], 4 * codes.shape[1])[:, :num_scales]
    return (byte << 23).view(torch.float32)                              # exponent field only


# ================================================================================================
# fp8 quantisation fused into dispatch pack
# ================================================================================================
@dataclass(frozen=True)
class Fp8Quantize:
    """fp8 quantisation fused into dispatch pack (`AllToAll.dispatch(..., quantize=)`,
    `dispatch.pack_tokens_by_expert(..., quantize=)`): the pack reads the `[T, H]` bf16/fp16/fp32 rows
    of `x` and writes into every destination row, inside the bytes of the config's payload
    (`A2AConfig.x_bytes`), exactly what `quantize_fp8(x, block, round_scale=, ue8m0=)` would write
    for the token: its fp8 e4m3 bytes at `[0, H)` and its scales from byte `scale_offset_bytes` (fp32
    per block, or with `ue8m0` the UE8M0 codes packed four per int32, padding bytes zero). Other bytes
    of the row's payload are not written. `ue8m0` implies `round_scale`, as in `quantize_fp8`.

    Frozen and hashable (a launch of the pack is remembered by it). A dict of these fields is taken too.
    """

    scale_offset_bytes: int   # a multiple of 4, >= H; the scales end within cfg.x_bytes
    block: int = 128          # elements per scale: a power of two <= MAX_FUSED_BLOCK
    round_scale: bool = False
    ue8m0: bool = False

    def num_scales(self, hidden: int) -> int:
        return ceil_div(hidden, self.block)

    def scale_bytes(self, hidden: int) -> int:
        """Bytes of a row's scales: 4 per block, or with ue8m0 4 per four blocks (one byte per block)."""
        return 4 * ceil_div(self.num_scales(hidden), 4) if self.ue8m0 else 4 * self.num_scales(hidden)

    def row_bytes(self, hidden: int) -> int:
        """Bytes of a row it writes, from byte 0 to the end of the scales."""
        return self.scale_offset_bytes + self.scale_bytes(hidden)


# The pack's tile holds whole scale blocks (one tile row per block): at most this many elements each.
MAX_FUSED_BLOCK = 4096
_FUSED_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fused_quantize(name: str, value, cfg: A2AConfig) -> Fp8Quantize | None:
    """`value` (None, an `Fp8Quantize` or a dict of its fields) as a normalised `Fp8Quantize` (round_scale
    set with ue8m0) that fits `cfg`'s rows; None for None. ValueError naming `name` otherwise."""
    if value is None:
        return None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in fields(Fp8Quantize)})
        if unknown or "scale_offset_bytes" not in value:
            check.fail(name, "a dict of Fp8Quantize fields (scale_offset_bytes required; block, round_scale, "
                       "ue8m0)", f"keys {sorted(value)}")
        value = Fp8Quantize(**value)
    if not isinstance(value, Fp8Quantize):
        check.fail(name, "None, a quant.Fp8Quantize or a dict of its fields", type(value).__name__)
    block, offset = value.block, value.scale_offset_bytes
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_FUSED_BLOCK \
            or block & (block - 1):
        check.fail(f"{name}.block", f"a power of two in [1, {MAX_FUSED_BLOCK}] (the pack's tile holds whole "
                   f"blocks)", repr(block))
    for flag in ("round_scale", "ue8m0"):
        if not isinstance(getattr(value, flag), bool):
            check.fail(f"{name}.{flag}", "a bool", repr(getattr(value, flag)))
    if cfg.in_dtype not in _FUSED_IN_DTYPES:
        check.fail(name, "a config whose in_dtype is bfloat16, float16 or float32 (the tokens it quantises)",
                   f"in_dtype {str(cfg.in_dtype).removeprefix('torch.')}")
    H = cfg.hidden_dim
    if isinstance(offset, bool) or not isinstance(offset, int) or offset % 4 or offset < H:
        check.fail(f"{name}.scale_offset_bytes", f"a multiple of 4 >= hidden_dim ({H}: the scales follow the fp8 "
                   f"payload)", repr(offset))
    end = value.row_bytes(H)
    if end > cfg.x_bytes:
        check.fail(name, f"fp8 payload and scales within a row's {cfg.x_bytes} payload bytes (H={H} x "
                   f"{cfg.in_dtype.itemsize})", f"scales at [{offset}, {end}) (block {block}"
                   + (", ue8m0)" if value.ue8m0 else ", fp32)"))
    if value.ue8m0 and not value.round_scale:
        value = replace(value, round_scale=True)
    return value


__all__ = ["quantize_fp8", "dequantize_fp8", "ue8m0_to_float", "FP8_E4M3_MAX", "Fp8Quantize", "check_fused_quantize"]
