"""Where a buffer registered with the emulated NIC lives, so a peer can map it: the owner's side (an FD of
the shared file or cuMem allocation that holds it, with the offset) and the peer's side (`Mapping`: that
file mapped here). Host memory must be a shared file mapping (a /dev/shm segment, a memfd); GPU memory a
live `CuMemBuffer` (its POSIX FD). `emulated.EmulatedCarrier` uses both."""
from __future__ import annotations

import os

from ..protocol.memory import CuMemBuffer, MemfdBuffer, fd_buffer_at
from .inbox import mmap_fd, unmap


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Mapping:
    """[offset, offset + nbytes) of a peer's file, mapped here."""

    def __init__(self, fd: int, nbytes: int, offset: int) -> None:
        self.mm, self.addr, self._keep = mmap_fd(fd, nbytes, offset)

    def close(self) -> None:
        if self.mm is not None:
            unmap(self.mm, self, "_keep")
            self.mm = None


def host_backing(addr: int, nbytes: int) -> tuple[int, int, int]:
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


def cuda_backing(addr: int, nbytes: int) -> tuple[int, int, int, int]:
    """(an FD of ours, offset, allocation size, ordinal) of the cuMem allocation holding [addr, addr+nbytes)."""
    buf = fd_buffer_at(addr, nbytes)
    if not isinstance(buf, CuMemBuffer):
        raise ValueError(f"register: GPU memory [{addr:#x}, +{nbytes}) is not a live CuMemBuffer of this process "
                         f"(the emulated NIC maps peers' GPU buffers from their cuMem POSIX FDs)")
    return os.dup(buf.fd), addr - buf.addr, buf.size, buf.ordinal
