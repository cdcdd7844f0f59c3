"""The `@triton.jit` body of `scale_layout.py` (private: launched only by `scales_to_column_major`).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scales_to_column_major_kernel(src, counts, out, num_tokens, num_scales, src_stride_e, src_stride_t,
                                   out_stride_e, out_stride_s, HAS_COUNTS: tl.constexpr, BLOCK_T: tl.constexpr,
                                   BLOCK_S: tl.constexpr):
    """Program (token block b, expert l): rows [b * BLOCK_T, (b + 1) * BLOCK_T) of expert l below its count,
    every scale column: out[l, s, t] (column-major) = src[l, t, s] (row-major, unit stride along s)."""
    block = tl.program_id(0)
    expert = tl.program_id(1).to(tl.int64)
    n = num_tokens
    if HAS_COUNTS:
        n = tl.minimum(tl.load(counts + expert), num_tokens)
    tok = block * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tok < n
    src_rows = src + expert * src_stride_e + tok.to(tl.int64)[:, None] * src_stride_t
    out_cols = out + expert * out_stride_e + tok[:, None]
    for s0 in range(0, num_scales, BLOCK_S):
        col = s0 + tl.arange(0, BLOCK_S)
        mask = live[:, None] & (col < num_scales)[None, :]
        words = tl.load(src_rows + col[None, :], mask=mask)
        tl.store(out_cols + col.to(tl.int64)[None, :] * out_stride_s, words, mask=mask)

