"""The `@triton.jit` bodies of `sync.py` (private: launched only by `stamp_time` and `signal_flag`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _details as d


@triton.jit(do_not_specialize=["index", "value"])
def _stamp_time_kernel(words_ptr, index, value, epoch_ptr, HAS_EPOCH: tl.constexpr):
    """Grid: (1,). words[index], words[index + 1] = (tag, %globaltimer ns) when the stream gets here."""
    tag = value
    if HAS_EPOCH:
        tag = tl.load(epoch_ptr) + value
    tl.store(words_ptr + index + 1, d.globaltimer_ns())
    tl.store(words_ptr + index, tag)


@triton.jit(do_not_specialize=["flag_index", "value"])
def _signal_flag_kernel(
    flags_ptr,        # (N,) int64 flags area (host memory reached through UVA on GPU)
    flag_index,       # int64 element index of the flag: slot * FLAG_SLOT_BYTES / 8
    value,            # int64 epoch to publish (added to *epoch_ptr with HAS_EPOCH)
    epoch_ptr,        # (1,) int64 device epoch counter (CUDA graphs: read at replay, not capture)
    USE_PTX: tl.constexpr,  # GPU: st.release.sys; interpreter: an atomic exchange
    HAS_EPOCH: tl.constexpr,
):
    """Grid: (1,). Publishes `value` after everything earlier on the stream."""
    v = value.to(tl.int64)
    if HAS_EPOCH:
        v += tl.load(epoch_ptr)
    d.store_release_sys(flags_ptr + flag_index.to(tl.int64), v, USE_PTX)

