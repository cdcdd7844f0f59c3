"""Memory shared between a rank's model process, its proxy process and same-node peers.

- `SharedSegment`: a file in /dev/shm mapped by every process that needs it. It holds the flags,
  the error report, the routing matrix and, in host-staged mode, the send and recv buffers. The
  model process registers it with CUDA (`cudaHostRegister`), so Triton kernels reach it through
  UVA; the proxy registers it with libfabric.
- `DeviceBuffer`: GPU memory shared with same-node processes through CUDA IPC handles (used when
  no byte of the buffer must cross the wire, or the provider can register GPU memory).
- `device_view`: a uint8 tensor over memory the device can reach (registered host memory, IPC-mapped GPU
  memory), for kernel arguments.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import weakref

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the proxy process imports this module and must not pay for torch (7 s on CI)
    import torch

    from ..config import Layout

_SHM_DIR = "/dev/shm"


def unique_name(prefix: str = "moe_a2a") -> str:
    """`{prefix}-{pid}-{8 hex}`: the creator's pid is in the name, so whoever outlives a killed creator
    can find its files (`process_shm_files`)."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


# ---- files a process leaves in /dev/shm -------------------------------------------------------------
# A process killed by SIGKILL cannot remove its files. Two kinds carry the creator's pid in their name:
# our segments (`unique_name`: "moe_a2a-{pid}-{hex}") and libfabric's shm provider's region
# ("{pid}:{...}", 16 MiB, named after the proxy that opened the provider).

def process_shm_files(pid: int, segments: bool = True, libfabric: bool = True) -> list[str]:
    """Paths under /dev/shm that process `pid` created: `moe_a2a-{pid}-*` segments (`segments`) and
    libfabric shm regions `{pid}:*` (`libfabric`). Only exact pid matches (`12:` never matches 123)."""
    starts = ([f"moe_a2a-{pid}-"] if segments else []) + ([f"{pid}:"] if libfabric else [])
    try:
        names = os.listdir(_SHM_DIR)
    except FileNotFoundError:
        return []
    return [os.path.join(_SHM_DIR, n) for n in sorted(names) if n.startswith(tuple(starts))] if starts else []


def remove_process_shm_files(pid: int, segments: bool = True, libfabric: bool = True) -> list[str]:
    """Unlink what `process_shm_files` finds; call it only once `pid` has exited (and, unless it is
    still an unreaped child or zombie, make sure the pid was not reused). Returns the removed paths."""
    removed = []
    for path in process_shm_files(pid, segments, libfabric):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


# ---- how much memory buffers may take -------------------------------------------------------------
def physical_memory_bytes() -> int | None:
    """Physical memory of this machine (`SC_PAGE_SIZE * SC_PHYS_PAGES`), None where unknown."""
    try:
        n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return n if n > 0 else None


def check_fits_in_memory(layout: "Layout", ranks: int = 1, host_staged: bool = True,
                         physical: int | None = None) -> int:
    """Refuse buffers this machine cannot hold, before anything is allocated or started.

    `ranks` processes of this machine each allocate a segment of `layout.segment_bytes(host_staged)`
    (flags, sync area and, host-staged, the send and recv buffers). ValueError naming the sizes when
    their sum exceeds the physical memory (`physical`, default `physical_memory_bytes()`); returns the
    bytes needed. Called at construction (`LocalCluster`; `AllToAll` may call it with `ranks=1`), never
    by `A2AConfig`, which may be built on another machine than the one that runs it."""
    per_rank = layout.segment_bytes(host_staged)
    total = ranks * per_rank
    physical = physical_memory_bytes() if physical is None else physical
    if physical is not None and total > physical:
        lay = layout
        raise ValueError(
            f"buffers too large for this machine: {ranks} rank(s) x {per_rank:,} B ({per_rank / 1e9:.1f} GB) "
            f"= {total:,} B ({total / 1e9:.1f} GB) of shared memory, more than its physical memory "
            f"({physical:,} B, {physical / 1e9:.1f} GB); per rank: send buffer {lay.send_bytes:,} B, recv buffer "
            f"{lay.recv_bytes:,} B, for max_num_tokens={lay.max_num_tokens}, experts_per_token="
            f"{lay.experts_per_token}, world_size={lay.world_size}, dispatch row {lay.dispatch_stride_bytes} B, "
            f"combine row {lay.combine_stride_bytes} B (the recv buffer holds world_size x max_num_tokens x "
            f"experts_per_token rows: lower one of these)")
    return total


class SharedSegment:
    """A named shared-memory segment (a file in /dev/shm), page aligned, zero filled.

    Args:
        name: file name under /dev/shm.
        nbytes: size; required when creating, read from the file when attaching.
        create: create the file (the owner unlinks it on `close`) or attach to an existing one.
    """

    def __init__(self, name: str, nbytes: int | None = None, create: bool = False) -> None:
        if "/" in name or not name:
            raise ValueError(f"segment name must be a plain file name, got {name!r}")
        if create and (not nbytes or nbytes <= 0):  # checked before the file exists
            raise ValueError(f"nbytes must be positive to create a segment, got {nbytes!r}")
        self.name, self.path, self.owner = name, os.path.join(_SHM_DIR, name), False
        self._mmap, self._cuda_registered = None, False
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            try:
                if create:
                    os.ftruncate(fd, nbytes)
                self.nbytes = os.fstat(fd).st_size
                self._mmap = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._keepalive = ctypes.c_char.from_buffer(self._mmap)
            self.addr = ctypes.addressof(self._keepalive)
        except BaseException:
            # Never leave the file behind when the mapping failed (too large for the address space or
            # for /dev/shm, ...): nobody else knows its name yet.
            self.__dict__.pop("_keepalive", None)
            if self._mmap is not None:
                self._mmap.close()
                self._mmap = None
            if create:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            raise
        self.owner = create

    def numpy(self, offset: int, count: int, dtype=np.uint8) -> np.ndarray:
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset)

    def tensor(self, offset: int, count: int, dtype: "torch.dtype | None" = None) -> torch.Tensor:
        """CPU tensor view (shares memory; no copy); uint8 by default."""
        import torch

        dtype = torch.uint8 if dtype is None else dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize or offset + count * itemsize > self.nbytes:
            raise ValueError(f"view [{offset}, +{count}x{itemsize}) outside segment of {self.nbytes} B")
        return torch.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset)

    def register_cuda(self) -> None:
        """Pin and map the segment for the GPU (cudaHostRegister, portable + mapped)."""
        if self._cuda_registered:
            return
        from cuda.bindings import runtime as rt

        flags = rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped
        (err,) = rt.cudaHostRegister(self.addr, self.nbytes, flags)
        if err != rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostRegister({self.name}, {self.nbytes} B) failed: {err}")
        self._cuda_registered = True

    def unlink(self) -> None:
        """Remove the file; the mappings stay valid. Once every process that maps it has done so, nothing
        is left in /dev/shm whatever happens to them later (a crash, SIGKILL)."""
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.owner = False

    def close(self) -> None:
        if self._cuda_registered:
            from cuda.bindings import runtime as rt

            rt.cudaHostUnregister(self.addr)
            self._cuda_registered = False
        if self._mmap is not None:
            self.__dict__.pop("_keepalive", None)
            try:
                self._mmap.close()
            except BufferError:
                pass  # views still alive: the mapping goes away with them
            self._mmap = None
        self.unlink()

    def __del__(self) -> None:  # best effort: never leave a file in /dev/shm
        try:
            self.close()
        except Exception:
            pass


class _CudaArray:
    """Carrier of `__cuda_array_interface__` so torch can wrap a raw device-accessible pointer."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


def device_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor over `ptr` (registered host memory under UVA, or IPC-mapped GPU memory)."""
    import torch

    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)


class DeviceBuffer:
    """GPU memory that same-node processes can map (CUDA IPC).

    Allocated with cudaMalloc, not torch's caching allocator: an IPC handle maps a whole allocation,
    so the buffer must start exactly at one."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        import torch
        from cuda.bindings import runtime as rt

        with torch.cuda.device(device):
            err, ptr = rt.cudaMalloc(nbytes)
            if err != rt.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaMalloc({nbytes}) failed: {err}")
            rt.cudaMemset(ptr, 0, nbytes)
        self.addr, self.nbytes, self.device = int(ptr), nbytes, device
        self.tensor = device_view(self.addr, nbytes, device)

    def ipc_handle(self) -> bytes:
        from cuda.bindings import runtime as rt

        err, handle = rt.cudaIpcGetMemHandle(self.addr)
        if err != rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaIpcGetMemHandle failed: {err}")
        return ctypes.string_at(handle.getPtr(), 64)  # the opaque 64-byte cudaIpcMemHandle_t

    def close(self) -> None:
        if self.addr:
            from cuda.bindings import runtime as rt

            self.tensor = None
            rt.cudaFree(self.addr)
            self.addr = 0


def open_ipc_handle(handle: bytes, nbytes: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """Map a peer's `DeviceBuffer` into this process: (address, uint8 tensor view)."""
    import torch
    from cuda.bindings import runtime as rt

    h = rt.cudaIpcMemHandle_t()
    ctypes.memmove(h.getPtr(), handle, 64)
    with torch.cuda.device(device):
        err, ptr = rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaIpcOpenMemHandle failed: {err}")
    return int(ptr), device_view(int(ptr), nbytes, device)


def close_ipc_handle(ptr: int) -> None:
    from cuda.bindings import runtime as rt

    rt.cudaIpcCloseMemHandle(ptr)


# ---- GPU memory the NIC can write: cuMem allocations shared as POSIX file descriptors ---------------
# cudaMalloc memory can only be shared through CUDA IPC handles, which a NIC registration cannot use
# from another process; a cuMem allocation exported as a POSIX FD can be imported and mapped by the
# proxy process (which registers it with libfabric, FI_HMEM_CUDA) and by same-node peers alike.
# Torch-free: the proxy process uses it.

def _drv(result, what: str):
    """Unpack a cuda.bindings driver result `(CUresult, *values)`; raise naming the call."""
    from cuda.bindings import driver as cu

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else err}")
    return values[0] if len(values) == 1 else (values or None)


def cuda_primary_context(ordinal: int) -> None:
    """Make device `ordinal`'s primary context current (the one torch uses), initialising the driver."""
    from cuda.bindings import driver as cu

    _drv(cu.cuInit(0), "cuInit")
    dev = _drv(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    ctx = _drv(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _drv(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class CuMemBuffer:
    """GPU memory from `cuMemCreate` (GPUDirect-RDMA capable), shareable as a POSIX file descriptor.

    `CuMemBuffer(nbytes, ordinal)` allocates, maps it here and exports `fd`;
    `CuMemBuffer(nbytes, ordinal, fd=fd)` imports another process's allocation (the fd is consumed:
    closed with the buffer) and maps it here. `nbytes` is rounded up to the allocation granularity
    (`size`); an importer passes the exporter's `size`. `addr` is valid on device `ordinal`.
    """

    def __init__(self, nbytes: int, ordinal: int, fd: int | None = None) -> None:
        from cuda.bindings import driver as cu

        if nbytes <= 0:
            raise ValueError(f"CuMemBuffer: nbytes must be positive, got {nbytes}")
        self.ordinal, self.addr, self.fd, self._handle = ordinal, 0, None, None
        cuda_primary_context(ordinal)
        posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = posix_fd
        prop.allocFlags.gpuDirectRDMACapable = 1
        gran = int(_drv(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self.size = -(-nbytes // gran) * gran
        try:
            if fd is None:
                self._handle = _drv(cu.cuMemCreate(self.size, prop, 0), f"cuMemCreate({self.size} B)")
                self.fd = int(_drv(cu.cuMemExportToShareableHandle(self._handle, posix_fd, 0),
                                   "cuMemExportToShareableHandle(POSIX_FD)"))
            else:
                self.fd = fd
                self._handle = _drv(cu.cuMemImportFromShareableHandle(fd, posix_fd),
                                    "cuMemImportFromShareableHandle(POSIX_FD)")
            self.addr = int(_drv(cu.cuMemAddressReserve(self.size, gran, 0, 0), "cuMemAddressReserve"))
            _drv(cu.cuMemMap(self.addr, self.size, 0, self._handle, 0), "cuMemMap")
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = ordinal
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _drv(cu.cuMemSetAccess(self.addr, self.size, [access], 1), "cuMemSetAccess")
            if fd is None:
                _drv(cu.cuMemsetD8(self.addr, 0, self.size), "cuMemsetD8")
        except BaseException:
            self.close()
            raise
        _FD_BUFFERS.add(self)

    def read_into(self, offset: int, out) -> None:
        """Copy `out.nbytes` bytes at `offset` into the host array `out` (device to host, synchronous)."""
        from cuda.bindings import driver as cu

        if offset < 0 or offset + out.nbytes > self.size:
            raise ValueError(f"read_into: [{offset}, {offset + out.nbytes}) outside {self.size} B")
        _drv(cu.cuMemcpyDtoH(out.ctypes.data, self.addr + offset, out.nbytes), "cuMemcpyDtoH")

    def close(self) -> None:
        """Unmap and release (idempotent). The memory itself lives until every process released it."""
        from cuda.bindings import driver as cu

        if self.addr:
            cu.cuMemUnmap(self.addr, self.size)
            cu.cuMemAddressFree(self.addr, self.size)
            self.addr = 0
        if self._handle is not None:
            cu.cuMemRelease(self._handle)
            self._handle = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class MemfdBuffer:
    """Host memory from `memfd_create`, shared as a POSIX FD exactly like `CuMemBuffer` (same
    constructor): the registered-buffer path without a GPU, so CI runs the FD hand-over, the proxy's
    registration of separate buffers and the same-node imports for real. `ordinal` is ignored."""

    def __init__(self, nbytes: int, ordinal: int = 0, fd: int | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"MemfdBuffer: nbytes must be positive, got {nbytes}")
        self.ordinal, self.size = ordinal, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.fd = os.memfd_create("moe_a2a-buffer", os.MFD_CLOEXEC) if fd is None else fd
        if fd is None:
            os.ftruncate(self.fd, self.size)
        self._mmap = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._keepalive = ctypes.c_char.from_buffer(self._mmap)
        self.addr = ctypes.addressof(self._keepalive)
        _FD_BUFFERS.add(self)

    def close(self) -> None:
        if self.addr:
            del self._keepalive
            try:
                self._mmap.close()
            except BufferError:
                pass  # views still alive: the mapping goes away with them
            self.addr = 0
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# Registered send/recv buffers by memory kind: both are (nbytes, ordinal, fd=None) -> .addr .size .fd
SHAREABLE_BUFFERS = {"cuda": CuMemBuffer, "host": MemfdBuffer}

# The live FD-shared buffers of this process: the emulated NIC (proxy/emulated.py) hands peers the FD of
# the buffer a registered address lies in.
_FD_BUFFERS: "weakref.WeakSet" = weakref.WeakSet()


def fd_buffer_at(addr: int, nbytes: int):
    """The open CuMemBuffer or MemfdBuffer of this process that holds [addr, addr+nbytes), or None."""
    for buf in list(_FD_BUFFERS):
        if buf.addr and buf.fd is not None and buf.addr <= addr and addr + nbytes <= buf.addr + buf.size:
            return buf
    return None


# ---- passing file descriptors between processes -------------------------------------------------

def send_fds(sock, fds: list[int]) -> None:
    """Send open file descriptors over a Unix socket (SCM_RIGHTS); the receiver gets duplicates."""
    import socket

    socket.send_fds(sock, [len(fds).to_bytes(4, "little")], fds)


def recv_fds(sock, count: int, timeout_s: float) -> list[int]:
    """Receive exactly `count` file descriptors sent by `send_fds` (TimeoutError after `timeout_s`)."""
    import socket

    sock.settimeout(timeout_s)
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 4, count)
    except socket.timeout:
        raise TimeoutError(f"no file descriptors arrived within {timeout_s:g}s") from None
    finally:
        sock.settimeout(None)
    if len(fds) != count or int.from_bytes(msg, "little") != count:
        for fd in fds:
            os.close(fd)
        raise RuntimeError(f"expected {count} file descriptors, got {len(fds)} (header {msg!r})")
    return list(fds)


_SYS_PIDFD_GETFD = 438  # same number on x86_64 and aarch64 (added after the syscall tables merged)


def fd_from_process(pid: int, fd: int) -> int:
    """A duplicate of another process's open file descriptor `fd` (Linux >= 5.6 `pidfd_getfd`; needs
    ptrace access to `pid`: same user, and Yama's ptrace_scope 0 for non-descendants)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        new = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if new < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid {pid}, fd {fd}): {os.strerror(err)}")
        return new
    finally:
        os.close(pidfd)
