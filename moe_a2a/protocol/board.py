"""The failure board's store, written without torch: how a proxy whose model process died posts it.

The board itself (`runtime.status.FailureBoard`) lives in the model process, on the process group's own
rendezvous store; the proxy (which never imports torch: seconds, hundreds of MB) writes the same keys in the
store's own formats, here, so that both sides share this one account of them.
"""
from __future__ import annotations

import os

# The board's store as a proxy can reach it without importing torch (seconds, hundreds of MB): ("file", path)
# for a FileStore, ("tcp", host, port) for a TCPStore (`FailureBoard.open` checks the writer against the store
# it wraps, else None: the peers' timeouts remain).
_TCPSTORE_VALIDATE, _TCPSTORE_SET, _TCPSTORE_ADD = 0, 1, 4  # c10d::detail::QueryType
_TCPSTORE_MAGIC = 0x3C85F7CE  # c10d::detail::validationMagicNumber


def _file_store_op(path: str, key: str, value: bytes | None, add: int) -> int | None:
    """One FileStore write, as c10d's FileStore makes it: under an exclusive flock, append (u32 length, "/" +
    key) and (u32 length, value); an add reads the log for the key's last value first. Returns an add's result."""
    import fcntl
    import struct

    fd = os.open(path, os.O_RDWR)  # never created: a store whose file is gone has no readers left
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        k, is_add = b"/" + key.encode(), value is None
        if is_add:  # an add: the key's current value, from the whole log
            data, pos, cur = os.pread(fd, os.fstat(fd).st_size, 0), 0, b""
            while pos + 4 <= len(data):
                (n,), pos = struct.unpack_from("<I", data, pos), pos + 4
                name, pos = data[pos:pos + n], pos + n
                (n,), pos = struct.unpack_from("<I", data, pos), pos + 4
                val, pos = data[pos:pos + n], pos + n
                if name == k:
                    cur = val
                elif name == b"-" + k:
                    cur = b""
            add += int(cur or b"0")
            value = str(add).encode()
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, struct.pack("<I", len(k)) + k + struct.pack("<I", len(value)) + value)
        return add if is_add else None
    finally:
        os.close(fd)  # and the lock with it


def _tcp_store_ops(host: str, port: int, ops: list[tuple[str, bytes | None, int]], timeout_s: float) -> list[int]:
    """TCPStore writes over a connection of our own, as c10d's client makes them (its wire format: a query byte,
    u64-length-prefixed strings, "/" before every key): validate, then each (key, value) set or (key, None, n)
    add. Returns the adds' results."""
    import socket
    import struct

    def string(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    out = []
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(struct.pack("<BI", _TCPSTORE_VALIDATE, _TCPSTORE_MAGIC))
        for key, value, n in ops:
            k = string(b"/" + key.encode())
            if value is not None:
                s.sendall(struct.pack("<B", _TCPSTORE_SET) + k + string(value))
                continue
            s.sendall(struct.pack("<B", _TCPSTORE_ADD) + k + struct.pack("<q", n))
            got = b""
            while len(got) < 8:
                chunk = s.recv(8 - len(got))
                if not chunk:
                    raise ConnectionError("the store closed the connection")
                got += chunk
            out.append(struct.unpack("<q", got)[0])
    return out


def board_ops(address: tuple, ops: list[tuple[str, bytes | None, int]], timeout_s: float = 2.0) -> list[int]:
    """Run sets and adds (`_tcp_store_ops`'s form) on the board's store at `address`, without torch."""
    if address[0] == "file":
        return [r for r in (_file_store_op(address[1], key, value, n) for key, value, n in ops) if r is not None]
    if address[0] == "tcp":
        return _tcp_store_ops(address[1], address[2], ops, timeout_s)
    raise ValueError(f"no torch-free writer for a store at {address!r}")


def post_failure(address: tuple, prefix: str, rank: int, reason: str, timeout_s: float = 2.0) -> bool:
    """`FailureBoard.post` without torch (a proxy whose model process died): True when posted."""
    try:
        board_ops(address, [(f"{prefix}rank/{rank}", reason.encode(), 0), (f"{prefix}count", None, 1)], timeout_s)
        return True
    except Exception:  # noqa: BLE001 - the store is gone or unreachable: the peers' timeouts remain
        return False
