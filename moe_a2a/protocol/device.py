"""The device side of `protocol/words.py`: the packed status words as the kernels write them.

Each helper is the `@triton.jit` twin of the host `encode_*` of the same name in `words.py` (tests
check both agree); kernels import this module, never a bare shift. docs/protocol.md, "Status words".
"""
from __future__ import annotations

import triton
import triton.language as tl

from .words import ABORT_EPOCH_SHIFT, IMM_EPOCH_BITS, IMM_RANK_BITS, PROXY_MISSING

_ABORT_EPOCH_SHIFT: tl.constexpr = tl.constexpr(ABORT_EPOCH_SHIFT)
_PROXY_MISSING: tl.constexpr = tl.constexpr(PROXY_MISSING)
_IMM_EPOCH_BITS: tl.constexpr = tl.constexpr(IMM_EPOCH_BITS)
_IMM_KIND_SHIFT: tl.constexpr = tl.constexpr(IMM_RANK_BITS + IMM_EPOCH_BITS)
_IMM_EPOCH_MASK: tl.constexpr = tl.constexpr((1 << IMM_EPOCH_BITS) - 1)


@triton.jit
def encode_imm(kind, rank, epoch):
    """32-bit RDMA immediate kind | sender rank | epoch low bits, as int64 (`words.encode_imm`)."""
    return ((kind.to(tl.int64) << _IMM_KIND_SHIFT) | (rank.to(tl.int64) << _IMM_EPOCH_BITS)
            | (epoch.to(tl.int64) & _IMM_EPOCH_MASK))


@triton.jit
def encode_abort(epoch, source):
    """Flag.ABORTED: `source` aborted call `epoch` (int64)."""
    return (epoch.to(tl.int64) << _ABORT_EPOCH_SHIFT) | (source + 1).to(tl.int64)


@triton.jit
def encode_capacity(local_expert, rows, num_local_experts):
    """Flag.CAPACITY_EXCEEDED: `local_expert` received `rows` > capacity rows."""
    return 1 + local_expert.to(tl.int64) + num_local_experts * rows.to(tl.int64)


@triton.jit
def encode_bad_index(route):
    """Flag.BAD_INDEX: the first out-of-range route, `route = token * K + k`."""
    return route.to(tl.int64) + 1


@triton.jit
def encode_wait_status(late_mask, proxy_late):
    """A failed wait's STATUS_* word: `late_mask` bit i = node rank node_first + i was late."""
    return 1 + 2 * late_mask.to(tl.int64) + tl.where(proxy_late, _PROXY_MISSING, 0)


@triton.jit
def encode_bad_bound_m(bound_m):
    """Flag.BAD_BOUND_M: a call's device-side token count outside [0, T]."""
    return (1 << 32) | (bound_m.to(tl.int64) & 0xFFFFFFFF)
