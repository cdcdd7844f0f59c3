"""The emulated NIC's inbox: where peers append the immediates of their writes to one engine.

One inbox per engine: a memfd shared with peers by `pidfd_getfd`, so no file in /dev/shm can outlive its
process. One ring per sender (claimed at `connect` under a POSIX lock on the file): a sequence word
written by the sender after the slot, the slots (imm, release time), and an `acked` word written back by
the receiver. One "something new" word, raised by host senders, lets an idle poll cost one load (a CUDA
receiver compares the sequence words instead, one numpy pass).

Layout. Header (64 B): magic, version, rings, slots per ring, next unclaimed ring (u32 each). Then one
line with the "new" word, then int64 words seq[rings], acked[rings] (each array 64 B aligned), then the
rings: slots of (imm as u64, release time in monotonic ns as u64; 0: at once). Words the GPU writes are
int64 whose low 32 bits it writes (little-endian), so the host reads every word the same way.

`Inbox` is the receiver's side, `Ring` a sender's; `emulated.EmulatedCarrier` drives both.
"""
from __future__ import annotations

import ctypes
import fcntl
import heapq
import mmap
import os
import struct
import time

import numpy as np

from ..protocol import host_atomics
from ..protocol.memory import fd_from_process

_M32 = 0xFFFFFFFF
_PAGE = mmap.PAGESIZE
_MAGIC, _VERSION = 0x434E4D45, 1  # "EMNC"
_HEAD = struct.Struct("<5I")
SLOT = struct.Struct("<QQ")
_NEW_OFF = 64
_SEQ_OFF = 128
now_ns = time.monotonic_ns  # CLOCK_MONOTONIC: one clock for every process of the host


def _round64(n: int) -> int:
    return -(-n // 64) * 64


def _inbox_layout(rings: int, slots: int) -> tuple[int, int, int, int]:
    """(acked offset, rings offset, bytes per ring, total bytes) of an inbox."""
    acked = _SEQ_OFF + _round64(8 * rings)
    ring0 = acked + _round64(8 * rings)
    per_ring = slots * SLOT.size
    total = -(-(ring0 + rings * per_ring) // _PAGE) * _PAGE
    return acked, ring0, per_ring, total


def mmap_fd(fd: int, nbytes: int, offset: int = 0) -> tuple[mmap.mmap, int, object]:
    """Map [offset, offset + nbytes) of `fd` shared read-write: (mapping, address of byte `offset`, keepalive)."""
    start = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, offset - start + nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    keep = ctypes.c_char.from_buffer(mm)
    return mm, ctypes.addressof(keep) + offset - start, keep


def unmap(mm, keep_attr_owner, attr: str) -> None:
    keep_attr_owner.__dict__.pop(attr, None)
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive: the mapping goes with it


class Inbox:
    """Our inbox (the receiver's side): `poll` counts what peers appended, by exact value, those with a
    release time once it has passed. `scan_always`: compare every ring's sequence word on each poll (CUDA
    senders raise no "new" word); else only when the "new" word changed (and now and then anyway)."""

    def __init__(self, rings: int, slots: int, scan_always: bool) -> None:
        acked, ring0, _, total = _inbox_layout(rings, slots)
        self.fd = os.memfd_create("moe_a2a-emulated-inbox", os.MFD_CLOEXEC)
        self.mm = None
        try:
            os.ftruncate(self.fd, total)
            self.mm, self.addr, self._keep = mmap_fd(self.fd, total)
        except BaseException:
            self.close()
            raise
        _HEAD.pack_into(self.mm, 0, _MAGIC, _VERSION, rings, slots, 0)
        self.nbytes, self._slots, self._mask = total, slots, slots - 1
        self._seq_np = np.frombuffer(self.mm, np.int64, rings, _SEQ_OFF)
        self._seen_np = np.zeros(rings, np.int64)  # immediates consumed per ring (mod 2^32)
        self._acked_addr0 = self.addr + acked
        self._ring0 = ring0
        self._new_addr = self.addr + _NEW_OFF
        self._last_new = 0
        self._quiet = 0
        self._scan_always = scan_always
        self._delayed: list = []  # heap of (release ns, order, imm): seen, not countable yet
        self._order = 0

    def poll(self, counts: dict[int, int]) -> int:
        """Count into `counts` the immediates that are due; returns how many."""
        handled = 0
        new = host_atomics.load_acquire(self._new_addr)
        self._quiet += 1
        if self._scan_always or new != self._last_new or self._quiet > 4096:
            self._last_new, self._quiet = new, 0
            handled += self._scan(counts)
        if self._delayed:
            handled += self._release_delayed(counts)
        return handled

    def _scan(self, counts: dict[int, int]) -> int:
        changed = np.flatnonzero(self._seq_np != self._seen_np)
        if not len(changed):
            return 0
        mm, load, store = self.mm, host_atomics.load_acquire, host_atomics.store_release
        unpack, size, mask, slots = SLOT.unpack_from, SLOT.size, self._mask, self._slots
        handled, now = 0, None
        for ring in changed.tolist():
            seq = load(self.addr + _SEQ_OFF + 8 * ring) & _M32
            seen = int(self._seen_np[ring])
            n = (seq - seen) & _M32
            base = self._ring0 + ring * slots * size
            for k in range(n):
                imm, release = unpack(mm, base + size * ((seen + k) & mask))
                imm &= _M32
                if release:
                    now = now_ns() if now is None else now
                    if release > now:
                        self._order += 1
                        heapq.heappush(self._delayed, (release, self._order, imm))
                        continue
                counts[imm] = counts.get(imm, 0) + 1
                handled += 1
            self._seen_np[ring] = seq
            store(self._acked_addr0 + 8 * ring, seq)  # after reading the slots: they may be reused
        return handled

    def _release_delayed(self, counts: dict[int, int]) -> int:
        now, heap, n = now_ns(), self._delayed, 0
        while heap and heap[0][0] <= now:
            imm = heapq.heappop(heap)[2]
            counts[imm] = counts.get(imm, 0) + 1
            n += 1
        return n

    def close(self) -> None:
        self.__dict__.pop("_seq_np", None)
        if self.mm is not None:
            unmap(self.mm, self, "_keep")
            self.mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Ring:
    """Our ring in a peer's inbox (a sender's side): `pid` and `inbox_fd` name the peer's inbox, which is
    mapped here from its FD (`pidfd_getfd`); `label` names the peer in messages."""

    def __init__(self, pid: int, inbox_fd: int, inbox_bytes: int, label: str) -> None:
        fd = fd_from_process(pid, inbox_fd)
        try:
            self.mm, self.addr, self._keep = mmap_fd(fd, inbox_bytes)
            magic, version, rings, slots, _ = _HEAD.unpack_from(self.mm, 0)
            if (magic, version) != (_MAGIC, _VERSION):
                raise ValueError(f"connect: {label} is not an emulated NIC inbox (magic {magic:#x}, version {version})")
            # Claim the next free ring: a POSIX record lock on the file excludes the other senders.
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                index = _HEAD.unpack_from(self.mm, 0)[4]
                if index >= rings:
                    raise ValueError(f"connect: the inbox of {label} has {rings} rings, all claimed (more "
                                     f"senders than the engine's max_senders)")
                struct.pack_into("<I", self.mm, 16, index + 1)
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            if hasattr(self, "mm"):
                unmap(self.mm, self, "_keep")
            raise
        os.close(fd)
        acked_off, ring0, per_ring, _ = _inbox_layout(rings, slots)
        self.pid = pid
        self.index, self.slots, self.mask = index, slots, slots - 1
        self.slot_off = ring0 + index * per_ring
        self.seq_addr = self.addr + _SEQ_OFF + 8 * index
        self.acked_addr = self.addr + acked_off + 8 * index
        self.new_addr = self.addr + _NEW_OFF
        self.seq = 0  # immediates appended so far (unbounded here, modulo 2^32 in the word)
        self.acked = 0  # the receiver's last acked count we read
        self.dev_seq = None  # device pointer of the sequence word (CUDA carrier)
        self._registered = False

    def room(self) -> bool:
        """Whether a slot is free (re-reading the receiver's acked word only when our copy says full)."""
        if self.seq - self.acked < self.slots:
            return True
        acked = host_atomics.load_acquire(self.acked_addr) & _M32
        self.acked = self.seq - ((self.seq - acked) & _M32)
        return self.seq - self.acked < self.slots

    def append(self, imm: int, release: int) -> None:
        """Write the next slot (there must be room); the caller publishes it (the sequence word)."""
        SLOT.pack_into(self.mm, self.slot_off + SLOT.size * (self.seq & self.mask), imm, release)
        self.seq += 1

    def publish(self) -> None:
        """Host sender: the sequence word (after the data and the slot: whoever sees it sees them), then the
        receiver's "new" word (never 0, its initial value)."""
        seq = self.seq & _M32
        host_atomics.store_release(self.seq_addr, seq)
        host_atomics.store_release(self.new_addr, (((self.index + 1) & 0xFFF) << 20) | (seq & 0xFFFFF))

    def map_for_device(self, cu, drv) -> None:
        """Register the peer's inbox with CUDA here, so a stream can write our sequence word."""
        size = len(self.mm)
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        drv(cu.cuMemHostRegister(self.addr, size, flags), f"cuMemHostRegister(inbox, {size} B)")
        self._registered = True
        base = int(drv(cu.cuMemHostGetDevicePointer(self.addr, 0), "cuMemHostGetDevicePointer(inbox)"))
        self.dev_seq = base + (self.seq_addr - self.addr)

    def close(self) -> None:
        if self._registered:
            from cuda.bindings import driver as cu

            cu.cuMemHostUnregister(self.addr)
            self._registered = False
        if self.mm is not None:
            unmap(self.mm, self, "_keep")
            self.mm = None
