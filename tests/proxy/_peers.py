"""Run a function in N real processes (forked by multiprocessing's forkserver) with a tiny all-gather between them.

The parent relays: each child sends ``("gather", obj)`` and gets back the list of every rank's object;
``("result", value)`` / ``("error", traceback)`` end a child. A child that dies (killed on purpose by a
test) is reported as :class:`Died` and makes pending gathers fail in the others instead of hanging.
Every wait has a deadline; on timeout every child is killed.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as mp_wait

from moe_a2a.protocol.memory import remove_process_shm_files


@dataclass(frozen=True)
class Died:
    """Result slot of a rank whose process exited without a result (e.g. killed by the test)."""

    exitcode: int | None


class Comm:
    """Child side: ``rank``, ``size`` and ``allgather(obj) -> list``."""

    def __init__(self, rank: int, size: int, conn, timeout_s: float):
        self.rank, self.size, self._conn, self._timeout_s = rank, size, conn, timeout_s

    def allgather(self, obj):
        self._conn.send(("gather", obj))
        if not self._conn.poll(self._timeout_s):
            raise TimeoutError(f"rank {self.rank}: allgather timed out after {self._timeout_s}s")
        kind, value = self._conn.recv()
        if kind != "gathered":
            raise RuntimeError(f"rank {self.rank}: allgather failed: {value}")
        return value

    def die(self) -> None:
        """Kill this process abruptly (SIGKILL), like a crashed rank."""
        os.kill(os.getpid(), signal.SIGKILL)


def _child(rank: int, size: int, conn, fn, args, timeout_s: float) -> None:
    try:
        result = fn(Comm(rank, size, conn, timeout_s), *args)
        conn.send(("result", result))
    except BaseException:  # noqa: BLE001 -- everything goes back to the parent as text
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


_CTX = None  # made at the first run_peers


def _context():
    """multiprocessing's "forkserver", its server having imported torch: each peer is forked from it, so a
    test's N peers do not each import torch (seconds of CPU apiece on the CI machine's two cores). The server
    touches no GPU and starts no thread, so forking it is safe on GPU machines too. Its environment is this
    process's when it started (the first run_peers): a setting a peer needs travels as an argument."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed"])
    return _CTX


def run_peers(size: int, fn, *args, timeout_s: float = 30.0) -> list:
    """Run ``fn(comm, *args)`` in ``size`` fresh processes; return their results by rank.

    Raises ``AssertionError`` with the children's tracebacks if any raised, ``TimeoutError`` if they
    did not all finish within ``timeout_s``. A rank that died without a result yields :class:`Died`.
    """
    ctx = _context()
    conns, procs = [], []
    for rank in range(size):
        parent_end, child_end = ctx.Pipe()
        p = ctx.Process(target=_child, args=(rank, size, child_end, fn, args, timeout_s), daemon=True)
        p.start()
        child_end.close()
        conns.append(parent_end)
        procs.append(p)
    results: list = [None] * size
    done = [False] * size
    errors: dict[int, str] = {}
    gather: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not all(done):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r in range(size) if not done[r]]
                raise TimeoutError(f"run_peers({fn.__name__}): ranks {missing} did not finish in {timeout_s}s")
            for c in mp_wait([c for r, c in enumerate(conns) if not done[r]], timeout=min(remaining, 1.0)):
                rank = conns.index(c)
                try:
                    kind, value = c.recv()
                except (EOFError, OSError):
                    procs[rank].join(5)
                    results[rank] = Died(procs[rank].exitcode)
                    done[rank] = True
                    gather.pop(rank, None)
                    continue
                if kind == "gather":
                    gather[rank] = value
                elif kind == "result":
                    results[rank], done[rank] = value, True
                else:
                    errors[rank], done[rank] = value, True
            alive = [r for r in range(size) if not done[r]]
            if gather and all(r in gather for r in alive):
                if len(gather) == size:
                    reply = ("gathered", [gather[r] for r in range(size)])
                else:
                    reply = ("failed", f"ranks {[r for r in range(size) if r not in gather]} are gone")
                for r in gather:
                    conns[r].send(reply)
                gather.clear()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
            if p.exitcode is not None:  # a killed child cannot remove libfabric shm's file named after it
                remove_process_shm_files(p.pid)
        for c in conns:
            c.close()
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())))
    return results
