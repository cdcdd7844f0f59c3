"""EmulatedEngine: the proxy's NIC emulated between processes of one host. An instrument, not a network.

`transport="emulated"` runs the cross-node protocol between simulated nodes of one host (`node_group`,
`LocalCluster(node_size=...)`) through the same proxy code as a real NIC: the same descriptors, posts,
immediates counted by exact value by the receiving proxy, and local completions. Only the carrier
differs: a write is a copy between the two ranks' buffers, and its immediate is appended to the
receiving proxy's inbox only once the copy has completed. docs/transport.md, "The emulated NIC".

- **Inbox** (one per engine): a memfd shared with peers by `pidfd_getfd`, so no file in /dev/shm can
  outlive its process. One ring per sender (claimed at `connect` under a POSIX lock on the file): a
  sequence word written by the sender after the slot, the slots (imm, release time), and an `acked`
  word written back by the receiver. One "something new" word, raised by host senders, lets an idle
  `progress` cost one load (a CUDA receiver compares the sequence words instead, one numpy pass).
- **Carriers.** "host": buffers in host memory (the rank's segment, memfd buffers), mapped here from
  the owner's file descriptor; a write is `ctypes.memmove`, then the slot, then a release store of the
  sequence word. "cuda": buffers are cuMem allocations (`NicPlacement`), imported here from their
  POSIX FDs and mapped once at `peer_group`; a write is `cuMemcpyAsync` on the engine's one stream
  (one stream = one NIC), then `cuStreamWriteValue32` of the ring's sequence word into the
  receiver's inbox (host memory registered here with `cuMemHostRegister`): the stream orders it after
  the copy, with a system-wide fence before it; the slot itself was written by the host before the
  copy was queued. Local completion: an event per post.
- **NIC settings** (`MOE_A2A_EMULATED_NIC`, e.g. "12us,25GBps"): the sender keeps the NIC's schedule on
  the host clock (a write of b bytes occupies it for b / bandwidth after the previous one) and stamps
  each slot with its release time, schedule end + latency. The receiver counts an immediate only once
  that time has passed (and the copy has landed), so latencies of different writes overlap as on a
  NIC, and local completion comes at the same time. Nothing else of a NIC is modelled.

Never imports torch (the proxy process uses it); `cuda.bindings` only with the CUDA carrier.
"""
from __future__ import annotations

import ctypes
import fcntl
import heapq
import mmap
import os
import re
import secrets
import struct
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from ..protocol import host_atomics
from .engine import ACCESS_SOURCE_AND_TARGET, ACCESS_TARGET, ImmediateCounts, PeerTimeout
from ..protocol.memory import CuMemBuffer, MemfdBuffer, fd_buffer_at, fd_from_process

PROVIDER = "emulated"
NIC_ENV = "MOE_A2A_EMULATED_NIC"

_M32 = 0xFFFFFFFF
_IMM_MASK = _M32
_ACCESS_ALLOWED = ACCESS_SOURCE_AND_TARGET
_PAGE = mmap.PAGESIZE
_sched_yield = os.sched_yield
_now_ns = time.monotonic_ns  # CLOCK_MONOTONIC: one clock for every process of the host


# ---- NIC settings -----------------------------------------------------------------------------------
_LATENCY_UNITS = {"ns": 1, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9}  # in ns
# Bytes per second; a lower-case b is bits (Gbps = gigabits per second).
_BANDWIDTH_UNITS = {"Bps": 1.0, "B/s": 1.0, "KBps": 1e3, "KB/s": 1e3, "MBps": 1e6, "MB/s": 1e6,
                    "GBps": 1e9, "GB/s": 1e9, "Gbps": 1e9 / 8, "Gbit/s": 1e9 / 8}
_TOKEN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]+)\s*$")


@dataclass(frozen=True)
class NicSettings:
    """What the emulated NIC adds to a bare copy: a one-way latency per write (whole nanoseconds) and a
    bandwidth cap per NIC (whole bytes per second, None: none). `NicSettings()` is full speed."""

    latency_ns: int = 0
    bandwidth_Bps: int | None = None

    @property
    def latency_s(self) -> float:
        return self.latency_ns / 1e9

    @property
    def full_speed(self) -> bool:
        return self.latency_ns == 0 and self.bandwidth_Bps is None

    def __str__(self) -> str:
        """The canonical text (what `parse_nic_settings` reads back exactly): e.g. "12us,25GBps", or "0"."""
        if self.full_speed:
            return "0"
        parts = []
        if self.latency_ns:
            parts.append(_exact(self.latency_ns, (("s", 10**9), ("ms", 10**6), ("us", 10**3), ("ns", 1))))
        if self.bandwidth_Bps is not None:
            parts.append(_exact(self.bandwidth_Bps, (("GBps", 10**9), ("MBps", 10**6), ("KBps", 10**3), ("Bps", 1))))
        return ",".join(parts)

    def describe(self) -> str:
        if self.full_speed:
            return "full speed (no latency or bandwidth cap added)"
        parts = []
        if self.latency_ns:
            parts.append(f"latency {self.latency_ns / 1e3:g} µs per write")
        if self.bandwidth_Bps is not None:
            parts.append(f"bandwidth {self.bandwidth_Bps / 1e9:g} GB/s per NIC")
        return ", ".join(parts)


def _exact(value: int, units) -> str:
    """`value` in the largest unit that divides it (units: (name, size), largest first)."""
    for name, size in units:
        if value % size == 0:
            return f"{value // size}{name}"
    raise AssertionError("the last unit has size 1")


def parse_nic_settings(text: str | None, name: str = NIC_ENV) -> NicSettings:
    """`"12us,25GBps"` (any order, either part optional) -> NicSettings; None, "", "0", "off": full
    speed. ValueError naming `name` for anything else."""
    if text is None or text.strip().lower() in ("", "0", "off", "none"):
        return NicSettings()
    latency, bandwidth = None, None
    for token in text.split(","):
        m = _TOKEN.match(token)
        why = None
        if not m:
            why = f"cannot read {token.strip()!r}"
        else:
            value, unit = float(m.group(1)), m.group(2)
            if unit in _LATENCY_UNITS:
                if latency is not None:
                    why = "two latencies"
                latency = round(value * _LATENCY_UNITS[unit])  # whole ns
            elif unit in _BANDWIDTH_UNITS:
                if bandwidth is not None:
                    why = "two bandwidths"
                bandwidth = round(value * _BANDWIDTH_UNITS[unit])  # whole bytes per second
                if bandwidth <= 0:
                    why = f"bandwidth {token.strip()!r} must be at least 1 B/s"
            else:
                why = f"unknown unit {unit!r} in {token.strip()!r}"
        if why:
            raise ValueError(f"{name}={text!r}: {why}; expected a latency and/or a per-NIC bandwidth such as "
                             f"'12us,25GBps' (latency units {', '.join(_LATENCY_UNITS)}; bandwidth units "
                             f"{', '.join(_BANDWIDTH_UNITS)}), or '0' for full speed")
    return NicSettings(latency or 0, bandwidth)


def nic_settings_from_env(environ=None) -> NicSettings:
    """`MOE_A2A_EMULATED_NIC` of `environ` (default os.environ), parsed. Read by the model process when
    it builds an AllToAll (never at import)."""
    return parse_nic_settings((os.environ if environ is None else environ).get(NIC_ENV))


# ---- the inbox: where peers append immediates for this engine ------------------------------------
# Header (64 B): magic, version, rings, slots per ring, next unclaimed ring (u32 each). Then one line
# with the "new" word, then int64 words seq[rings], acked[rings] (each array 64 B aligned), then the
# rings: slots of (imm as u64, release time in monotonic ns as u64). Words the GPU writes are int64
# whose low 32 bits it writes (little-endian), so the host reads every word the same way.
_MAGIC, _VERSION = 0x434E4D45, 1  # "EMNC"
_HEAD = struct.Struct("<5I")
_SLOT = struct.Struct("<QQ")
_NEW_OFF = 64
_SEQ_OFF = 128


def _round64(n: int) -> int:
    return -(-n // 64) * 64


def _inbox_layout(rings: int, slots: int) -> tuple[int, int, int, int]:
    """(acked offset, rings offset, bytes per ring, total bytes) of an inbox."""
    acked = _SEQ_OFF + _round64(8 * rings)
    ring0 = acked + _round64(8 * rings)
    per_ring = slots * _SLOT.size
    total = -(-(ring0 + rings * per_ring) // _PAGE) * _PAGE
    return acked, ring0, per_ring, total


def _mmap_fd(fd: int, nbytes: int, offset: int = 0) -> tuple[mmap.mmap, int, object]:
    """Map [offset, offset + nbytes) of `fd` shared read-write: (mapping, address of byte `offset`, keepalive)."""
    start = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, offset - start + nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    keep = ctypes.c_char.from_buffer(mm)
    return mm, ctypes.addressof(keep) + offset - start, keep


def _unmap(mm, keep_attr_owner, attr: str) -> None:
    keep_attr_owner.__dict__.pop(attr, None)
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive: the mapping goes with it


class _Mapping:
    """[offset, offset + nbytes) of a peer's file, mapped here."""

    def __init__(self, fd: int, nbytes: int, offset: int) -> None:
        self.mm, self.addr, self._keep = _mmap_fd(fd, nbytes, offset)

    def close(self) -> None:
        if self.mm is not None:
            _unmap(self.mm, self, "_keep")
            self.mm = None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class EmulatedAddress:
    """Picklable address of an EmulatedEngine: the process and inbox FD a peer takes with pidfd_getfd."""

    provider: str
    pid: int
    inbox_fd: int
    inbox_bytes: int
    host: str  # boot id: the emulated NIC reaches only processes of this host
    token: str  # this engine, among engines that reused the pid and FD number

    def __str__(self) -> str:
        return f"emulated:pid{self.pid}"


@dataclass(frozen=True)
class EmulatedRegion:
    """Picklable descriptor of a registered buffer: what a peer needs to map it. `kind` "host": `fd` is a
    file (memfd, /dev/shm segment) of process `pid` and the buffer is at `offset` in it; "cuda": `fd` is
    a cuMem allocation's POSIX FD of `size` bytes on device `ordinal`, the buffer at `offset` in it."""

    provider: str
    kind: str
    pid: int
    fd: int = field(repr=False)
    nbytes: int
    offset: int
    size: int
    ordinal: int | None
    host: str


class EmulatedLocalRegion:
    """A buffer registered with an EmulatedEngine (`addr`, `nbytes`, `access`)."""

    def __init__(self, engine: "EmulatedEngine", addr: int, nbytes: int, access: int, kind: str,
                 backing: tuple | None, closers: list) -> None:
        self.addr, self.nbytes, self.access, self.kind = addr, nbytes, access, kind
        self._engine, self._backing, self._closers, self._open = engine, backing, closers, True

    def descriptor(self) -> EmulatedRegion:
        """What a peer needs to write into this buffer (picklable). Refused for a source-only region."""
        if not self.access & ACCESS_TARGET or self._backing is None:
            raise ValueError("descriptor: this region was registered without FI_REMOTE_WRITE (a local "
                             "source only); peers cannot write into it")
        fd, offset, size, ordinal = self._backing
        eng = self._engine
        return EmulatedRegion(PROVIDER, self.kind, os.getpid(), fd, self.nbytes, offset, size, ordinal, eng._host)

    def close(self) -> None:
        """Release (idempotent). No write from or into this buffer may be in flight."""
        if not self._open:
            return
        self._open = False
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            close()
        if self in self._engine._regions:
            self._engine._regions.remove(self)


class _Ring:
    """Our ring in a peer's inbox: the sender's side of its immediates."""

    def __init__(self, engine: "EmulatedEngine", address: EmulatedAddress) -> None:
        fd = fd_from_process(address.pid, address.inbox_fd)
        try:
            self.mm, self.addr, self._keep = _mmap_fd(fd, address.inbox_bytes)
            magic, version, rings, slots, _ = _HEAD.unpack_from(self.mm, 0)
            if (magic, version) != (_MAGIC, _VERSION):
                raise ValueError(f"connect: {address} is not an emulated NIC inbox (magic {magic:#x}, version {version})")
            # Claim the next free ring: a POSIX record lock on the file excludes the other senders.
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                index = _HEAD.unpack_from(self.mm, 0)[4]
                if index >= rings:
                    raise ValueError(f"connect: the inbox of {address} has {rings} rings, all claimed (more "
                                     f"senders than the engine's max_senders)")
                struct.pack_into("<I", self.mm, 16, index + 1)
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            if hasattr(self, "mm"):
                _unmap(self.mm, self, "_keep")
            raise
        os.close(fd)
        acked_off, ring0, per_ring, _ = _inbox_layout(rings, slots)
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

    def close(self) -> None:
        if self._registered:
            from cuda.bindings import driver as cu

            cu.cuMemHostUnregister(self.addr)
            self._registered = False
        if self.mm is not None:
            _unmap(self.mm, self, "_keep")
            self.mm = None


@dataclass(frozen=True)
class EmulatedPeer:
    """A connected engine: its address and our ring in its inbox."""

    index: int
    address: EmulatedAddress
    ring: _Ring = field(repr=False, compare=False)

    def __str__(self) -> str:
        return f"peer#{self.index}({self.address})"


class EmulatedPeerGroup:
    """Peers with one mapped remote region each; position i is the `peer_index` of targets."""

    def __init__(self, engine: "EmulatedEngine", peers: Sequence[EmulatedPeer], regions: Sequence[EmulatedRegion],
                 dst_addr: Sequence[int]) -> None:
        self.peers, self.regions = tuple(peers), tuple(regions)
        self.remote_nbytes = tuple(r.nbytes for r in regions)
        self.dst_addr = tuple(dst_addr)
        self.rings = tuple(p.ring for p in peers)
        self.barrier_targets = tuple((i, 0, 0, 0) for i in range(len(peers)))
        self._engine = engine

    def __len__(self) -> int:
        return len(self.peers)


# ---- where a registered buffer lives (what a peer maps) ------------------------------------------
def _host_backing(addr: int, nbytes: int) -> tuple[int, int, int]:
    """(an FD of ours, offset, file size) of the shared file mapping that holds [addr, addr+nbytes): a
    live MemfdBuffer of this process, else the mapping found in /proc/self/maps (a /dev/shm file opened
    by name, or a file one of our FDs holds)."""
    buf = fd_buffer_at(addr, nbytes)
    if isinstance(buf, MemfdBuffer):
        return os.dup(buf.fd), addr - buf.addr, buf.size
    with open("/proc/self/maps") as f:
        maps = [line.split(maxsplit=5) for line in f]
    where = f"host memory [{addr:#x}, +{nbytes})"
    found = None
    for i, parts in enumerate(maps):
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= addr < hi:
            found = i
            break
    if found is None:
        raise ValueError(f"register: {where} is not mapped in this process")
    parts = maps[found]
    lo, hi = (int(x, 16) for x in parts[0].split("-"))
    perms, offset, dev, inode = parts[1], int(parts[2], 16), parts[3], int(parts[4])
    path = parts[5].strip() if len(parts) > 5 else ""
    if "s" not in perms or inode == 0:
        raise ValueError(f"register: {where} is not a shared file mapping (a /dev/shm segment or a memfd): "
                         f"peers of the emulated NIC cannot map it ({perms} {path or 'anonymous'})")
    end, j = hi, found
    while end < addr + nbytes:  # the range may span consecutive mappings of the same file
        j += 1
        nxt = maps[j] if j < len(maps) else None
        nlo, nhi = (int(x, 16) for x in nxt[0].split("-")) if nxt else (0, 0)
        if nxt is None or nlo != end or int(nxt[4]) != inode or int(nxt[2], 16) != offset + (end - lo):
            raise ValueError(f"register: {where} is not one contiguous mapping of one file")
        end = nhi
    major, minor = (int(x, 16) for x in dev.split(":"))

    def same(st) -> bool:
        return st.st_ino == inode and os.major(st.st_dev) == major and os.minor(st.st_dev) == minor

    fd = None
    if path.startswith("/") and not path.endswith(" (deleted)"):
        try:
            fd = os.open(path, os.O_RDWR)
            if not same(os.fstat(fd)):
                os.close(fd)
                fd = None
        except OSError:
            fd = None
    if fd is None:
        for name in os.listdir("/proc/self/fd"):
            try:
                if same(os.stat(f"/proc/self/fd/{name}")):
                    fd = os.dup(int(name))
                    break
            except OSError:
                continue
    if fd is None:
        raise ValueError(f"register: {where} maps {path or 'a file'} that no FD of this process holds: peers "
                         f"of the emulated NIC cannot map it")
    return fd, offset + (addr - lo), os.fstat(fd).st_size


def _cuda_backing(addr: int, nbytes: int) -> tuple[int, int, int, int]:
    """(an FD of ours, offset, allocation size, ordinal) of the cuMem allocation holding [addr, addr+nbytes)."""
    buf = fd_buffer_at(addr, nbytes)
    if not isinstance(buf, CuMemBuffer):
        raise ValueError(f"register: GPU memory [{addr:#x}, +{nbytes}) is not a live CuMemBuffer of this process "
                         f"(the emulated NIC maps peers' GPU buffers from their cuMem POSIX FDs)")
    return os.dup(buf.fd), addr - buf.addr, buf.size, buf.ordinal


# ---- the engine -----------------------------------------------------------------------------------
class EmulatedEngine(ImmediateCounts):
    """The subset of `TransferEngine` that `worker.Proxy` uses, carried by copies on one host.

    Args:
        cuda_device: CUDA ordinal of the CUDA carrier (GPU buffers, copies on one stream); None: the host
            carrier (host buffers, `memmove`).
        nic: latency and bandwidth added to each write (`NicSettings()`: none).
        max_senders: rings in our inbox: how many engines may `connect` to this one.
        ring_slots: immediates a sender may have appended that we have not consumed yet (a power of 2);
            a sender whose ring is full progresses until we consume (`PeerTimeout` after `timeout_s`).
        timeout_s: bound on every internal wait.
        idle_yield: `sched_yield()` after a wait's poll that found nothing (more processes than cores).
    """

    provider = provider_name = PROVIDER
    num_domains = 1

    def __init__(self, *, cuda_device: int | None = None, nic: NicSettings | None = None, max_senders: int = 256,
                 ring_slots: int = 1024, timeout_s: float = 30.0, idle_yield: bool = False) -> None:
        if max_senders < 1 or ring_slots < 2 or ring_slots & (ring_slots - 1):
            raise ValueError(f"max_senders must be >= 1 and ring_slots a power of 2 >= 2, got {max_senders}, {ring_slots}")
        self.nic = nic or NicSettings()
        self.carrier = "host" if cuda_device is None else "cuda"
        self.cuda_device = cuda_device
        self.timeout_s, self.idle_yield = timeout_s, idle_yield
        self._closed = False
        self._host = _boot_id()
        self._regions: list[EmulatedLocalRegion] = []
        self._peers: dict[EmulatedAddress, EmulatedPeer] = {}
        self._mapped: dict[tuple, tuple[int, object]] = {}  # remote region key -> (address of byte 0, closer)
        self._imm_counts: dict[int, int] = {}
        self._delayed: list = []  # heap of (release ns, order, imm): seen, not countable yet
        self._order = 0
        self._done: deque = deque()  # [event or None, writes, done at ns] per post, oldest first
        self._pending = 0
        self._nic_free_ns = 0
        self._lat_ns = self.nic.latency_ns
        self._ns_per_byte = None if self.nic.bandwidth_Bps is None else 1e9 / self.nic.bandwidth_Bps
        self._paced = not self.nic.full_speed
        self.writes_posted = 0  # totals, for tests and benchmarks (the names TransferEngine uses)
        self.writes_completed = 0
        self.imms_received = 0
        self.eagain_retries = 0  # never: kept for the callers that read it
        self.slot_waits = 0  # posts that waited for room in a peer's ring
        self._cu = None
        self._stream = None
        self._events: list = []
        self._inbox_fd = None
        self._inbox_mm = None
        try:
            if cuda_device is not None:
                self._cuda_init(cuda_device)
            self._inbox_init(max_senders, ring_slots)
        except BaseException:
            self.close()
            raise
        self.address = EmulatedAddress(PROVIDER, os.getpid(), self._inbox_fd, self._inbox_bytes, self._host,
                                       secrets.token_hex(8))

    # ---- set-up ---------------------------------------------------------------------------------
    def _cuda_init(self, ordinal: int) -> None:
        from cuda.bindings import driver as cu

        from ..protocol.memory import _drv, cuda_primary_context

        cuda_primary_context(ordinal)
        self._cu, self._drv = cu, _drv
        self._ok = cu.CUresult.CUDA_SUCCESS
        self._not_ready = cu.CUresult.CUDA_ERROR_NOT_READY
        self._stream = _drv(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        # Bound once: the calls of the posting loop.
        self._memcpy, self._write32 = cu.cuMemcpyAsync, cu.cuStreamWriteValue32

    def _inbox_init(self, rings: int, slots: int) -> None:
        acked, ring0, _, total = _inbox_layout(rings, slots)
        self._inbox_fd = os.memfd_create("moe_a2a-emulated-inbox", os.MFD_CLOEXEC)
        os.ftruncate(self._inbox_fd, total)
        self._inbox_mm, self._inbox_addr, self._inbox_keep = _mmap_fd(self._inbox_fd, total)
        _HEAD.pack_into(self._inbox_mm, 0, _MAGIC, _VERSION, rings, slots, 0)
        self._inbox_bytes, self._rings, self._slots, self._mask = total, rings, slots, slots - 1
        mm = self._inbox_mm
        self._seq_np = np.frombuffer(mm, np.int64, rings, _SEQ_OFF)
        self._seen_np = np.zeros(rings, np.int64)  # immediates consumed per ring (mod 2^32)
        self._acked_addr0 = self._inbox_addr + acked
        self._ring0 = ring0
        self._new_addr = self._inbox_addr + _NEW_OFF
        self._last_new = 0
        self._quiet = 0
        self._scan_always = self.carrier == "cuda"

    # ---- memory ---------------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, access: int = ACCESS_SOURCE_AND_TARGET, *,
                 dmabuf_fd: int | None = None, cuda_device: int | None = None,
                 max_write_bytes: int | None = None) -> EmulatedLocalRegion:
        """Register [addr, addr+nbytes). A region peers write into (`ACCESS_TARGET`) must be a shared file
        mapping (host) or a live CuMemBuffer (`cuda_device` set, CUDA carrier only): its descriptor lets a
        peer's engine map it. `max_write_bytes` is `TransferEngine.register`'s (the overlap of chunks): the
        emulated NIC maps whole buffers and has no limit on a registration, so it is not used."""
        self._check_open()
        if nbytes <= 0 or addr <= 0:
            raise ValueError(f"register: need addr > 0 and nbytes > 0, got addr={addr:#x} nbytes={nbytes}")
        if not isinstance(access, int) or not access or access & ~_ACCESS_ALLOWED:
            raise ValueError(f"register: access must be ACCESS_SOURCE, ACCESS_TARGET or both, got {access!r}")
        if dmabuf_fd is not None:
            raise ValueError("register: the emulated NIC takes no DMA-BUF (GPU memory comes as cuMem buffers)")
        kind = "host" if cuda_device is None else "cuda"
        if kind == "cuda" and self.carrier != "cuda":
            raise ValueError("register: GPU memory needs the emulated NIC's CUDA carrier (EmulatedEngine(cuda_device=...))")
        closers: list = []
        backing = None
        try:
            if access & ACCESS_TARGET:
                if kind == "host":
                    fd, offset, size = _host_backing(addr, nbytes)
                    backing = (fd, offset, size, None)
                else:
                    backing = _cuda_backing(addr, nbytes)
                closers.append(lambda fd=backing[0]: os.close(fd))
            if kind == "host" and self.carrier == "cuda":
                closers.append(self._pin(addr, nbytes))  # asynchronous copies from and to it
        except BaseException:
            for close in reversed(closers):
                close()
            raise
        region = EmulatedLocalRegion(self, addr, nbytes, access, kind, backing, closers)
        self._regions.append(region)
        return region

    def _pin(self, addr: int, nbytes: int):
        """cuMemHostRegister the pages of [addr, addr+nbytes) (portable, device-mapped); returns the undo."""
        cu = self._cu
        lo = addr // _PAGE * _PAGE
        size = -(-(addr + nbytes - lo) // _PAGE) * _PAGE
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        (err,) = cu.cuMemHostRegister(lo, size, flags)
        if err == cu.CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
            return lambda: None  # another registration of ours covers it
        self._drv((err,), f"cuMemHostRegister({size} B)")
        return lambda: cu.cuMemHostUnregister(lo)

    # ---- peers ----------------------------------------------------------------------------------
    def connect(self, addresses: Iterable[EmulatedAddress]) -> list[EmulatedPeer]:
        """Map each engine's inbox and claim our ring in it (cached: the same peer twice is one)."""
        self._check_open()
        out = []
        for a in addresses:
            if not isinstance(a, EmulatedAddress):
                raise ValueError(f"connect: expected EmulatedAddress, got {type(a).__name__}")
            if a.host != self._host:
                raise ValueError(f"connect: {a} runs on another host: the emulated NIC reaches only processes "
                                 f"of this host")
            peer = self._peers.get(a)
            if peer is None:
                ring = _Ring(self, a)
                if self.carrier == "cuda":
                    self._device_words(ring)
                peer = EmulatedPeer(len(self._peers), a, ring)
                self._peers[a] = peer
            out.append(peer)
        return out

    def _device_words(self, ring: _Ring) -> None:
        """Register a peer's inbox with CUDA here, so our stream can write its words."""
        cu, drv = self._cu, self._drv
        size = len(ring.mm)
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        drv(cu.cuMemHostRegister(ring.addr, size, flags), f"cuMemHostRegister(inbox, {size} B)")
        ring._registered = True
        base = int(drv(cu.cuMemHostGetDevicePointer(ring.addr, 0), "cuMemHostGetDevicePointer(inbox)"))
        ring.dev_seq = base + (ring.seq_addr - ring.addr)

    def peer_group(self, peers: Sequence[EmulatedPeer], remote_regions: Sequence[EmulatedRegion]) -> EmulatedPeerGroup:
        """Peers with the region each one's writes land in, mapped here once (a region in several groups
        is mapped once)."""
        self._check_open()
        if len(peers) != len(remote_regions) or not peers:
            raise ValueError(f"peer_group: need one remote region per peer and at least one peer, got "
                             f"{len(peers)} peers and {len(remote_regions)} regions")
        addrs = []
        for i, (p, r) in enumerate(zip(peers, remote_regions)):
            if not isinstance(p, EmulatedPeer) or self._peers.get(p.address) is not p:
                raise ValueError(f"peer_group: position {i}: {p!r} is not a peer of this engine (use engine.connect)")
            if not isinstance(r, EmulatedRegion) or r.provider != PROVIDER:
                raise ValueError(f"peer_group: position {i}: expected an EmulatedRegion, got {type(r).__name__}")
            if r.pid != p.address.pid:
                raise ValueError(f"peer_group: position {i}: the region belongs to pid {r.pid}, not to {p}")
            addrs.append(self._map(r, i))
        return EmulatedPeerGroup(self, peers, remote_regions, addrs)

    def _map(self, r: EmulatedRegion, position: int) -> int:
        key = (r.pid, r.fd, r.kind, r.offset, r.nbytes, r.size)
        hit = self._mapped.get(key)
        if hit is not None:
            return hit[0]
        if r.kind == "cuda" and self.carrier != "cuda":
            raise ValueError(f"peer_group: position {position}: a GPU region needs the CUDA carrier "
                             f"(EmulatedEngine(cuda_device=...))")
        fd = fd_from_process(r.pid, r.fd)
        if r.kind == "cuda":
            try:  # the FD is the buffer's now (closed with it); mapped with access for our device
                buf = CuMemBuffer(r.size, self.cuda_device, fd=fd)
            except BaseException as exc:
                os.close(fd)
                raise RuntimeError(f"peer_group: position {position}: mapping the GPU buffer of pid {r.pid} "
                                   f"(device {r.ordinal}) on device {self.cuda_device}: {exc}") from exc
            self._mapped[key] = (buf.addr + r.offset, buf.close)
            return buf.addr + r.offset
        try:
            mapping = _Mapping(fd, r.nbytes, r.offset)
        finally:
            os.close(fd)  # the mapping stays
        self._mapped[key] = (mapping.addr, mapping.close)
        return mapping.addr

    # ---- posting --------------------------------------------------------------------------------
    def scatter(self, grp: EmulatedPeerGroup, src: EmulatedLocalRegion,
                targets: Sequence[tuple[int, int, int, int]] | np.ndarray, imm: int | Sequence[int]) -> None:
        """One write per target `(peer_index, src_offset, length, dst_offset)` (bytes; TransferEngine's
        semantics: one source range each), each with `imm` (one for all, or one per target)."""
        if isinstance(targets, np.ndarray):
            if targets.ndim != 2 or targets.shape[1] != 4 or targets.dtype.kind not in "iu":
                raise ValueError(f"scatter targets: expected an integer [n, 4] array, got {targets.dtype} {targets.shape}")
            targets = targets.tolist()
        if isinstance(imm, int):
            imms = repeat(imm)
        else:
            if len(imm) != len(targets):
                raise ValueError(f"scatter: {len(imm)} imms for {len(targets)} targets")
            imms = imm
        self.post(grp, src, [(p, so, n, do, v) for (p, so, n, do), v in zip(targets, imms)])

    def post(self, grp: EmulatedPeerGroup, src: EmulatedLocalRegion, writes) -> None:
        """One write per `(position, src_offset, length, dst_offset, imm)` (an integer [n, 5] array too).
        Everything is validated before anything is posted (ValueError). Returns
        once every write is posted (host carrier: done; CUDA: queued on the stream)."""
        self._check_open()
        if isinstance(writes, np.ndarray):
            if writes.ndim != 2 or writes.shape[1] != 5 or writes.dtype.kind not in "iu":
                raise ValueError(f"post writes: expected an integer [n, 5] array, got {writes.dtype} {writes.shape}")
            writes = writes.tolist()
        if not writes:
            return
        self._validate(grp, src, writes)
        if self.carrier == "cuda":
            self._post_cuda(grp, src.addr if src is not None else 0, writes)
        else:
            self._post_host(grp, src.addr if src is not None else 0, writes)

    def post_table(self, grp: EmulatedPeerGroup, src: EmulatedLocalRegion, words, slots: Sequence[tuple[int, int]],
                   src_base: int = 0, dst_base: int = 0, imm: int | None = None,
                   skip_empty: bool = False) -> int:
        """`TransferEngine.post_table`: one write per `(peer_index, word index)` slot of a write table whose
        rows are int64 `(src_offset, length, dst_offset, imm)` relative to `src_base` / `dst_base`; `imm`
        replaces the rows' immediates, `skip_empty` drops rows of length 0. Returns the writes posted."""
        writes = []
        for p, b in slots:
            so, length, do, v = words[b], words[b + 1], words[b + 2], words[b + 3]
            if skip_empty and not length:
                continue
            writes.append((p, so + src_base, length, do + dst_base, v if imm is None else imm))
        self.post(grp, src, writes)
        return len(writes)

    def _validate(self, grp, src, writes) -> None:
        if not isinstance(grp, EmulatedPeerGroup) or grp._engine is not self:
            raise ValueError(f"expected a peer group of this engine, got {type(grp).__name__}")
        if src is not None and (not isinstance(src, EmulatedLocalRegion) or src._engine is not self or not src._open):
            raise ValueError(f"src must be an open region of this engine, got {src!r}")
        n_peers, rsize = len(grp.peers), grp.remote_nbytes
        src_n = src.nbytes if src is not None else 0
        for w in writes:
            if len(w) != 5:
                raise ValueError(f"post: write {w!r}: expected (position, src_offset, length, dst_offset, imm)")
            p, so, length, do, v = w
            if (p | so | length | do) < 0 or p >= n_peers or so + length > src_n or do + length > rsize[p]:
                raise ValueError(self._bad_target(grp, src_n, (p, so, length, do)))
            if not 0 <= v <= _IMM_MASK:
                raise ValueError(f"post: imm {v} is not a 32-bit unsigned value")

    @staticmethod
    def _bad_target(grp: EmulatedPeerGroup, src_n: int, t) -> str:
        p, so, length, do = t
        if not 0 <= p < len(grp.peers):
            return f"scatter target {t}: peer index {p} outside the group of {len(grp.peers)} peers"
        return (f"scatter target {t} (peer_index, src_offset, length, dst_offset): source range "
                f"[{so}, {so + length}) of {src_n} B, destination range [{do}, {do + length}) of "
                f"{grp.remote_nbytes[p]} B at {grp.peers[p]}: out of bounds or negative")

    def _release_ns(self, nbytes: int) -> int:
        """When the emulated NIC has delivered a write of `nbytes` posted now (0: at once)."""
        now = _now_ns()
        if self._ns_per_byte is None:
            return now + self._lat_ns
        start = max(now, self._nic_free_ns)
        self._nic_free_ns = finish = start + int(nbytes * self._ns_per_byte)
        return finish + self._lat_ns

    def _slot(self, grp: EmulatedPeerGroup, p: int, imm: int, release: int) -> _Ring:
        """Write the next slot of our ring at peer `p` (waiting for room); the caller publishes it."""
        ring = grp.rings[p]
        if ring.seq - ring.acked >= ring.slots and not ring.room():
            self._wait_room(grp, p)
        _SLOT.pack_into(ring.mm, ring.slot_off + _SLOT.size * (ring.seq & ring.mask), imm, release)
        ring.seq += 1
        return ring

    def _post_host(self, grp, src_addr: int, writes) -> None:
        memmove, store, dst = ctypes.memmove, host_atomics.store_release, grp.dst_addr
        paced = self._paced
        release = 0
        for p, so, length, do, imm in writes:
            if length:
                memmove(dst[p] + do, src_addr + so, length)
            if paced:
                release = self._release_ns(length)
            ring = self._slot(grp, p, imm, release)
            seq = ring.seq & _M32
            store(ring.seq_addr, seq)  # after the data and the slot: whoever sees it sees them
            store(ring.new_addr, (((ring.index + 1) & 0xFFF) << 20) | (seq & 0xFFFFF))  # never 0, the initial value
        self.writes_posted += len(writes)
        if paced:  # complete locally once the NIC has delivered the last one
            self._done.append([None, len(writes), release])
            self._pending += len(writes)
        else:
            self.writes_completed += len(writes)

    def _post_cuda(self, grp, src_addr: int, writes) -> None:
        memcpy, write32, stream, ok, dst = self._memcpy, self._write32, self._stream, self._ok, grp.dst_addr
        paced = self._paced
        release = 0
        for p, so, length, do, imm in writes:
            if length and memcpy(dst[p] + do, src_addr + so, length, stream)[0] != ok:
                self._cuda_failed("cuMemcpyAsync", grp, p)
            if paced:
                release = self._release_ns(length)
            # The slot by the host now; its sequence word by the stream, after the copy (with the
            # default system-wide fence before each stream write): the receiver reads a slot only below it.
            # One stream write per write (a driver call costs µs): no "new" word, a CUDA receiver scans.
            ring = self._slot(grp, p, imm, release)
            if write32(stream, ring.dev_seq, ring.seq & _M32, 0)[0] != ok:
                self._cuda_failed("cuStreamWriteValue32", grp, p)
        event = self._events.pop() if self._events else self._drv(
            self._cu.cuEventCreate(self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING.value), "cuEventCreate")
        self._drv(self._cu.cuEventRecord(event, stream), "cuEventRecord")
        self._done.append([event, len(writes), release])
        self._pending += len(writes)
        self.writes_posted += len(writes)

    def _cuda_failed(self, call: str, grp, p: int) -> None:
        # Re-run nothing: report the stream's sticky error, naming the peer.
        err = self._cu.cuStreamQuery(self._stream)[0]
        raise RuntimeError(f"emulated NIC: {call} to {grp.peers[p]} failed (stream: {err})")

    def _wait_room(self, grp, p: int) -> None:
        """Progress (our own inbox too: two peers that fill each other's rings both drain) until peer `p`
        has consumed an immediate of ours."""
        self.slot_waits += 1
        ring = grp.rings[p]
        deadline = time.monotonic() + self.timeout_s
        while not ring.room():
            self._idle_progress()
            if time.monotonic() > deadline:
                raise PeerTimeout(f"emulated NIC: {ring.slots} immediates to {grp.peers[p]} not consumed within "
                                  f"{self.timeout_s:g}s (peer not progressing or gone)", position=p)

    def barrier(self, grp: EmulatedPeerGroup, imm: int) -> None:
        """A zero-length write carrying `imm` to every peer of `grp`."""
        self.post(grp, None, [(i, 0, 0, 0, imm) for i in range(len(grp))])

    # ---- completions ----------------------------------------------------------------------------
    def progress(self) -> int:
        """Count immediates appended to our inbox (by exact value; those with a release time once it has
        passed) and retire completed writes. Returns the entries handled."""
        handled = 0
        new = host_atomics.load_acquire(self._new_addr)
        self._quiet += 1
        # CUDA senders raise no "new" word; host senders do, and a full scan runs now and then anyway.
        if self._scan_always or new != self._last_new or self._quiet > 4096:
            self._last_new, self._quiet = new, 0
            handled += self._scan()
        if self._delayed:
            handled += self._release_delayed()
        if self._done:
            handled += self._retire()
        return handled

    def _scan(self) -> int:
        changed = np.flatnonzero(self._seq_np != self._seen_np)
        if not len(changed):
            return 0
        counts, mm, load, store = self._imm_counts, self._inbox_mm, host_atomics.load_acquire, host_atomics.store_release
        unpack, size, mask, slots = _SLOT.unpack_from, _SLOT.size, self._mask, self._slots
        handled, now = 0, None
        for ring in changed.tolist():
            seq = load(self._inbox_addr + _SEQ_OFF + 8 * ring) & _M32
            seen = int(self._seen_np[ring])
            n = (seq - seen) & _M32
            base = self._ring0 + ring * slots * size
            for k in range(n):
                imm, release = unpack(mm, base + size * ((seen + k) & mask))
                imm &= _M32
                if release:
                    now = _now_ns() if now is None else now
                    if release > now:
                        self._order += 1
                        heapq.heappush(self._delayed, (release, self._order, imm))
                        continue
                counts[imm] = counts.get(imm, 0) + 1
                handled += 1
            self._seen_np[ring] = seq
            store(self._acked_addr0 + 8 * ring, seq)  # after reading the slots: they may be reused
        self.imms_received += handled
        return handled

    def _release_delayed(self) -> int:
        now, heap, counts, n = _now_ns(), self._delayed, self._imm_counts, 0
        while heap and heap[0][0] <= now:
            imm = heapq.heappop(heap)[2]
            counts[imm] = counts.get(imm, 0) + 1
            n += 1
        self.imms_received += n
        return n

    def _retire(self) -> int:
        n, now = 0, None
        while self._done:
            event, writes, done_at = self._done[0]
            if event is not None:
                err = self._cu.cuEventQuery(event)[0]
                if err == self._not_ready:
                    break
                if err != self._ok:
                    raise RuntimeError(f"emulated NIC: a copy on the CUDA stream failed: {err}")
            if done_at:
                now = _now_ns() if now is None else now
                if done_at > now:
                    break
            self._done.popleft()
            if event is not None:
                self._events.append(event)
            n += writes
        self._pending -= n
        self.writes_completed += n
        return n

    def _idle_progress(self) -> None:
        if not self.progress() and self.idle_yield:
            _sched_yield()

    @property
    def writes_pending(self) -> int:
        """Writes posted and not yet completed locally."""
        return self._pending

    def wait_writes(self, timeout_s: float | None = None) -> None:
        """Progress until every posted write completed locally (its source buffer may be reused)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while self._pending:
            self._idle_progress()
            if self._pending and time.monotonic() > deadline:
                what = "copies on the CUDA stream" if self.carrier == "cuda" else "deliveries of the emulated NIC"
                raise TimeoutError(f"wait_writes: {self._pending} writes still in flight after {timeout_s:g}s "
                                   f"(waiting for {what})")

    # ---- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release mappings, regions, the stream and the inbox (idempotent). Writes in flight are
        abandoned (call `wait_writes` first)."""
        if self._closed:
            return
        self._closed = True
        cu = self._cu
        if cu is not None and self._stream is not None:
            cu.cuStreamSynchronize(self._stream)  # nothing of ours may still write into what we unmap
        for _, close in self._mapped.values():
            try:
                close()
            except Exception:  # noqa: BLE001 - teardown goes on
                pass
        self._mapped.clear()
        for peer in self._peers.values():
            peer.ring.close()
        for region in list(self._regions):
            region.close()
        if cu is not None:
            for event in self._events + [d[0] for d in self._done if d[0] is not None]:
                cu.cuEventDestroy(event)
            self._events, self._done = [], deque()
            if self._stream is not None:
                cu.cuStreamDestroy(self._stream)
                self._stream = None
        self.__dict__.pop("_seq_np", None)
        if self._inbox_mm is not None:
            _unmap(self._inbox_mm, self, "_inbox_keep")
            self._inbox_mm = None
        if self._inbox_fd is not None:
            os.close(self._inbox_fd)
            self._inbox_fd = None

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("EmulatedEngine is closed")

    def __enter__(self) -> "EmulatedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmulatedEngine({self.carrier}, nic={self.nic}, pending={self._pending})"


_logged: set = set()


def log_settings(nic: NicSettings, carrier: str) -> None:
    """Say once per process which carrier and settings the emulated NIC runs with (model process, rank 0)."""
    if (nic, carrier) in _logged:
        return
    _logged.add((nic, carrier))
    import logging

    how = ("CUDA carrier (cuMemcpyAsync between GPU buffers, one stream per proxy)" if carrier == "cuda"
           else "host carrier (memmove between mapped host buffers)")
    logging.getLogger("moe_a2a").warning(
        "moe_a2a: transport 'emulated' is an instrument, not a network: remote traffic between simulated nodes of "
        "this host goes through the proxies and is carried by a %s; NIC %s (%s=%r); its numbers are emulated",
        how, nic.describe(), NIC_ENV, str(nic))


def make_engine(spec, on_gpu: bool):
    """The proxy's engine for `spec`: an EmulatedEngine for transport "emulated" (CUDA carrier when its
    buffers are GPU memory), else a TransferEngine over libfabric."""
    if spec.provider != PROVIDER:
        from .engine import TransferEngine

        return TransferEngine(spec.provider, domains=spec.domains, timeout_s=spec.timeout_s,
                              idle_yield=spec.idle_yield, hmem=on_gpu, local_only=spec.local_only)
    ordinal = spec.fd_buffers[1] if on_gpu else None
    # Every engine that connects to us claims a ring: every proxy of every rank (ourselves included).
    senders = spec.layout.world_size * max(1, spec.shards) + 1
    return EmulatedEngine(cuda_device=ordinal, nic=parse_nic_settings(getattr(spec, "emulated_nic", "")),
                          max_senders=senders, timeout_s=spec.timeout_s, idle_yield=spec.idle_yield)
