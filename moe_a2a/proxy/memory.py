"""Memory shared between a rank's model process, its proxy process and same-node peers.

- `SharedSegment`: a file in /dev/shm mapped by every process that needs it. It holds the flags,
  the error report, the routing matrix and, in host-staged mode, the send and recv buffers. The
  model process registers it with CUDA (`cudaHostRegister`), so Triton kernels reach it through
  UVA; the proxy registers it with libfabric.
- `DeviceBuffer`: GPU memory shared with same-node processes through CUDA IPC handles (used when
  no byte of the buffer must cross the wire, or the provider can register GPU memory).
- `host_tensor_on_device`: a CUDA tensor view of registered host memory, for kernel arguments.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import secrets

import numpy as np
import torch

_SHM_DIR = "/dev/shm"


def unique_name(prefix: str = "moe_a2a") -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


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
        self.name, self.path, self.owner = name, os.path.join(_SHM_DIR, name), create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                if not nbytes or nbytes <= 0:
                    raise ValueError(f"nbytes must be positive to create a segment, got {nbytes!r}")
                os.ftruncate(fd, nbytes)
            self.nbytes = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._keepalive = ctypes.c_char.from_buffer(self._mmap)
        self.addr = ctypes.addressof(self._keepalive)
        self._cuda_registered = False

    def numpy(self, offset: int, count: int, dtype=np.uint8) -> np.ndarray:
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset)

    def tensor(self, offset: int, count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """CPU tensor view (shares memory; no copy)."""
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

    def close(self) -> None:
        if self._cuda_registered:
            from cuda.bindings import runtime as rt

            rt.cudaHostUnregister(self.addr)
            self._cuda_registered = False
        if self._mmap is not None:
            del self._keepalive
            try:
                self._mmap.close()
            except BufferError:
                pass  # views still alive: the mapping goes away with them
            self._mmap = None
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.owner = False

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
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)


class DeviceBuffer:
    """GPU memory that same-node processes can map (CUDA IPC).

    Allocated with cudaMalloc, not torch's caching allocator: an IPC handle maps a whole allocation,
    so the buffer must start exactly at one."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
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
