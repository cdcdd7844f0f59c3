"""Per-process bodies of the TransferEngine tests (run by ``_peers.run_peers`` in spawned processes).

Kept out of ``test_engine.py`` so a spawned child imports only this module and the engine (~0.2 s),
not pytest and hypothesis. Every function takes the ``Comm`` first and returns something picklable.

Immediates used here: ``kind << 16 | sender_rank``; the per-iteration counts are consumed by
``wait_imms``, so no iteration number needs to travel.
"""
from __future__ import annotations

import ctypes
import random
import time

from moe_a2a.proxy.engine import TransferEngine

DATA, ACK, BARRIER = 1, 2, 3
PATTERN = bytes(range(256)) * 2


def imm_of(kind: int, rank: int) -> int:
    return kind << 16 | rank


def _setup(comm, provider: str, nbytes: int, **engine_kw):
    """Engine, a source and a destination buffer, everyone's addresses and dst descriptors."""
    eng = TransferEngine(provider, idle_yield=True, **engine_kw)
    src_buf = ctypes.create_string_buffer(nbytes)
    dst_buf = ctypes.create_string_buffer(nbytes)
    src = eng.register(ctypes.addressof(src_buf), nbytes)
    dst = eng.register(ctypes.addressof(dst_buf), nbytes)
    addrs = comm.allgather(eng.address)
    descs = comm.allgather(dst.descriptor())
    peers = eng.connect(addrs)
    return eng, src_buf, dst_buf, src, dst, peers, descs


def _group_of_others(comm, eng, peers, descs):
    others = [r for r in range(comm.size) if r != comm.rank]
    return others, eng.peer_group([peers[r] for r in others], [descs[r] for r in others])


def random_writes(comm, provider: str, seed: int, batches: int) -> int:
    """Rank 0 writes random (size, src offset, dst offset) batches into rank 1, which verifies every
    byte after counting the batch's immediates, then acks with a barrier. Returns bytes verified."""
    nbytes = 1 << 20
    eng, src_buf, dst_buf, src, dst, peers, descs = _setup(comm, provider, nbytes)
    rng = random.Random(seed)
    src_mem = bytes(rng.getrandbits(8) for _ in range(4096)) * (nbytes // 4096)
    ctypes.memmove(src_buf, src_mem, nbytes)
    other = 1 - comm.rank
    grp = eng.peer_group([peers[other]], [descs[other]])
    verified = 0
    try:
        for _ in range(batches):
            # K disjoint destination chunks; lengths include 0, 1, odd and up to the chunk size.
            k = rng.randint(1, 6)
            chunk = nbytes // k
            targets = []
            for j in range(k):
                length = rng.choice([0, 1, 7, rng.randint(0, 4096), rng.randint(0, chunk)])
                do = j * chunk + rng.randint(0, chunk - length)
                so = rng.randint(0, nbytes - length)
                targets.append((0, so, length, do))
            imms = [imm_of(DATA, 100 + j) for j in range(k)]
            if comm.rank == 0:
                eng.scatter(grp, src, targets, imms)
                eng.wait_imms({imm_of(ACK, 1): 1}, 10, "ack from rank 1")
                eng.wait_writes(10)
            else:
                eng.wait_imms({v: 1 for v in imms}, 10, "data from rank 0")
                for _, so, length, do in targets:
                    if dst_buf.raw[do:do + length] != src_mem[so:so + length]:
                        raise AssertionError(f"mismatch: target (so={so}, len={length}, do={do})")
                    verified += length
                eng.barrier(grp, imm_of(ACK, 1))
        eng.wait_writes(10)
        assert eng.imm_counts() == {}, eng.imm_counts()
    finally:
        eng.close()
    return verified


def all_to_all(comm, provider: str, iters: int, num_domains: int = 1, max_len: int = 256,
               engine_kw: dict | None = None) -> dict:
    """Every rank scatters a (sender, receiver, iteration)-dependent payload to every other rank
    (lengths vary and include 0), receivers verify, then all barrier. Repeated ``iters`` times."""
    slot = 512
    eng, src_buf, dst_buf, src, dst, peers, descs = _setup(
        comm, provider, slot * comm.size, num_domains=num_domains, **(engine_kw or {}))
    others, grp = _group_of_others(comm, eng, peers, descs)
    me = comm.rank
    dst_addr = ctypes.addressof(dst_buf)
    src_addr = ctypes.addressof(src_buf)
    data_expect = {imm_of(DATA, r): 1 for r in others}
    barrier_expect = {imm_of(BARRIER, r): 1 for r in others}

    def payload(s: int, r: int, i: int) -> tuple[int, int, int]:
        """(length, pattern start, dst offset within the slot) of s -> r at iteration i."""
        length = (s * 37 + r * 11 + i * 5) % (max_len + 1)
        if (s + r + i) % 7 == 0:
            length = 0
        return length, (s * 131 + r * 17 + i * 7) % 256, (i * 13 + r) % (slot - length + 1)

    t0 = time.perf_counter()
    try:
        for i in range(iters):
            targets = []
            for pos, r in enumerate(others):
                length, start, off = payload(me, r, i)
                ctypes.memmove(src_addr + r * slot, PATTERN[start:start + length], length)
                targets.append((pos, r * slot, length, me * slot + off))
            eng.scatter(grp, src, targets, imm_of(DATA, me))
            eng.wait_imms(data_expect, 10, f"data of iteration {i}")
            for s in others:
                length, start, off = payload(s, me, i)
                got = ctypes.string_at(dst_addr + s * slot + off, length)
                if got != PATTERN[start:start + length]:
                    raise AssertionError(f"rank {me} iteration {i}: bad payload from rank {s}")
            # Our source buffer is rewritten next iteration: its writes must have completed.
            eng.wait_writes(10)
            eng.barrier(grp, imm_of(BARRIER, me))
            eng.wait_imms(barrier_expect, 10, f"barrier of iteration {i}")
        eng.wait_writes(10)
        elapsed = time.perf_counter() - t0
        return {"leftover_imms": eng.imm_counts(), "pending": eng.writes_pending,
                "posted": eng.writes_posted, "completed": eng.writes_completed,
                "received": eng.imms_received, "eagain_retries": eng.eagain_retries,
                "domains": sorted(set(grp.domain_of)), "domain_names": list(eng.domain_names),
                "seconds": elapsed}
    finally:
        eng.close()


def flood(comm, provider: str, writes: int, per_scatter: int, engine_kw: dict) -> dict:
    """Rank 0 posts ``writes`` small writes to rank 1 through a deliberately small queue while rank 1
    does not poll for 0.3 s (software providers make no progress for a target that does not poll), then
    rank 1 counts them. Returns rank 0's counters / rank 1's received count and data check."""
    eng, src_buf, dst_buf, src, dst, peers, descs = _setup(comm, provider, 1 << 16, **engine_kw)
    other = 1 - comm.rank
    grp = eng.peer_group([peers[other]], [descs[other]])
    try:
        # Warm-up round trip: the lazy connection's -FI_EAGAINs are not back-pressure.
        eng.barrier(grp, imm_of(BARRIER, comm.rank))
        eng.wait_imms({imm_of(BARRIER, other): 1}, 20, "warm-up barrier")
        eng.wait_writes(20)
        comm.allgather("warm")
        if comm.rank == 0:
            throttled0 = eng.eagain_retries + eng.slot_waits
            pattern = bytes((7 * k) % 256 for k in range(1 << 16))
            ctypes.memmove(src_buf, pattern, len(pattern))
            targets = [(0, 64 * j, 64, 64 * j) for j in range(per_scatter)]
            for _ in range(writes // per_scatter):
                eng.scatter(grp, src, targets, imm_of(DATA, 0))
            eng.wait_writes(20)
            eng.wait_imms({imm_of(ACK, 1): 1}, 20, "ack from rank 1")
            return {"throttled": eng.eagain_retries + eng.slot_waits - throttled0,
                    "eagain_retries": eng.eagain_retries, "slot_waits": eng.slot_waits,
                    "posted": eng.writes_posted - 1, "completed": eng.writes_completed - 1}
        time.sleep(0.3)
        total = writes // per_scatter * per_scatter
        eng.wait_imms({imm_of(DATA, 0): total}, 20, "flood from rank 0")
        ok = dst_buf.raw[:64 * per_scatter] == bytes((7 * k) % 256 for k in range(64 * per_scatter))
        eng.barrier(grp, imm_of(ACK, 1))
        eng.wait_writes(20)
        return {"received": eng.imms_received - 1, "data_ok": ok}
    finally:
        eng.close()


def killed_peer(comm, provider: str, timeout_s: float) -> dict | None:
    """Rank ``size-1`` dies after the exchange. Rank 0 waits for a barrier from everyone and must get a
    TimeoutError naming the dead rank (and only it) within ``timeout_s`` (plus slack); then a write to
    the dead rank must fail (TimeoutError or FabricError naming the peer) instead of hanging."""
    from moe_a2a.proxy.libfabric import FabricError

    eng, src_buf, dst_buf, src, dst, peers, descs = _setup(comm, provider, 4096, timeout_s=timeout_s)
    dead = comm.size - 1
    try:
        comm.allgather("ready")
        if comm.rank == dead:
            comm.die()
        if comm.rank != 0:
            to_root = eng.peer_group([peers[0]], [descs[0]])
            eng.barrier(to_root, imm_of(BARRIER, comm.rank))
            # Stay alive and keep progressing (software providers need both ends to progress for the
            # lazy connection and the data) until rank 0 is done with the dead rank.
            eng.wait_imms({imm_of(ACK, 0): 1}, 4 * timeout_s + 10, "release from rank 0")
            eng.wait_writes(timeout_s)
            return None
        others, grp = _group_of_others(comm, eng, peers, descs)
        expect = {imm_of(BARRIER, r): 1 for r in others}
        names = {imm_of(BARRIER, r): f"rank {r}" for r in others}
        out = {}
        t0 = time.monotonic()
        try:
            eng.wait_imms(expect, timeout_s, "barrier", names=names)
            out["wait"] = "no TimeoutError"
        except TimeoutError as e:
            out["wait"] = str(e)
        out["wait_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        to_dead = eng.peer_group([peers[dead]], [descs[dead]])
        try:
            eng.barrier(to_dead, imm_of(BARRIER, 0))
            eng.wait_writes(timeout_s)
            out["write"] = "no error"
        except (TimeoutError, FabricError) as e:
            out["write"] = f"{type(e).__name__}: {e}"
        out["write_s"] = time.monotonic() - t0
        out["dead_peer"] = str(peers[dead])
        eng.barrier(eng.peer_group([peers[r] for r in others if r != dead], [descs[r] for r in others if r != dead]),
                    imm_of(ACK, 0))
        eng.wait_writes(timeout_s)
        return out
    finally:
        eng.close()


def exchange_over_gloo(comm, init_file: str) -> list:
    """``bootstrap.exchange`` over a real gloo group: gather engine addresses."""
    import torch.distributed as dist

    from moe_a2a.runtime.bootstrap import exchange

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=comm.rank, world_size=comm.size)
    try:
        eng = TransferEngine("tcp")
        try:
            addrs = exchange(None, eng.address)
            assert addrs[comm.rank] == eng.address
            return [str(a) for a in addrs]
        finally:
            eng.close()
    finally:
        dist.destroy_process_group()
