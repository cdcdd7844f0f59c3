"""Bodies of the multi-process tests of the emulated NIC (spawned children import only this and the engine)."""
from __future__ import annotations

import ctypes
import time

from moe_a2a.proxy.emulated import emulated_engine
from moe_a2a.proxy.nic_settings import parse_nic_settings
from moe_a2a.proxy.engine import ACCESS_SOURCE, ACCESS_SOURCE_AND_TARGET, ACCESS_TARGET, PeerTimeout
from moe_a2a.protocol.memory import MemfdBuffer, SharedSegment, unique_name

IMM = 0x7E000000


def imm(rank: int, k: int) -> int:
    return IMM | (rank << 8) | k


def pattern(rank: int, n: int) -> bytes:
    return bytes((i * (3 + rank) + 1) % 251 for i in range(n))


def pair(comm, nic: str):
    """Each of two processes writes into the other's memfd recv buffer (a zero-length write, two writes
    with one immediate) and into its segment; each checks what landed and that the immediates were
    counted exactly by value."""
    me, peer = comm.rank, 1 - comm.rank
    eng = emulated_engine(nic=parse_nic_settings(nic), max_senders=4, timeout_s=20, idle_yield=True)
    send, recv = MemfdBuffer(1 << 16), MemfdBuffer(1 << 16)
    seg = SharedSegment(unique_name(), 1 << 16, create=True)
    ctypes.memmove(send.addr, pattern(me, 1 << 16), 1 << 16)
    rs = eng.register(send.addr, send.size, ACCESS_SOURCE)
    rr = eng.register(recv.addr, recv.size, ACCESS_TARGET)
    rseg = eng.register(seg.addr, seg.nbytes, ACCESS_TARGET)
    table = comm.allgather((eng.address, rr.descriptor(), rseg.descriptor()))
    seg.unlink()  # every peer has its descriptor: it maps the segment from our FD, not by name
    [p] = eng.connect([table[peer][0]])
    data, segs = eng.peer_group([p], [table[peer][1]]), eng.peer_group([p], [table[peer][2]])
    assert eng.connect([table[peer][0]]) == [p]  # cached
    eng.post(data, rs, [(0, 0, 100, 0, imm(me, 1)), (0, 200, 0, 1000, imm(me, 2)), (0, 300, 50, 2000, imm(me, 1))])
    eng.scatter(segs, rs, [(0, 7, 64, 8192)], imm(me, 3))
    eng.barrier(data, imm(me, 4))
    expected = {imm(peer, 1): 2, imm(peer, 2): 1, imm(peer, 3): 1, imm(peer, 4): 1}
    deadline = time.monotonic() + 20
    while eng.imm_counts() != expected and time.monotonic() < deadline:
        eng.progress()
        time.sleep(0)
    counts = eng.imm_counts()
    eng.wait_writes(10)
    got = ctypes.string_at(recv.addr, 3000)
    want = pattern(peer, 1 << 16)
    errors = []
    if counts != expected:
        errors.append(f"counts {counts} != {expected}")
    if got[:100] != want[:100] or got[100:2000] != bytes(1900):
        errors.append("first write, or the zero-length one wrote")
    if got[2000:2050] != want[300:350] or got[2050:3000] != bytes(950):
        errors.append("third write")
    if ctypes.string_at(seg.addr + 8192, 64) != want[7:71]:
        errors.append("write into the segment")
    eng.take_imm(imm(peer, 1), 2)
    stats = (eng.writes_posted, eng.writes_completed, eng.imms_received, eng.writes_pending)
    comm.allgather("checked")  # neither closes while the other may still write
    eng.close()
    for b in (send, recv, seg):
        b.close()
    return errors, stats


def dead_peer(comm):
    """Rank 1 dies after connecting: rank 0's posts fill its ring and end in PeerTimeout (position 0),
    and waiting for its immediate ends in a TimeoutError naming it."""
    eng = emulated_engine(max_senders=4, ring_slots=4, timeout_s=1.0, idle_yield=True)
    buf = MemfdBuffer(4096)
    region = eng.register(buf.addr, buf.size)
    table = comm.allgather((eng.address, region.descriptor()))
    [p] = eng.connect([table[1 - comm.rank][0]])
    grp = eng.peer_group([p], [table[1 - comm.rank][1]])
    comm.allgather("connected")
    if comm.rank == 1:
        comm.die()
    time.sleep(0.2)
    out = {}
    t0 = time.monotonic()
    try:
        for _ in range(10):
            eng.post(grp, region, [(0, 0, 8, 0, imm(0, 1))])
    except PeerTimeout as exc:
        out["post"] = (type(exc).__name__, exc.position, str(exc), time.monotonic() - t0)
    try:
        eng.wait_imms({imm(1, 1): 1}, 0.5, "dead peer", names={imm(1, 1): "rank 1"})
    except TimeoutError as exc:
        out["wait"] = str(exc)
    eng.close()
    buf.close()
    return out
