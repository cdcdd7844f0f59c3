"""Listening TCP sockets and the sockets of a process, read from /proc (for the tests that check what
listens where)."""
from __future__ import annotations

import os
import socket


def listening_sockets() -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every listening TCP socket (IPv4 and IPv6) of this machine."""
    out = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hex_addr, hex_port = f[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((socket.inet_ntop(family, raw), int(hex_port, 16), f[9]))
    return out


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets process `pid` holds (empty when it is gone)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    return inodes
