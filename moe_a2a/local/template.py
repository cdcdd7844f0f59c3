"""The ranks' template process (device="cpu"): its body, which forks every rank from one start-up, and the
caller's view of it and of the ranks it forked (`_Template`, `_ForkedRank`)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from multiprocessing import forkserver

from .processes import _is_zombie, _start_time
from .rank import _rank_main


# What the forkserver imports once for every template it forks (`template_context`).
_PRELOAD = ["torch", "torch.distributed", "moe_a2a.all_to_all"]
_SERVER_ENV = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_served = False  # this process started multiprocessing's forkserver with _PRELOAD and _SERVER_ENV


def template_context(server_env: dict, unset: tuple[str, ...]):
    """The multiprocessing context that starts template processes: the "forkserver" one, whose server this
    process starts once with torch and the interpreted kernels imported (so a cluster starts in about a
    second instead of an import of seconds), in this environment with `server_env` and without `unset` (one
    cluster's id: each template gets its cluster's whole environment from `_template_main`; what a template
    needs while it re-runs the main module, before that, must be in `server_env`). "spawn" when another part
    of this process started the forkserver first (its imports and environment are not ours to assume)."""
    global _served
    if not _served and getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return mp.get_context("spawn")
    # Every time, not once: a server that died is started again here, in this environment, not by the
    # template's start in the caller's (which carries the cluster's id).
    saved = dict(os.environ)
    try:
        for k in unset:
            os.environ.pop(k, None)
        os.environ.update(_SERVER_ENV)
        os.environ.update(server_env)
        forkserver.set_forkserver_preload(_PRELOAD)
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _served = True
    return mp.get_context("forkserver")


def _template_main(world_size: int, rank_args: tuple, conns: list, control, abort_words, env: dict) -> None:
    """The ranks' template process (device="cpu"): import what every rank needs once, then fork the ranks
    from this process, so N ranks cost one start-up (importing torch and triton: seconds of CPU) instead of
    N; then reap them, telling the caller each one's exit code. Forking is safe here: nothing has touched a
    GPU or started a thread pool (the ranks' environment asks for one BLAS/OpenMP thread). `env`: the
    caller's environment for the ranks (a forkserver's child has the server's own)."""
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed  # noqa: F401 - imported once, here, for every rank

    from .. import all_to_all  # noqa: F401 - the kernels too (TRITON_INTERPRET is set: interpreted)

    torch.set_num_threads(1)
    ranks: dict[int, int] = {}
    for rank in range(world_size):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for i, c in enumerate(conns):  # only the caller's end and this rank's may stay open (EOF)
                    if i != rank and not c.closed:
                        c.close()
                control.close()
                _rank_main(rank, *rank_args, conns[rank], abort_words)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - said on stderr, as a spawned rank's would be
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)  # never the template's exit handlers
        ranks[pid] = rank
        conns[rank].close()
        control.send(("forked", rank, pid, _start_time(pid)))
    while ranks:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        rank = ranks.pop(pid, None)
        if rank is not None:
            try:
                control.send(("exit", rank, os.waitstatus_to_exitcode(status)))
            except OSError:  # the caller is gone: reap the rest anyway
                pass
    # Out at once: an interpreter that imported torch and triton takes about a second to tear down, and
    # LocalCluster.close waits for this process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Template:
    """The caller's side of the template process: the forked ranks' pids and exit codes, as it reports them."""

    def __init__(self, proc, control) -> None:
        self.proc, self.control = proc, control
        self.pids: dict[int, tuple[int, int | None]] = {}  # rank -> (pid, start time)
        self.codes: dict[int, int] = {}

    def poll(self) -> None:
        try:
            while self.control.poll(0):
                msg = self.control.recv()
                if msg[0] == "forked":
                    self.pids[msg[1]] = (msg[2], msg[3])
                else:
                    self.codes[msg[1]] = msg[2]
        except (EOFError, OSError):
            pass


class _ForkedRank:
    """A rank forked by the template process (our grandchild), with the part of `multiprocessing.Process`
    that LocalCluster uses: pid, is_alive(), exitcode, kill(), join()."""

    def __init__(self, template: _Template, rank: int) -> None:
        self._t, self._rank = template, rank

    @property
    def pid(self) -> int | None:
        self._t.poll()
        return self._t.pids.get(self._rank, (None, None))[0]

    @property
    def exitcode(self) -> int | None:
        self._t.poll()
        if self._rank in self._t.codes:
            return self._t.codes[self._rank]
        if self._rank not in self._t.pids and not self._t.proc.is_alive():
            return self._t.proc.exitcode  # never forked: the template's exit (e.g. no `__main__` guard)
        return None

    def is_alive(self) -> bool:
        t = self._t
        t.poll()
        if self._rank in t.codes:
            return False
        if self._rank not in t.pids or t.proc.is_alive():
            return t.proc.is_alive()  # the template reports every exit of its ranks
        pid, started = t.pids[self._rank]
        return _start_time(pid) == started and not _is_zombie(pid)

    def kill(self) -> None:
        if self.is_alive():
            pid, started = self._t.pids[self._rank]
            if _start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.01)

