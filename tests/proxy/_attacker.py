"""An attacker that knows only a proxy's ``IP:port`` (what ``ss -ltn`` shows any local user), for
tests/proxy/test_security.py. Run as a separate process::

    python -m tests.proxy._attacker write IP PORT NBYTES LENGTH IMM KEY [KEY ...]
    python -m tests.proxy._attacker read  IP PORT NBYTES LENGTH KEY [KEY ...]

For every key it opens a *fresh* tcp engine (so every attempt has its own connection: a rejected
write makes the target drop the connection, which would otherwise fail the next attempt for the
wrong reason), builds the target's endpoint name from IP:port, and issues one RDMA write of
``LENGTH`` bytes of 0xAA with immediate ``IMM`` (or one RDMA read of ``LENGTH`` bytes) at offset 0 of
the target's region under that key (tcp: the remote address is an offset into the MR). Prints one JSON
object per key: ``{"key", "ok", "error", "data"}`` (``ok``: the local completion succeeded; for a write
that does not prove the data landed, only the target's memory tells).
"""
from __future__ import annotations

import ctypes
import json
import socket
import struct
import sys
import time

from moe_a2a.proxy import libfabric as lf
from moe_a2a.proxy.engine import EngineAddress, RemoteRegion, TransferEngine


def sockaddr_in(ip: str, port: int) -> bytes:
    """The tcp provider's endpoint name: a ``struct sockaddr_in`` (16 bytes)."""
    return struct.pack("<H", socket.AF_INET) + struct.pack(">H", port) + socket.inet_aton(ip) + bytes(8)


def _write(eng: TransferEngine, peer, nbytes: int, length: int, imm: int, key: int) -> str:
    buf = ctypes.create_string_buffer(b"\xAA" * nbytes, nbytes)
    src = eng.register(ctypes.addressof(buf), nbytes)
    grp = eng.peer_group([peer], [RemoteRegion(eng.provider_name, nbytes, 0, (key,))])
    eng.scatter(grp, src, [(0, 0, length, 0)], imm)
    eng.wait_writes(3.0)
    return ""


def _read(eng: TransferEngine, peer, nbytes: int, length: int, key: int) -> str:
    """``fi_readmsg`` (the engine has no read operation: nothing in the protocol reads remotely)."""
    buf = ctypes.create_string_buffer(nbytes)
    dst = eng.register(ctypes.addressof(buf), nbytes, lf.FI_READ)
    ep = eng._eps[0]
    readmsg = lf._fn(lf.WRITEMSG_PROTO, lf.fid_ep.from_address(ep.ptr).rma, lf.fi_ops_rma, "readmsg")
    iov = lf.iovec(ctypes.addressof(buf), length)
    desc = (ctypes.c_void_p * 1)(dst.reg.descs[0])
    rma = lf.fi_rma_iov(0, length, key)
    ctx = eng._free_ctx.pop()  # completes through the engine's CQ handling like one of its writes
    msg = lf.fi_msg_rma(ctypes.addressof(iov), ctypes.addressof(desc), 1, peer.link[0],
                        ctypes.addressof(rma), 1, ctx, 0)
    deadline = time.monotonic() + 3.0
    rc = readmsg(ep.ptr, ctypes.addressof(msg), lf.FI_COMPLETION)
    while rc == -lf.FI_EAGAIN and time.monotonic() < deadline:  # lazy connection
        eng.progress()
        rc = readmsg(ep.ptr, ctypes.addressof(msg), lf.FI_COMPLETION)
    if rc:
        eng._free_ctx.append(ctx)
        raise lf.FabricError("fi_readmsg", rc)
    eng.wait_writes(3.0)
    return buf.raw[:length].hex()


def main(argv: list[str]) -> None:
    op, ip, port, nbytes, length = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    imm = int(argv[5], 0) if op == "write" else 0
    keys = [int(k, 0) for k in argv[6 if op == "write" else 5:]]
    name = sockaddr_in(ip, port)
    for key in keys:
        out = {"key": key, "ok": False, "error": "", "data": ""}
        eng = TransferEngine("tcp", timeout_s=3.0, idle_yield=True)
        try:
            [peer] = eng.connect([EngineAddress(eng.provider_name, (name,))])
            if op == "write":
                _write(eng, peer, nbytes, length, imm, key)
            else:
                out["data"] = _read(eng, peer, nbytes, length, key)
            out["ok"] = True
        except (lf.FabricError, TimeoutError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            eng.close()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
