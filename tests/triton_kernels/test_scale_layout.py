"""`triton_kernels/scale_layout.py`: fp8 scales into DeepEP's column-major, TMA-aligned layout (interpreter on
CPU, the device with MOE_A2A_TEST_DEVICE=cuda)."""
from __future__ import annotations

import pytest
import torch

from moe_a2a.triton_kernels.scale_layout import column_major_scales, scales_to_column_major, tma_aligned_tokens

from ..conftest import TEST_DEVICE


def deep_ep_scales(L: int, C: int, S: int, dtype: torch.dtype) -> torch.Tensor:
    """DeepEP's own allocation (`csrc/legacy/buffer.hpp`, low_latency_dispatch): `torch::empty({L, S, C})`
    transposed to `[L, C, S]`."""
    return torch.empty(L, S, C, dtype=dtype).transpose(1, 2)


def _rows(L: int, C: int, S: int, row_words: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Row-major scales as the facade holds them: `[L, C, S]` views into wider rows (stride row_words)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (L * C, row_words), generator=g, dtype=torch.int32)
    return words.to(TEST_DEVICE)[:, 3:3 + S].view(dtype).view(L, C, S)


@pytest.mark.parametrize("L,C,S,dtype", [(3, 8, 5, torch.float32), (2, 256, 56, torch.float32),
                                         (4, 6, 2, torch.int32), (1, 300, 70, torch.int32), (2, 1, 1, torch.float32)])
def test_layout_matches_deep_ep_and_values_are_bit_exact_below_the_counts(L, C, S, dtype):
    out = column_major_scales(L, C, S, dtype, TEST_DEVICE)
    C4 = tma_aligned_tokens(C)
    assert C4 % 4 == 0 and C <= C4 < C + 4
    assert tuple(out.shape) == (L, C, S) and out.dtype == dtype
    assert out.stride() == (S * C4, 1, C4)
    if C % 4 == 0:  # DeepEP asserts C % 4 == 0: then its strides exactly
        assert out.stride() == deep_ep_scales(L, C, S, dtype).stride()
    # Every scale column starts 16-byte aligned (TMA), and the tensor is its own storage from offset 0.
    assert out.data_ptr() % 16 == 0 and (out.stride(2) * 4) % 16 == 0 and (out.stride(0) * 4) % 16 == 0
    src = _rows(L, C, S, S + 9, dtype, seed=C)
    counts = torch.tensor([(C * (l + 1)) // (L + 1) for l in range(L)][:L], dtype=torch.int32, device=TEST_DEVICE)
    counts[-1] = C  # one expert full
    scales_to_column_major(src, out, counts)
    for l in range(L):
        n = int(counts[l])
        assert torch.equal(out[l, :n].view(torch.int32).cpu(), src[l, :n].view(torch.int32).cpu()), l
        assert not out[l, n:].view(torch.int32).any(), l  # rows past the count are not written
    # DeepEP's test reads them as `.contiguous()` (then `.view(-1, S)`): the same values.
    dense = out.contiguous()
    assert dense.stride() == (C * S, S, 1)
    # And as DeepGEMM does, through the column-major storage: scale s of token t of expert l.
    flat = out.transpose(1, 2)
    for l in range(L):
        n = int(counts[l])
        assert torch.equal(flat[l, :, :n].view(torch.int32).cpu(), src[l, :n].view(torch.int32).T.cpu())


def test_every_row_without_counts_and_nan_bits_kept():
    L, C, S = 2, 12, 7
    src = _rows(L, C, S, 16, torch.float32, seed=5)
    src.view(torch.int32)[0, 0, 0] = 0x7FC00001  # a NaN payload: copied as bits, not as a float
    out = column_major_scales(L, C, S, torch.float32, TEST_DEVICE)
    scales_to_column_major(src, out)
    assert torch.equal(out.view(torch.int32).cpu(), src.view(torch.int32).cpu())


def test_refusals():
    out = column_major_scales(2, 8, 4, torch.float32, TEST_DEVICE)
    src = torch.zeros(2, 8, 4, device=TEST_DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        scales_to_column_major(src[:, :4], out)
    with pytest.raises(ValueError, match="column-major"):
        scales_to_column_major(src, torch.zeros(2, 8, 4, device=TEST_DEVICE))
    with pytest.raises(ValueError, match="stride 1"):
        scales_to_column_major(src.transpose(1, 2).contiguous().transpose(1, 2), out)
    with pytest.raises(ValueError, match="counts"):
        scales_to_column_major(src, out, torch.zeros(3, dtype=torch.int32, device=TEST_DEVICE))
    with pytest.raises(ValueError, match="4-byte"):
        scales_to_column_major(src.to(torch.bfloat16), out)
    with pytest.raises(ValueError, match="float32 or int32"):
        column_major_scales(2, 8, 4, torch.bfloat16, TEST_DEVICE)


_SM90 = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_a2a.triton_kernels import scale_layout as m

fn = m._LAUNCH.kernel  # the @triton.jit kernel the launcher launches, wherever it is defined
names = inspect.signature(fn.fn).parameters
for has_counts in (True, False):
    constexprs = dict(HAS_COUNTS=has_counts, BLOCK_T=m.BLOCK_TOKENS, BLOCK_S=m.MAX_BLOCK_SCALES)
    pointers = dict(src="*i32", counts="*i32", out="*i32")
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    print("compiled", has_counts, k.metadata.num_warps, len(k.asm["cubin"]))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kernel_compiles_for_sm90():
    """The kernel as the H200 runs it (sm_90), compiled here without a device, in a process without the
    interpreter (under TRITON_INTERPRET=1 kernels are interpreted functions, which do not compile)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _SM90], capture_output=True, text=True, env=env, timeout=280,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 2, r.stdout
