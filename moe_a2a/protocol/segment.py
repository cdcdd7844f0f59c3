"""A rank's shared segment as the protocol reads and writes it: flags, proxy shard words, error area.

Stores are release stores and loads acquire loads (`host_atomics`): a reader that sees a word's value
also sees every write made before it by the thread that stored it (plain numpy accesses give that on
x86 only, not on Arm). The segment is anything with `numpy(offset_bytes, n, dtype)`
(`moe_a2a.protocol.memory.SharedSegment`); the offsets come from `config.Layout`.
"""
from __future__ import annotations

import numpy as np

from . import host_atomics
from .words import ERROR_MESSAGE_BYTES, FLAG_SLOT_BYTES, MAX_PROXY_SHARDS, WORDS_PER_FLAG, Flag, ShardWord, flag_word


class Flags:
    """int64 epoch flags of one segment, one cache line apart."""

    def __init__(self, seg, lay) -> None:
        n = flag_word(Flag.NUM_FLAGS)
        self._words = seg.numpy(lay.flags_offset_bytes, n, np.int64)  # keeps the mapping alive
        base = self._words.ctypes.data
        # Only real flags have an address (a KeyError, never a stray store, for anything else).
        self._addr = {f: base + 8 * flag_word(f) for f in Flag if f != Flag.NUM_FLAGS}

    def __getitem__(self, flag: Flag) -> int:
        return host_atomics.load_acquire(self._addr[flag])

    def __setitem__(self, flag: Flag, value: int) -> None:
        host_atomics.store_release(self._addr[flag], value)

    def address(self, flag: Flag) -> int:
        """The flag's address (for an acquire load the caller times itself)."""
        return self._addr[flag]


class ShardWords:
    """The `ShardWord` lines of every proxy shard of one segment (a shard that sees another's word also
    sees what that one wrote before it: count rows)."""

    def __init__(self, seg, lay) -> None:
        assert ShardWord.NUM_WORDS <= WORDS_PER_FLAG
        self._words = seg.numpy(lay.shard_offset_bytes, MAX_PROXY_SHARDS * WORDS_PER_FLAG, np.int64)
        self._base = self._words.ctypes.data

    def get(self, shard: int, word: ShardWord) -> int:
        assert 0 <= shard < MAX_PROXY_SHARDS
        return host_atomics.load_acquire(self._base + shard * FLAG_SLOT_BYTES + 8 * int(word))

    def set(self, shard: int, word: ShardWord, value: int) -> None:
        assert 0 <= shard < MAX_PROXY_SHARDS
        host_atomics.store_release(self._base + shard * FLAG_SLOT_BYTES + 8 * int(word), value)


def write_error(seg, lay, code: int, message: str) -> None:
    """Report an error to the model process: message first, then the flag, with a release store
    (the reader trusts the message once the flag is nonzero)."""
    data = message.encode()[: ERROR_MESSAGE_BYTES - 1] + b"\0"
    seg.numpy(lay.error_offset_bytes, len(data))[:] = np.frombuffer(data, np.uint8)
    Flags(seg, lay)[Flag.ERROR] = code


def read_error(seg, lay) -> str:
    """The message `write_error` left. Call it once `Flag.ERROR` reads nonzero: its acquire load of
    the flag orders the message reads after it, however the caller read the flag."""
    Flags(seg, lay)[Flag.ERROR]  # the acquire load, before the message is read
    raw = bytes(seg.numpy(lay.error_offset_bytes, ERROR_MESSAGE_BYTES))
    return raw.split(b"\0", 1)[0].decode(errors="replace")
