"""The `@triton.jit` body of `quant.py` (private: launched only by `quantize_fp8`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _details as d


@triton.jit(do_not_specialize=["num_tokens"])  # one binary for every T (decode/prefill alike)
def _quantize_fp8_kernel(
    x_ptr,            # (T, H) bf16/fp16/fp32, last stride 1
    out_ptr,          # (T, H) uint8 view of the float8_e4m3fn output, last stride 1
    scale_ptr,        # (T, S) float32, S = ceil(H / block), any strides; UE8M0: uint8 view of the
                      # (T, ceil(S / 4)) int32 codes (byte j of a row = block j), strides in bytes
    bound_m_ptr,      # (1,) int32 live token count; read only when HAS_BOUND_M
    num_tokens,       # T
    hidden,           # H
    block,            # elements per scale
    stride_x_t,       # elements
    stride_out_t,     # elements
    stride_scale_t,   # elements (UE8M0: bytes)
    stride_scale_s,   # elements (UE8M0: 1)
    BLOCK_T: tl.constexpr,     # token rows per program
    BLOCK_C: tl.constexpr,     # next_pow2(block): one scale block per program
    HAS_BOUND_M: tl.constexpr,
    FP8_VIA_BITS: tl.constexpr,
    ROUND_SCALE: tl.constexpr = False,  # scale rounded up to a power of two
    UE8M0: tl.constexpr = False,        # store the scale's exponent byte (needs ROUND_SCALE)
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

    # The math is _details.py's (one copy, shared with dispatch pack's fused quantisation).
    q, scale = d.fp8_block_quantize(x, ROUND_SCALE)
    d.fp8_e4m3_store(out_ptr, rows[:, None] * stride_out_t + cols[None, :], q, mask, FP8_VIA_BITS)
    if UE8M0:
        tl.store(scale_ptr + rows * stride_scale_t + pid_s * stride_scale_s, d.ue8m0_code(scale), mask=row_ok)
        # The last block's program zeroes the padding bytes of the row's last int32 (S not a multiple of 4);
        # the condition is folded into the column bound, a block mask of tensors only.
        num_blocks = tl.cdiv(hidden, block)
        pad = num_blocks + tl.arange(0, 4)
        pad_end = tl.where(pid_s == num_blocks - 1, (num_blocks + 3) // 4 * 4, 0)
        tl.store(scale_ptr + rows[:, None] * stride_scale_t + pad[None, :] * stride_scale_s,
                 tl.zeros([BLOCK_T, 4], dtype=tl.uint8), mask=row_ok[:, None] & (pad[None, :] < pad_end))
    else:
        tl.store(scale_ptr + rows * stride_scale_t + pid_s * stride_scale_s, scale, mask=row_ok)

