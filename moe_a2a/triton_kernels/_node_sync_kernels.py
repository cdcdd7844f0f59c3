"""The `@triton.jit` body of `node_sync.py`'s separate wait (private: launched only by `launch_wait_apart`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _details as d


@triton.jit
def _wait_apart_kernel(
    base_ptr, failed_ptr, epoch_ptr, flags_ptr, sync_bytes, node_first, timeout_ns, max_spins,
    READY_BYTES: tl.constexpr, NODE: tl.constexpr, NODE_PAD: tl.constexpr, HAS_PROXY: tl.constexpr,
    PROXY_WAIT_WORD: tl.constexpr, PROXY_DELTA: tl.constexpr, ERROR_WORD: tl.constexpr,
    STATUS_WORD: tl.constexpr, USE_PTX: tl.constexpr, BACKOFF_NS: tl.constexpr,
    mask_ptr, counts_bytes, E: tl.constexpr, E_PAD: tl.constexpr, SHRINK: tl.constexpr,
):
    """Grid (1,), one warp: the wait of one half (`node_wait`) ahead of its data kernel, which then
    starts after it on the stream. A failure is recorded (status word, sticky `failed`) as in the prologue.
    Shrink mode: late node peers are masked at the deadline, and the dispatch wait zeroes masked peers'
    count rows, so the data kernel after it takes nothing from them."""
    d.node_wait(base_ptr, sync_bytes + READY_BYTES, epoch_ptr, failed_ptr, flags_ptr, node_first, timeout_ns,
                max_spins, NODE, NODE_PAD, HAS_PROXY, PROXY_WAIT_WORD, PROXY_DELTA, ERROR_WORD, STATUS_WORD,
                USE_PTX, True, BACKOFF_NS, mask_ptr, counts_bytes, E, E_PAD, SHRINK)

