"""EmulatedCarrier: the proxy's NIC emulated between processes of one host. An instrument, not a network.

`transport="emulated"` runs the cross-node protocol between simulated nodes of one host (`node_group`,
`LocalCluster(node_size=...)`) through the same proxy code as a real NIC: the same `engine.TransferEngine`,
descriptors, peer groups, posts, immediates counted by exact value by the receiving proxy, and local
completions. Only the carrier differs from libfabric's (`fabric.py`): a write is a copy between the two
ranks' buffers, and its immediate is appended to the receiving proxy's inbox (`inbox.py`) only once the
copy has completed. docs/transport.md, "The emulated NIC".

- **Host or CUDA** (`kind`). "host": buffers in host memory (the rank's segment, memfd buffers), mapped
  here from the owner's file descriptor (`backing.py`); a write is `ctypes.memmove`, then the slot, then a
  release store of the sequence word. "cuda": buffers are cuMem allocations (`NicPlacement`), imported
  here from their POSIX FDs and mapped once at `peer_group`; a write is `cuMemcpyAsync` on the carrier's
  one stream (one stream = one NIC), then `cuStreamWriteValue32` of the ring's sequence word into the
  receiver's inbox (host memory registered here with `cuMemHostRegister`): the stream orders it after
  the copy, with a system-wide fence before it; the slot itself was written by the host before the
  copy was queued. Local completion: an event per post.
- **NIC settings** (`nic_settings.py`, `MOE_A2A_EMULATED_NIC`, e.g. "12us,25GBps"): the sender keeps the
  NIC's schedule on the host clock (a write of b bytes occupies it for b / bandwidth after the previous
  one) and stamps each slot with its release time, schedule end + latency. The receiver counts an
  immediate only once that time has passed (and the copy has landed), so latencies of different writes
  overlap as on a NIC, and local completion comes at the same time. Nothing else of a NIC is modelled.

Addresses and descriptors are the engine's: an `EngineAddress` whose one name packs (pid, inbox FD, inbox
size, token, boot id), a `RemoteRegion` whose base is the buffer's offset in its file, whose key is the
owner's FD of that file and whose `file` says (kind, pid, file size, ordinal, boot id).

Never imports torch (the proxy process uses it); `cuda.bindings` only with the CUDA kind.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import struct
import time
from collections import deque

from ..protocol.memory import CuMemBuffer, fd_from_process
from .backing import Mapping, boot_id, cuda_backing, host_backing
from .engine import ACCESS_TARGET, EMULATED, EngineAddress, LocalRegion, Peer, PeerGroup, PeerTimeout, \
    RemoteRegion, TransferEngine
from .inbox import Inbox, Ring, now_ns
from .nic_settings import NicSettings

_M32 = 0xFFFFFFFF
_PAGE = mmap.PAGESIZE
_NAME = struct.Struct("<qqq8s")  # an address's name: pid, inbox FD, inbox bytes, token; then the boot id


class EmulatedRegistration:
    """A registered buffer: `kind` ("host", "cuda"), what a peer maps (`backing`: (our FD, offset, file
    size, ordinal), None for a source only) and what releases it (`closers`)."""

    def __init__(self, kind: str, backing: tuple | None, closers: list) -> None:
        self.kind, self.backing, self._closers = kind, backing, closers
        self.keys = () if backing is None else (backing[0],)

    def close(self) -> None:
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            close()


class EmulatedCarrier:
    """Writes as copies on one host, immediates through inboxes (see the module docstring).

    Args:
        cuda_device: CUDA ordinal of the CUDA kind (GPU buffers, copies on one stream); None: the host
            kind (host buffers, `memmove`).
        nic: latency and bandwidth added to each write (`NicSettings()`: none).
        max_senders: rings in our inbox: how many engines may `connect` to this one.
        ring_slots: immediates a sender may have appended that we have not consumed yet (a power of 2);
            a sender whose ring is full progresses until we consume (`PeerTimeout` after the engine's
            ``post_timeout_s``).
    """

    provider = provider_name = EMULATED
    num_domains = 1
    fabric_info = None
    max_write_bytes = (1 << 63) - 1  # one mapping per buffer: no bound but the regions'

    def __init__(self, *, cuda_device: int | None = None, nic: NicSettings | None = None, max_senders: int = 256,
                 ring_slots: int = 1024) -> None:
        if max_senders < 1 or ring_slots < 2 or ring_slots & (ring_slots - 1):
            raise ValueError(f"max_senders must be >= 1 and ring_slots a power of 2 >= 2, got {max_senders}, {ring_slots}")
        self.nic = nic or NicSettings()
        self.kind = "host" if cuda_device is None else "cuda"
        self.cuda_device = cuda_device
        self.engine = None
        self._host = boot_id()
        self._rings: list[Ring] = []
        self._mapped: dict[tuple, tuple[int, object]] = {}  # remote region key -> (address of byte 0, closer)
        self._done: deque = deque()  # [event or None, writes, done at ns] per post, oldest first
        self._pending = 0
        self._nic_free_ns = 0
        self._lat_ns = self.nic.latency_ns
        self._ns_per_byte = None if self.nic.bandwidth_Bps is None else 1e9 / self.nic.bandwidth_Bps
        self._paced = not self.nic.full_speed
        self._cu = None
        self._stream = None
        self._events: list = []
        self._inbox = None
        try:
            if cuda_device is not None:
                self._cuda_init(cuda_device)
            self._inbox = Inbox(max_senders, ring_slots, scan_always=self.kind == "cuda")
        except BaseException:
            self.close([])
            raise
        name = _NAME.pack(os.getpid(), self._inbox.fd, self._inbox.nbytes, secrets.token_bytes(8)) + self._host.encode()
        self.address = EngineAddress(EMULATED, (name,), f"pid{os.getpid()}")
        self.waiting_for = f" (waiting for {'copies on the CUDA stream' if self.kind == 'cuda' else 'deliveries of the emulated NIC'})"

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

    def attach(self, engine: TransferEngine) -> None:
        """The engine whose immediate counts and totals this carrier fills."""
        self.engine = engine
        self._imm_counts = engine._imm_counts

    # ---- memory ---------------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, access: int, *, dmabuf_fd: int | None = None,
                 cuda_device: int | None = None, max_write_bytes: int | None = None) -> LocalRegion:
        """A region peers write into (`ACCESS_TARGET`) must be a shared file mapping (host) or a live
        CuMemBuffer (`cuda_device` set, CUDA kind only): its descriptor lets a peer's engine map it.
        `max_write_bytes` is for libfabric's registrations in chunks: the emulated NIC maps whole buffers
        and has no limit on a registration, so it is not used."""
        if dmabuf_fd is not None:
            raise ValueError("register: the emulated NIC takes no DMA-BUF (GPU memory comes as cuMem buffers)")
        kind = "host" if cuda_device is None else "cuda"
        if kind == "cuda" and self.kind != "cuda":
            raise ValueError("register: GPU memory needs the emulated NIC's CUDA carrier (EmulatedCarrier(cuda_device=...))")
        closers: list = []
        backing = None
        try:
            if access & ACCESS_TARGET:
                if kind == "host":
                    fd, offset, size = host_backing(addr, nbytes)
                    backing = (fd, offset, size, None)
                else:
                    backing = cuda_backing(addr, nbytes)
                closers.append(lambda fd=backing[0]: os.close(fd))
            if kind == "host" and self.kind == "cuda":
                closers.append(self._pin(addr, nbytes))  # asynchronous copies from and to it
        except BaseException:
            for close in reversed(closers):
                close()
            raise
        return LocalRegion(self.engine, addr, nbytes, access, EmulatedRegistration(kind, backing, closers))

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

    def descriptor(self, region: LocalRegion) -> RemoteRegion:
        """What a peer needs to map the region (see the module docstring)."""
        reg = region.reg
        if reg.backing is None:
            raise ValueError("descriptor: this region was registered without FI_REMOTE_WRITE (a local "
                             "source only); peers cannot write into it")
        fd, offset, size, ordinal = reg.backing
        return RemoteRegion(EMULATED, region.nbytes, offset, (fd,), file=(reg.kind, os.getpid(), size, ordinal,
                                                                          self._host))

    # ---- peers ----------------------------------------------------------------------------------
    def connect(self, address: EngineAddress) -> Ring:
        """Map the engine's inbox and claim our ring in it."""
        name = address.names[0]
        pid, inbox_fd, inbox_bytes, _ = _NAME.unpack_from(name)
        if name[_NAME.size:].decode() != self._host:
            raise ValueError(f"connect: {address} runs on another host: the emulated NIC reaches only processes "
                             f"of this host")
        ring = Ring(pid, inbox_fd, inbox_bytes, str(address))
        self._rings.append(ring)
        if self.kind == "cuda":
            ring.map_for_device(self._cu, self._drv)
        return ring

    def check_region(self, i: int, p: Peer, r: RemoteRegion) -> None:
        """Refuse a region that is not of the emulated NIC, or not the peer's."""
        if r.provider != EMULATED or len(r.file) != 5:
            raise ValueError(f"peer_group: position {i}: expected a region of the emulated NIC, got one of "
                             f"provider {r.provider!r}")
        if r.file[1] != p.link.pid:
            raise ValueError(f"peer_group: position {i}: the region belongs to pid {r.file[1]}, not to {p}")

    def prepare_group(self, grp: PeerGroup) -> None:
        """Map each peer's region here once (a region in several groups is mapped once): `grp.dst_addr`;
        our ring at each peer: `grp.rings`."""
        grp.dst_addr = tuple(self._map(r, i) for i, r in enumerate(grp.regions))
        grp.rings = tuple(p.link for p in grp.peers)

    def _map(self, r: RemoteRegion, position: int) -> int:
        kind, pid, size, ordinal, _ = r.file
        key = (pid, r.keys[0], kind, r.base, r.nbytes, size)
        hit = self._mapped.get(key)
        if hit is not None:
            return hit[0]
        if kind == "cuda" and self.kind != "cuda":
            raise ValueError(f"peer_group: position {position}: a GPU region needs the CUDA carrier "
                             f"(EmulatedCarrier(cuda_device=...))")
        fd = fd_from_process(pid, r.keys[0])
        if kind == "cuda":
            try:  # the FD is the buffer's now (closed with it); mapped with access for our device
                buf = CuMemBuffer(size, self.cuda_device, fd=fd)
            except BaseException as exc:
                os.close(fd)
                raise RuntimeError(f"peer_group: position {position}: mapping the GPU buffer of pid {pid} "
                                   f"(device {ordinal}) on device {self.cuda_device}: {exc}") from exc
            self._mapped[key] = (buf.addr + r.base, buf.close)
            return buf.addr + r.base
        try:
            mapping = Mapping(fd, r.nbytes, r.base)
        finally:
            os.close(fd)  # the mapping stays
        self._mapped[key] = (mapping.addr, mapping.close)
        return mapping.addr

    # ---- posting --------------------------------------------------------------------------------
    def scatter(self, grp: PeerGroup, src: LocalRegion, targets, imm, imms) -> None:
        """One copy and one immediate per target (validated by the engine). Returns once every write is
        posted (host: done; CUDA: queued on the stream)."""
        if not targets:
            return
        writes = zip(targets, [imm] * len(targets) if imms is None else imms)
        if self.kind == "cuda":
            self._post_cuda(grp, src.addr, writes, len(targets))
        else:
            self._post_host(grp, src.addr, writes, len(targets))

    def post_table(self, grp: PeerGroup, src: LocalRegion, words, slots, src_base: int, dst_base: int,
                   imm: int | None, skip_empty: bool) -> int:
        """`TransferEngine.post_table`: the rows read, then posted as one `scatter` (all checked first)."""
        targets, imms = [], []
        for p, b in slots:
            so, length, do, v = words[b], words[b + 1], words[b + 2], words[b + 3]
            if skip_empty and not length:
                continue
            targets.append((p, so + src_base, length, do + dst_base))
            imms.append(v if imm is None else imm)
        if targets:
            self.engine.scatter(grp, src, targets, imms)
        return len(targets)

    def _release_ns(self, nbytes: int) -> int:
        """When the emulated NIC has delivered a write of `nbytes` posted now (0: at once)."""
        now = now_ns()
        if self._ns_per_byte is None:
            return now + self._lat_ns
        start = max(now, self._nic_free_ns)
        self._nic_free_ns = finish = start + int(nbytes * self._ns_per_byte)
        return finish + self._lat_ns

    def _slot(self, grp: PeerGroup, p: int, imm: int, release: int) -> Ring:
        """Write the next slot of our ring at peer `p` (waiting for room); the caller publishes it."""
        ring = grp.rings[p]
        if ring.seq - ring.acked >= ring.slots and not ring.room():
            self._wait_room(grp, p)
        ring.append(imm, release)
        return ring

    def _post_host(self, grp: PeerGroup, src_addr: int, writes, n: int) -> None:
        memmove, dst, paced = ctypes.memmove, grp.dst_addr, self._paced
        release = 0
        for (p, so, length, do), imm in writes:
            if length:
                memmove(dst[p] + do, src_addr + so, length)
            if paced:
                release = self._release_ns(length)
            self._slot(grp, p, imm, release).publish()  # after the data and the slot
        self.engine.writes_posted += n
        if paced:  # complete locally once the NIC has delivered the last one
            self._done.append([None, n, release])
            self._pending += n
        else:
            self.engine.writes_completed += n

    def _post_cuda(self, grp: PeerGroup, src_addr: int, writes, n: int) -> None:
        memcpy, write32, stream, ok, dst = self._memcpy, self._write32, self._stream, self._ok, grp.dst_addr
        paced = self._paced
        release = 0
        for (p, so, length, do), imm in writes:
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
        self._done.append([event, n, release])
        self._pending += n
        self.engine.writes_posted += n

    def _cuda_failed(self, call: str, grp: PeerGroup, p: int) -> None:
        # Re-run nothing: report the stream's sticky error, naming the peer.
        err = self._cu.cuStreamQuery(self._stream)[0]
        raise RuntimeError(f"emulated NIC: {call} to {grp.peers[p]} failed (stream: {err})")

    def _wait_room(self, grp: PeerGroup, p: int) -> None:
        """Progress (our own inbox too: two peers that fill each other's rings both drain) until peer `p`
        has consumed an immediate of ours."""
        eng = self.engine
        eng.slot_waits += 1
        ring = grp.rings[p]
        deadline = time.monotonic() + eng.post_timeout_s
        while not ring.room():
            eng._idle_progress()
            if time.monotonic() > deadline:
                raise PeerTimeout(f"emulated NIC: {ring.slots} immediates to {grp.peers[p]} not consumed within "
                                  f"{eng.post_timeout_s:g}s (peer not progressing or gone)", position=p)

    # ---- completions ----------------------------------------------------------------------------
    def progress(self) -> int:
        """Count immediates appended to our inbox (by exact value; those with a release time once it has
        passed) and retire completed writes. Returns the entries handled."""
        received = self._inbox.poll(self._imm_counts)
        self.engine.imms_received += received
        return received + (self._retire() if self._done else 0)

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
                now = now_ns() if now is None else now
                if done_at > now:
                    break
            self._done.popleft()
            if event is not None:
                self._events.append(event)
            n += writes
        self._pending -= n
        self.engine.writes_completed += n
        return n

    @property
    def pending(self) -> int:
        """Writes posted and not yet completed locally."""
        return self._pending

    # ---- teardown -------------------------------------------------------------------------------
    def close(self, regions) -> None:
        """Release mappings, rings, regions, the stream and the inbox."""
        cu = self._cu
        if cu is not None and self._stream is not None:
            cu.cuStreamSynchronize(self._stream)  # nothing of ours may still write into what we unmap
        for _, close in self._mapped.values():
            try:
                close()
            except Exception:  # noqa: BLE001 - teardown goes on
                pass
        self._mapped.clear()
        for ring in self._rings:
            ring.close()
        self._rings = []
        for region in regions:
            region.close()
        if cu is not None:
            for event in self._events + [d[0] for d in self._done if d[0] is not None]:
                cu.cuEventDestroy(event)
            self._events, self._done = [], deque()
            if self._stream is not None:
                cu.cuStreamDestroy(self._stream)
                self._stream = None
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None

    def __repr__(self) -> str:
        return f"emulated NIC, {self.kind}, nic={self.nic}"


def emulated_engine(*, cuda_device: int | None = None, nic: NicSettings | None = None, max_senders: int = 256,
                    ring_slots: int = 1024, timeout_s: float = 30.0, idle_yield: bool = False) -> TransferEngine:
    """A `TransferEngine` over the emulated NIC (`EmulatedCarrier`'s arguments, and the engine's)."""
    carrier = EmulatedCarrier(cuda_device=cuda_device, nic=nic, max_senders=max_senders, ring_slots=ring_slots)
    return TransferEngine(carrier=carrier, timeout_s=timeout_s, idle_yield=idle_yield)
