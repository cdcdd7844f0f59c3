"""fp8 scales in DeepEP's low-latency layout: column-major per expert, TMA-aligned.

DeepEP's `low_latency_dispatch(use_fp8=True)` returns its scales as `[L, C, S]` (L local experts,
C = num_max_dispatch_tokens_per_rank * num_ranks, S = hidden / 128 fp32 scales, or hidden / 512 int32 words
of four UE8M0 codes) that are the transpose of a contiguous `[L, S, C]` tensor (DeepEP 2.1.0,
`csrc/legacy/buffer.hpp`, `low_latency_dispatch`: `torch::empty({L, S, C})` then `torch::transpose(.., 1, 2)`;
its receive kernel, `csrc/kernels/legacy/internode_ll.cu`, writes scale s of received token t of expert l at
`l * C * S + s * C + t`). Strides `(S * C, 1, C)`: the token dimension is contiguous and each scale column
starts 16-byte aligned (DeepEP asserts C % 4 == 0), which DeepGEMM's masked grouped GEMM reads as its MN-major,
TMA-aligned scale operand without a copy.

The facade's receive writes each row's scales next to its fp8 bytes (row-major, inside the received row). This
kernel copies them into that layout: `column_major_scales` allocates the destination (C padded up to a multiple
of 4 elements, `tma_aligned_tokens`, so any C gives 16-byte aligned columns; for C % 4 == 0 the strides are
DeepEP's exactly), `scales_to_column_major` writes it. Only the rows below each expert's received count are
copied (DeepEP's rows past the count are unspecified too); the 4-byte words are copied bit for bit.
"""
from __future__ import annotations

import torch

from ..config import ceil_div, next_power_of_2, round_up
from . import _launch as launch
from ._scale_layout_kernels import _scales_to_column_major_kernel

# Tokens per program (GPU: one warp-wide store of 64 consecutive words per scale column; the interpreter
# pays per operation, so it takes bigger tiles) and scale columns per inner step.
BLOCK_TOKENS = 64
CPU_BLOCK_TOKENS = 256
MAX_BLOCK_SCALES = 64


def tma_aligned_tokens(num_tokens: int) -> int:
    """The token stride of a scale column: `num_tokens` rounded up to 16 bytes of 4-byte words (DeepGEMM's
    `get_tma_aligned_size`; DeepEP's C is a multiple of 4 already)."""
    return round_up(num_tokens, 4)


def column_major_scales(num_experts: int, num_tokens: int, num_scales: int, dtype: torch.dtype,
                        device) -> torch.Tensor:
    """An `[L, C, S]` tensor in DeepEP's scale layout: the transpose of a contiguous `[L, S, C4]` tensor cut
    to C tokens (C4 = `tma_aligned_tokens(C)`), strides `(S * C4, 1, C4)`; zero-filled. dtype float32
    (scales) or int32 (packed UE8M0 codes)."""
    if dtype not in (torch.float32, torch.int32):
        raise ValueError(f"column_major_scales: dtype must be float32 or int32, got {dtype}")
    C4 = tma_aligned_tokens(num_tokens)
    storage = torch.zeros(num_experts, num_scales, C4, dtype=dtype, device=device)
    return storage[:, :, :num_tokens].transpose(1, 2)


def scales_to_column_major(src: torch.Tensor, out: torch.Tensor, counts: torch.Tensor | None = None) -> None:
    """Write `out` (DeepEP's layout, e.g. from `column_major_scales`) from `src`, the same `[L, C, S]` scales in
    any layout whose last dimension has stride 1 (the facade's: views into the received rows). Rows
    `t >= counts[l]` of expert l are not written (`counts`: int32 `[L]` on the device, read by the kernel:
    no host sync, CUDA-graph safe); None copies every row. 4-byte dtypes (float32 scales, int32 UE8M0 words),
    copied bit-exactly; `out` and `src` may differ in dtype only by a bit-cast of the same size. On a GPU a
    launch with the same tensors as an earlier one skips the checks and Triton's binding (`LaunchCache`)."""
    key = None
    if src.is_cuda:
        key = launch.key(src, out, counts)
        if _LAUNCH.hit(key):
            return
    if src.dim() != 3 or out.dim() != 3 or tuple(src.shape) != tuple(out.shape):
        raise ValueError(f"scales_to_column_major: expected [L, C, S] src and out of one shape, got "
                         f"{tuple(src.shape)} and {tuple(out.shape)}")
    if src.element_size() != 4 or out.element_size() != 4 or src.device != out.device:
        raise ValueError(f"scales_to_column_major: expected 4-byte dtypes on one device, got {src.dtype} on "
                         f"{src.device} and {out.dtype} on {out.device}")
    L, C, S = src.shape
    if S > 1 and src.stride(2) != 1:
        raise ValueError(f"scales_to_column_major: src's scale dimension must have stride 1, got {src.stride()}")
    if C > 1 and out.stride(1) != 1 or S > 1 and out.stride(2) < C:
        raise ValueError(f"scales_to_column_major: out must be column-major per expert (token stride 1, scale "
                         f"stride >= {C}), got strides {out.stride()}")
    if counts is not None and (tuple(counts.shape) != (L,) or counts.dtype != torch.int32
                               or counts.device != src.device):
        raise ValueError(f"scales_to_column_major: counts must be int32 [{L}] on {src.device}, got "
                         f"{tuple(counts.shape)} {counts.dtype} on {counts.device}")
    if L == 0 or C == 0 or S == 0:
        return
    block_t = BLOCK_TOKENS if src.device.type == "cuda" else CPU_BLOCK_TOKENS
    block_s = min(next_power_of_2(S), MAX_BLOCK_SCALES)
    src32, out32 = src.view(torch.int32), out.view(torch.int32)
    _LAUNCH.launch(key, (ceil_div(C, block_t), L),
                   src32, src32 if counts is None else counts, out32, C, S, src32.stride(0), src32.stride(1),
                   out32.stride(0), out32.stride(2), HAS_COUNTS=counts is not None, BLOCK_T=block_t,
                   BLOCK_S=block_s)


_LAUNCH = launch.LaunchCache(_scales_to_column_major_kernel)


__all__ = ["column_major_scales", "scales_to_column_major", "tma_aligned_tokens"]
