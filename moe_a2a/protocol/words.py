"""Every word the protocol shares between the model, its kernels and the proxy, with its codec.

The single account of what each word means and who writes it is docs/protocol.md; this module is the
code side of it: the flags (`Flag`), the proxy shards' words (`ShardWord`), the RDMA immediates
(`Imm`, `encode_imm` / `decode_imm`) and the packed status words the kernels leave for the host
(`encode_*` / `decode_*`; their device twins are in `protocol/device.py`). Torch-free and
triton-free: the proxy process imports it.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

FLAG_SLOT_BYTES = 64  # one cache line per flag: writers on different sides never share a line
WORDS_PER_FLAG = FLAG_SLOT_BYTES // 8  # flag f is int64 word f * WORDS_PER_FLAG of the flags area
ERROR_MESSAGE_BYTES = 4096


class Flag(enum.IntEnum):
    """int64 slots at the start of a rank's shared segment. Values are epochs (call numbers,
    starting at 1, never reset), so a flag is "raised for epoch e" when it reads >= e: no ABA.

    The proxy only ever deals with remote peers (docs/protocol.md): the kernels raise the GPU -> proxy
    flags in their epilogues and wait for the proxy -> GPU ones in their prologues."""

    ROUTE_READY = 0           # GPU -> proxy: this rank's count row is in the routing area
    SEND_READY = 1            # GPU -> proxy: dispatch send buffer packed
    DISPATCH_RECV_READY = 2   # proxy -> GPU: remote count rows and remote dispatch rows have landed
    DISPATCH_WRITES_DONE = 3  # proxy -> GPU: its dispatch writes completed (the send region is reusable)
    COMBINE_SEND_READY = 4    # GPU -> proxy: expert outputs for remote homes staged
    COMBINE_RECV_READY = 5    # proxy -> GPU: remote expert outputs for this rank's tokens have landed
    COMBINE_WRITES_DONE = 6   # proxy -> GPU: its combine writes completed (the staging is reusable)
    ERROR = 7                 # proxy -> model: nonzero when the proxy failed; message in the error area
    HEARTBEAT = 8             # proxy: incremented while alive
    PROXY_READY = 9           # proxy: 1 once it is bootstrapped and registered
    SHUTDOWN = 10             # model -> proxy: 1 asks the proxy to exit
    # Results of the kernels' waits (0 ok, else 1 + 2 * bitmask of the missing same-node peers, with
    # PROXY_MISSING set when the proxy's flag was missing), one slot per wait, written only on failure
    # (sticky); the host reads them at its next call without a sync.
    STATUS_DISPATCH_SEND = 11
    STATUS_DISPATCH_RECV = 12
    STATUS_COMBINE_SEND = 13
    STATUS_COMBINE_RECV = 14
    TRACE = 15                # model -> proxy: nonzero = record TRACE_EVENTS times for each call
    # GPU -> model: 1 + the first route (t*K + k) whose expert index was out of range, written by the
    # routing kernel (sticky); the host raises a ValueError naming `indices` at its next call.
    BAD_INDEX = 16
    # GPU -> model, with A2AConfig.expert_capacity: 1 + l + L * n for a local expert l that received
    # n > capacity rows (sticky; the rows past the capacity were not written).
    CAPACITY_EXCEEDED = 17
    # GPU -> model: `(epoch << 16) | (1 + s)` when source s (not this rank) aborted call `epoch`: its
    # count row arrived as all -1 (its input was rejected; it sent nothing and its outputs are void).
    # Written by the dispatch unpack kernel; the host raises once per epoch at the end of a combine
    # or in check() (docs/protocol.md, "Aborted calls").
    ABORTED = 18
    # proxy -> model, cumulative over calls: RDMA writes this rank's proxy posted in the dispatch phase
    # (routing rows, private and remainder writes) and in the combine phase (tests, benchmarks).
    DISPATCH_WRITES_POSTED = 19
    COMBINE_WRITES_POSTED = 20
    # model -> kernels, proxy: the last epoch this rank aborts at its combine (bad combine input, set by
    # the host; an expert over capacity, set by the unpack kernel). The combine pack then tells the node
    # peers (their combine_aborted word) and the proxy sends COMBINE_ABORTED immediates instead.
    CALL_ABORTED = 21
    # GPU -> model: 1 + bound_m of a call whose device-side token count was outside [0, T] (sticky until
    # the host reports it); that call was aborted on every rank.
    BAD_BOUND_M = 22
    # proxy -> GPU: every count row of this epoch has arrived (remote ones at the head of their private
    # writes, same-node ones in the routing area): the plan kernel may copy and read them.
    COUNT_ROWS_READY = 23
    # GPU -> proxy: the remainder and combine write tables of this epoch are written (`WriteTable`).
    REMAINDER_PLANNED = 24
    STATUS_DISPATCH_PLAN = 25  # the plan kernel's failed wait (as STATUS_DISPATCH_SEND ...)
    # GPU -> proxy: remainder writes this rank posts in the current call (remote peers it sends > P routes),
    # written by the private-plan kernel: the proxy waits for REMAINDER_PLANNED only when nonzero.
    REMAINDER_WRITES = 26
    # GPU -> model: 1 + the first source whose count row is corrupt (negative entries in a row that is not
    # all -1, or more than T*K routes), found by the plan kernel before any offset is derived from it
    # (sticky, fatal: the kernels after it move nothing).
    BAD_COUNTS = 27
    NUM_FLAGS = 28


# Several proxy processes per rank (`AllToAll(proxies=k)`): proxy j carries the remote peers p that
# `Layout.proxy_shard` gives it. Each proxy publishes its progress in one 64-byte line of the segment's shard area
# (`Layout.shard_offset_bytes`, MAX_PROXY_SHARDS lines, fixed so the layout does not depend on k); the
# primary (j = 0) raises the flags the kernels read only once every shard's word reached the epoch.
MAX_PROXY_SHARDS = 16


class ShardWord(enum.IntEnum):
    """int64 words of one proxy shard's line (epochs, except the cumulative *_POSTED counts). Written
    by that shard only (release stores), read by the other shards (acquire loads) and the model."""

    ROWS_LANDED = 0           # its remote sources' private writes (count rows first) have landed
    DISPATCH_RECV = 1         # every DISPATCH immediate of its sources has arrived
    DISPATCH_WRITES_DONE = 2  # its dispatch writes completed
    COMBINE_RECV = 3          # every COMBINE immediate of its sources has arrived
    COMBINE_WRITES_DONE = 4   # its combine writes completed
    DISPATCH_POSTED = 5       # writes posted in the dispatch phase, cumulative (shards j > 0; shard 0: the flag)
    COMBINE_POSTED = 6        # the same for combine
    NUM_WORDS = 7


def flag_word(flag: "Flag | int") -> int:
    """Index, in the int64 flags area, of a `Flag`'s word (one FLAG_SLOT_BYTES line per flag)."""
    return int(flag) * WORDS_PER_FLAG


class Imm(enum.IntEnum):
    """Kinds of 32-bit RDMA immediates. The immediate also carries the sender and the epoch, so a
    receiver counts exactly which peer delivered what for which call (`encode_imm`)."""

    DISPATCH = 2          # a private write: count row + first routes; no remainder follows
    COMBINE = 3
    COMBINE_ABORTED = 4   # a combine write of a call its sender aborted (counted as COMBINE)
    DISPATCH_MORE = 5     # a private write after which a remainder write follows (the sender has > P routes)
    DISPATCH_REMAINDER = 6  # the remainder write (only after a DISPATCH_MORE of the same sender and epoch)


class WriteTable(enum.IntEnum):
    """The write tables the kernels fill for the proxy (`Layout.write_table_offset_bytes`): per table,
    one row of `WRITE_TABLE_COLUMNS` int64 per peer rank, indexed by rank: (src_offset_bytes, length_bytes,
    dst_offset_bytes, imm), offsets relative to this rank's send buffer and the peer's recv buffer, exactly
    the rows of `protocol.plan` (+ the immediate). Only remote peers' rows are meaningful. The proxy reads
    and posts them: it does no arithmetic of its own (docs/protocol.md, "Write tables")."""

    PRIVATE = 0    # written by the private-plan kernel before the dispatch pack (own count row)
    REMAINDER = 1  # written by the plan kernel once every count row is in (COUNT_ROWS_READY); length 0: none
    COMBINE = 2    # the same kernel: the combine writes to every remote source
    NUM_TABLES = 3


WRITE_TABLE_COLUMNS = 4
# A write in pieces (`Layout.wire_pieces`, `plan.piece_starts`): piece boundaries are multiples of this from its start.
PIECE_ALIGN_BYTES = 16


# Moments the proxy timestamps (CLOCK_MONOTONIC ns) when Flag.TRACE is set: one (epoch, t_ns) pair of
# int64 per event in the trace area, overwritten each call (the last call stays readable).
TRACE_EVENTS = (
    "route_ready_seen", "private_planned", "send_ready_seen", "private_posted", "count_rows_received",
    "remainder_posted", "dispatch_received", "dispatch_writes_done",
    "combine_send_seen", "combine_posted", "combine_received", "combine_writes_done",
)

# The model's four halves, stamped at start and end while tracing: on a GPU by a one-program kernel on
# the stream (%globaltimer, mapped to CLOCK_MONOTONIC by a calibration), on CPU from the host. Per half
# two (epoch, t_ns) int64 pairs after the proxy's, then one pair for the calibration.
MODEL_TRACE_EVENTS = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")

IMM_KIND_BITS = 4
IMM_RANK_BITS = 12   # up to 4096 ranks
IMM_EPOCH_BITS = 32 - IMM_KIND_BITS - IMM_RANK_BITS


ERROR_TIMEOUT = 1  # values of Flag.ERROR (the message is in the error area)
ERROR_FAILED = 2


# ---- immediates -------------------------------------------------------------------------------
def encode_imm(kind: Imm, rank: int, epoch: int) -> int:
    """32-bit immediate: kind | sender rank | epoch (low bits). Counting exact values tells a
    receiver which peer is missing, and an early immediate of the next call is never confused
    with one of this call."""
    return (int(kind) << (IMM_RANK_BITS + IMM_EPOCH_BITS)) | (rank << IMM_EPOCH_BITS) | (
        epoch & ((1 << IMM_EPOCH_BITS) - 1))


def decode_imm(imm: int) -> tuple[int, int, int]:
    """Inverse of `encode_imm`: (kind, rank, epoch low bits)."""
    epoch = imm & ((1 << IMM_EPOCH_BITS) - 1)
    rank = (imm >> IMM_EPOCH_BITS) & ((1 << IMM_RANK_BITS) - 1)
    return imm >> (IMM_RANK_BITS + IMM_EPOCH_BITS), rank, epoch


# ---- packed status words (written by kernels, read by the host) -------------------------------
# Flag.ABORTED: (epoch << ABORT_EPOCH_SHIFT) | (1 + source rank).
ABORT_EPOCH_SHIFT = 16
# A wait's STATUS_* word: 1 + 2 * bitmask of the late node ranks, | PROXY_MISSING when the proxy's flag was late.
PROXY_MISSING = 1 << 40


def encode_abort(epoch: int, source: int) -> int:
    """Flag.ABORTED: source rank `source` aborted call `epoch` (its count row arrived as all -1)."""
    return (int(epoch) << ABORT_EPOCH_SHIFT) | (1 + int(source))


def decode_abort(word: int) -> tuple[int, int] | None:
    """(epoch, source) of a Flag.ABORTED word, or None when no abort was recorded."""
    word = int(word)
    if not word:
        return None
    return word >> ABORT_EPOCH_SHIFT, (word & ((1 << ABORT_EPOCH_SHIFT) - 1)) - 1


def encode_capacity(local_expert: int, rows: int, num_local_experts: int) -> int:
    """Flag.CAPACITY_EXCEEDED: local expert `local_expert` received `rows` > capacity rows."""
    return 1 + int(local_expert) + int(num_local_experts) * int(rows)


def decode_capacity(word: int, num_local_experts: int) -> tuple[int, int] | None:
    """(local expert, rows received) of a Flag.CAPACITY_EXCEEDED word, or None."""
    word = int(word)
    if not word:
        return None
    return (word - 1) % num_local_experts, (word - 1) // num_local_experts


def encode_bad_index(token: int, k: int, experts_per_token: int) -> int:
    """Flag.BAD_INDEX: the first route (token, k) whose expert index was out of range."""
    return 1 + int(token) * int(experts_per_token) + int(k)


def decode_bad_index(word: int, experts_per_token: int) -> tuple[int, int] | None:
    """(token, k) of a Flag.BAD_INDEX word, or None."""
    word = int(word)
    if not word:
        return None
    return (word - 1) // experts_per_token, (word - 1) % experts_per_token


def encode_bad_bound_m(bound_m: int) -> int:
    """Flag.BAD_BOUND_M: the device-side token count of a call was outside [0, T] (any int32)."""
    return (1 << 32) | (int(bound_m) & 0xFFFFFFFF)


def decode_bad_bound_m(word: int) -> int | None:
    """The bound_m a Flag.BAD_BOUND_M word recorded, or None."""
    word = int(word)
    if not word:
        return None
    low = word & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


def encode_wait_status(late_node_ranks: list[int], node_first: int, proxy_late: bool) -> int:
    """A failed wait's STATUS_* word (0 is never a failure: the +1)."""
    mask = sum(1 << (p - node_first) for p in late_node_ranks)
    return 1 + 2 * mask + (PROXY_MISSING if proxy_late else 0)


def decode_wait_status(word: int, node_first: int) -> tuple[list[int], bool] | None:
    """(late node ranks, whether the proxy's flag was late) of a STATUS_* word, or None."""
    word = int(word)
    if not word:
        return None
    mask = ((word & (PROXY_MISSING - 1)) - 1) // 2
    return [node_first + i for i in range(mask.bit_length()) if mask >> i & 1], bool(word & PROXY_MISSING)


class HalfFlags(NamedTuple):
    """The flags of one half's kernel: the proxy flag it waits for (>= epoch + delta), the one it raises
    in its epilogue (None: none), the status word of a failed wait and what that wait was for. The
    host's waits and messages use the same table."""

    wait: Flag
    delta: int
    signal: Flag | None
    status: Flag
    what: str


# A producer waits until the proxy finished writing out of its buffer for the previous call (delta -1);
# a consumer waits until the proxy says the remote data of this call has landed.
HALF_FLAGS = {
    "dispatch_send": HalfFlags(Flag.DISPATCH_WRITES_DONE, -1, Flag.SEND_READY, Flag.STATUS_DISPATCH_SEND,
                               "dispatch send: the proxy's writes of the previous call"),
    "dispatch_recv": HalfFlags(Flag.DISPATCH_RECV_READY, 0, None, Flag.STATUS_DISPATCH_RECV,
                               "dispatch: count rows and tokens from peers"),
    "combine_send": HalfFlags(Flag.COMBINE_WRITES_DONE, -1, Flag.COMBINE_SEND_READY, Flag.STATUS_COMBINE_SEND,
                              "combine send: the proxy's writes of the previous call"),
    "combine_recv": HalfFlags(Flag.COMBINE_RECV_READY, 0, None, Flag.STATUS_COMBINE_RECV,
                              "combine: expert outputs from peers"),
    # The plan kernel at the head of the dispatch recv half (remote peers only): it waits for every count
    # row, writes the remainder and combine tables and raises REMAINDER_PLANNED.
    "dispatch_plan": HalfFlags(Flag.COUNT_ROWS_READY, 0, Flag.REMAINDER_PLANNED, Flag.STATUS_DISPATCH_PLAN,
                               "dispatch: every peer's count row (for the remainder plan)"),
    # The relay's reduce of the node's partials (combine send, second kernel): every node peer's partials and
    # the proxy's combine writes of the previous call out of the staging area it fills.
    "combine_relay": HalfFlags(Flag.COMBINE_WRITES_DONE, -1, Flag.COMBINE_SEND_READY, Flag.STATUS_COMBINE_SEND,
                               "combine: the node's partials (relay)"),
    # Host waits on a GPU only: the plan kernel has copied the remote count rows in (the host reads them).
    "dispatch_planned": HalfFlags(Flag.REMAINDER_PLANNED, 0, None, Flag.STATUS_DISPATCH_PLAN,
                                  "dispatch: the plan kernel (remote count rows copied in)"),
}
