"""Where a rank's send and recv buffers live: one class per placement, one small interface.

    allocate()            this rank's buffers (the shared segment already exists)
    proxy_buffers()       what the proxy maps and registers with the NIC besides the segment
    share()               a picklable token the node peers need to map our buffers
    own()                 (send, recv) addresses of our buffers in this process
    map_peer(token, seg)  (send, recv) addresses of a node peer's buffers, mapped here
    release()             unmap and free everything (idempotent; the first error is raised last)

The shared segment (flags, sync area, routing rows, and the staging of rows to and from other nodes)
belongs to the rank, not to a placement. Placements: `IpcPlacement` (GPU memory, CUDA IPC, every peer
on this node), `NicPlacement` (GPU memory as cuMem FDs registered with the NIC, or memfd host memory
exactly so on a CPU), `StagedPlacement` (this node's rows in GPU memory or a node file, other nodes'
rows staged in the segment), `HostPlacement` (all rows in the segment). docs/protocol.md 3.6 says why
each exists; adding one (symmetric memory, multi-node NVLink) is one new class and one line in `choose`.
"""
from __future__ import annotations

import os

from ..config import Layout
from ..protocol.memory import (SHAREABLE_BUFFERS, DeviceBuffer, SharedSegment, close_ipc_handle, fd_from_process,
                            open_ipc_handle, unique_name)


class Placement:
    """Base: the buffers are in the shared segment (what `HostPlacement` is)."""

    name = "host"
    host_staged = True   # rows to and from other nodes pass through the segment
    split_by_node = False  # this node's rows and other nodes' rows in different buffers

    def __init__(self, layout: Layout, rank: int, device, segment: SharedSegment) -> None:
        self.layout, self.rank, self.device, self.segment = layout, rank, device, segment
        self._closers: list = []

    def allocate(self) -> None:
        pass

    def proxy_buffers(self) -> tuple[tuple | None, tuple[int, ...]]:
        """(fd_buffers spec for the proxy or None, the FDs passed to it)."""
        return None, ()

    def share(self):
        return None

    def own(self) -> tuple[int, int]:
        lay = self.layout
        return self.segment.addr + lay.send_offset_bytes, self.segment.addr + lay.recv_offset_bytes

    def map_peer(self, token, peer_segment: SharedSegment | None) -> tuple[int, int]:
        lay = self.layout
        return peer_segment.addr + lay.send_offset_bytes, peer_segment.addr + lay.recv_offset_bytes

    @property
    def needs_peer_segments(self) -> bool:
        """Whether `map_peer` needs the node peers' segments mapped."""
        return True

    def staging(self) -> tuple[int, int]:
        """(send, recv) addresses where rows to and from other nodes are (the proxy's view)."""
        return self.own()

    def peer_staging_recv(self, peer_recv: int, peer_segment: SharedSegment | None) -> int:
        """Where a node peer receives rows from other nodes (`staging` of that peer), given its mapped recv
        buffer and segment: the relay's kernels read what landed at the node's other ranks."""
        return peer_recv

    def unlink(self) -> None:
        """Remove the files of this rank's buffers once every node peer has mapped them (none by default)."""

    def release(self) -> None:
        errors = []
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - every step runs; the first error is raised last
                errors.append(exc)
        if errors:
            raise errors[0]


HostPlacement = Placement


class IpcPlacement(Placement):
    """GPU memory (cudaMalloc) mapped by the node peers through CUDA IPC: every peer on this node."""

    name = "ipc"
    host_staged = False

    def allocate(self) -> None:
        lay = self.layout
        self._bufs = [DeviceBuffer(n, self.device) for n in (lay.send_bytes, lay.recv_bytes)]
        self._closers += [b.close for b in self._bufs]

    def share(self):
        return tuple(b.ipc_handle() for b in self._bufs)

    def own(self) -> tuple[int, int]:
        return self._bufs[0].addr, self._bufs[1].addr

    def map_peer(self, token, peer_segment) -> tuple[int, int]:
        lay = self.layout
        send, _ = open_ipc_handle(token[0], lay.send_bytes, self.device)
        self._closers.append(lambda: close_ipc_handle(send))
        recv, _ = open_ipc_handle(token[1], lay.recv_bytes, self.device)
        self._closers.append(lambda: close_ipc_handle(recv))
        return send, recv

    @property
    def needs_peer_segments(self) -> bool:
        return False


class _NodeFile(Placement):
    """CPU stand-in for `IpcPlacement`: send and recv in a shared file of their own, mapped by the node
    peers, so CI runs the addressing of GPU buffers that are apart from the segment."""

    name = "node-file"
    host_staged = False

    def allocate(self) -> None:
        lay = self.layout
        self._file = SharedSegment(unique_name(), lay.send_bytes + lay.recv_bytes, create=True)
        self._closers.append(self._file.close)

    def share(self):
        return self._file.name

    def unlink(self) -> None:
        self._file.unlink()

    def own(self) -> tuple[int, int]:
        return self._file.addr, self._file.addr + self.layout.send_bytes

    def map_peer(self, token, peer_segment) -> tuple[int, int]:
        other = SharedSegment(token)
        self._closers.append(other.close)
        return other.addr, other.addr + self.layout.send_bytes

    @property
    def needs_peer_segments(self) -> bool:
        return False


class StagedPlacement(Placement):
    """This node's rows stay in node buffers (`IpcPlacement` on a GPU, a node file on a CPU); rows to and
    from other nodes are staged in the segment, where the proxy's NIC reads and writes them."""

    name = "staged"
    host_staged = True
    split_by_node = True

    def __init__(self, layout, rank, device, segment) -> None:
        super().__init__(layout, rank, device, segment)
        node = IpcPlacement if device.type == "cuda" else _NodeFile
        self._node = node(layout, rank, device, segment)

    def allocate(self) -> None:
        self._node.allocate()
        self._closers.append(self._node.release)

    def share(self):
        return self._node.share()

    def own(self) -> tuple[int, int]:
        return self._node.own()

    def map_peer(self, token, peer_segment) -> tuple[int, int]:
        return self._node.map_peer(token, peer_segment)

    def unlink(self) -> None:
        self._node.unlink()

    @property
    def needs_peer_segments(self) -> bool:
        return False

    def staging(self) -> tuple[int, int]:
        return Placement.own(self)

    def peer_staging_recv(self, peer_recv: int, peer_segment: SharedSegment | None) -> int:
        return peer_segment.addr + self.layout.recv_offset_bytes


class NicPlacement(Placement):
    """Buffers the NIC reaches directly: cuMem GPU memory exported as POSIX FDs (EFA: FI_HMEM_CUDA), or on
    a CPU memfd host memory shared the same way. The proxy maps and registers them; node peers pull the
    FDs with pidfd_getfd and map them."""

    name = "nic"
    host_staged = False

    def allocate(self) -> None:
        lay = self.layout
        self._kind = "cuda" if self.device.type == "cuda" else "host"
        self._ordinal = 0 if self._kind == "host" else (
            self.device.index if self.device.index is not None else _current_cuda_device())
        self._bufs = []
        for n in (lay.send_bytes, lay.recv_bytes):
            self._bufs.append(SHAREABLE_BUFFERS[self._kind](n, self._ordinal))
            self._closers.append(self._bufs[-1].close)

    def proxy_buffers(self):
        send, recv = self._bufs
        return (self._kind, self._ordinal, send.size, recv.size), (send.fd, recv.fd)

    def share(self):
        send, recv = self._bufs
        return os.getpid(), send.fd, recv.fd, send.size, recv.size

    def own(self) -> tuple[int, int]:
        return self._bufs[0].addr, self._bufs[1].addr

    def map_peer(self, token, peer_segment) -> tuple[int, int]:
        pid, send_fd, recv_fd, send_size, recv_size = token
        cls = type(self._bufs[0])
        addrs = []
        for fd, size in ((send_fd, send_size), (recv_fd, recv_size)):
            mem = cls(size, self._ordinal, fd=fd_from_process(pid, fd))
            self._closers.append(mem.close)
            addrs.append(mem.addr)
        return addrs[0], addrs[1]

    @property
    def needs_peer_segments(self) -> bool:
        return False


def _current_cuda_device() -> int:
    import torch

    return torch.cuda.current_device()


def check_options(gpu_wait, buffers, nics) -> None:
    """The placement and waiting options of `AllToAll` (and `LocalCluster`, which passes them on)."""
    if gpu_wait not in ("auto", "kernel", "host"):
        raise ValueError(f"gpu_wait must be 'auto', 'kernel' or 'host', got {gpu_wait!r}")
    if buffers not in ("auto", "staged", "host", "gpu", "memfd"):
        raise ValueError(f"buffers must be 'auto', 'staged', 'host', 'gpu' or 'memfd', got {buffers!r}")
    if nics != "auto" and (isinstance(nics, str) or not isinstance(nics, (list, tuple)) or not nics
                           or not all(isinstance(n, str) and n for n in nics)):
        raise ValueError(f"nics must be 'auto' or a non-empty list of domain names, got {nics!r}")


PLACEMENTS = {cls.name: cls for cls in (HostPlacement, IpcPlacement, StagedPlacement, NicPlacement)}


def choose(buffers: str, device, transport: str, has_remote_peers: bool) -> tuple[str, str | None]:
    """The placement for `AllToAll(buffers=...)`, the same on every rank (it depends only on the
    arguments, the device type and the layout), and why GPU buffers were given up, if they were."""
    on_gpu = device.type == "cuda"
    if buffers == "memfd":
        return "nic", None
    if buffers in ("host", "staged"):
        return buffers, None
    if not on_gpu:
        return "host", None
    if not has_remote_peers:
        return "ipc", None
    if buffers == "gpu" or transport in ("efa", "verbs", "emulated"):  # emulated: its CUDA carrier
        return "nic", None
    # The software providers copy through host memory anyway.
    return "staged", (f"transport {transport!r} stages GPU data through host memory "
                      f"(buffers='gpu' tries GPU memory anyway)")
