"""`LocalCluster`: N ranks on this machine, one process each (the package's docstring is the account)."""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from typing import Callable

from ..config import A2AConfig
from ..protocol.memory import check_fits_in_memory
from ..protocol.words import MAX_PROXY_SHARDS
from ..runtime import placement
from .codec import _dumps, _loads
from .processes import _CLUSTER_ENV, _cluster_processes, _is_zombie, _remove_files_of, _start_time
from .rank import _ABORT_SIGNAL, _DIED, _RANK_ENV, _START_ALLOWANCE_S, _rank_main
from .template import _ForkedRank, _Template, _template_main, template_context

_TRANSPORTS = ("auto", "shm", "tcp", "efa", "verbs", "emulated")  # AllToAll's; efa/verbs need their devices
# A rank process re-runs the caller's main module before it runs `_rank_main` (multiprocessing's
# "spawn" and "forkserver" do). If that module starts a LocalCluster itself (no `if __name__ == "__main__":` guard), the
# rank leaves with this exit code, and the caller raises a RuntimeError naming the guard.
_EXIT_UNGUARDED_MAIN = 87


def _main_module() -> str:
    where = getattr(sys.modules.get("__main__"), "__file__", None)
    return f"the main module ({where})" if where else "the main module"


_GUARD = ("put the code that starts the cluster under `if __name__ == \"__main__\":` (or in a function "
          "called only from there)")



def _failure(what: str, errors: dict, ok: list[int]) -> str:
    """The ranks' errors, root cause first: a summary line naming it and what each other rank saw, then
    every rank's traceback in that order."""
    order = sorted(errors, key=lambda r: (errors[r][1]["tier"], errors[r][1]["t"], r))
    first = order[0]
    info = errors[first][1]
    head = f"{what}: rank {first} raised {info['type']}" + (f": {info['line']}" if info["line"] else "")
    by_type: dict[str, list[int]] = {}
    for r in order[1:]:
        by_type.setdefault(errors[r][1]["type"], []).append(r)
    seen = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, sorted(rs)))}: {name}" for name, rs in by_type.items()]
    if ok:
        seen.append(f"rank{'s' if len(ok) > 1 else ''} {', '.join(map(str, ok))} finished")
    if seen:
        head += " (the root cause; then " + "; ".join(seen) + ")"
    return head + "".join(f"\n--- rank {r} raised: ---\n{errors[r][0].rstrip()}" for r in order)


def cluster_device(device) -> str:
    """LocalCluster's `device`, normalised once: "cpu" (also "cpu:0", `torch.device("cpu")`) or "cuda" (also
    `torch.device("cuda")`), or ValueError. "cuda:N" is refused: the cluster places rank i on GPU i % num_gpus
    (CUDA_VISIBLE_DEVICES picks the GPUs)."""
    import torch

    if isinstance(device, bool) or not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be 'cpu' or 'cuda' (a str or torch.device), got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda" and dev.index is None:
        return "cuda"
    if dev.type == "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}: LocalCluster places rank i on GPU "
                         f"i % num_gpus (CUDA_VISIBLE_DEVICES picks the GPUs)")
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


class LocalCluster:
    """`world_size` ranks on this machine, `node_size` per simulated node (same-node peers share
    memory; others talk over `transport`).

    Args:
        cfg: the sizes, shared by every rank.
        world_size: number of rank processes.
        node_size: ranks per node (default: all on one node).
        transport: "shm", "tcp" or "auto" (here: shm); "efa" and "verbs" where those devices exist;
            "emulated" (the emulated NIC, an instrument: docs/transport.md).
        device: "cpu" (kernels under TRITON_INTERPRET=1) or "cuda" (rank i on GPU i % num_gpus); also as
            `torch.device`, and "cpu:0" is "cpu" (`cluster_device`); `cluster.device` is the normalised str.
        timeout_s: the ranks' `AllToAll` timeout, and bound on every `run` (+ 10 s) and on start-up
            (+ 60 s, which the ranks' bootstrap group waits too); a rank that hangs ends in TimeoutError.
        gpu_wait: passed to every `AllToAll` ("kernel" is needed to capture CUDA graphs).
        buffers: passed to every `AllToAll` ("auto", "staged", "host", "gpu" or "memfd").
        nics: passed to every `AllToAll` ("auto" or a list of libfabric domain names).
        proxies: passed to every `AllToAll` (proxy processes per rank: "auto" or a positive int, at most
            the number of remote peers per rank, or 16 under the relay, whose writes go in a piece per proxy).

    Use as a context manager; `run(fn, *args)` calls `fn(a2a, rank, *args)` on every rank and returns
    the results in rank order (tensors of any dtype, float8 included, go both ways; results come back
    on the CPU). In a script, start the cluster under `if __name__ == "__main__":` (the ranks re-run
    the main module); without the guard, start-up raises a RuntimeError saying so. When a rank's `fn`
    raises, `run` raises RuntimeError with that rank's error first and the cluster stays usable; when a
    rank dies, `run` raises at once and the cluster must be rebuilt (`run` says which).

    Every argument is checked here, before any process starts (ValueError naming it), and so is
    memory: with device="cpu" the `world_size` ranks' shared segments (send and recv buffers
    included: `Layout.segment_bytes`) must fit this machine's physical memory together, with
    device="cuda" one rank's must (`moe_a2a.protocol.memory.check_fits_in_memory`).
    """

    def __init__(self, cfg: A2AConfig, world_size: int = 4, node_size: int | None = None,
                 transport: str = "auto", device: str = "cpu", timeout_s: float = 30.0,
                 gpu_wait: str = "auto", buffers: str = "auto", nics="auto", proxies="auto") -> None:
        if not isinstance(cfg, A2AConfig):
            raise ValueError(f"cfg must be an A2AConfig, got {type(cfg).__name__} {cfg!r:.200}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int)):
            raise ValueError(f"node_size must be None or a positive divisor of world_size ({world_size}), "
                             f"got {node_size!r}")
        node_size = world_size if node_size is None else node_size
        layout = cfg.layout(world_size, node_size)  # validates divisibility before any process starts
        if not isinstance(transport, str) or transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(map(repr, _TRANSPORTS))}, got {transport!r}")
        device = cluster_device(device)
        if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s)
                or timeout_s <= 0):
            raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
        placement.check_options(gpu_wait, buffers, nics)
        remote = world_size - node_size
        # Under the relay with remote peers each write goes in pieces, one per proxy: any number up to the most
        most = MAX_PROXY_SHARDS if layout.relay and remote else min(max(1, remote), MAX_PROXY_SHARDS)
        if proxies != "auto" and (isinstance(proxies, bool) or not isinstance(proxies, int) or proxies < 1
                                  or proxies > most):
            raise ValueError(f"proxies must be 'auto' or an int in [1, {most}] "
                             f"(at most the {remote} remote peers of a rank, or {MAX_PROXY_SHARDS} under the relay), "
                             f"got {proxies!r}")
        if buffers == "gpu" and device != "cuda":
            raise ValueError(f"buffers='gpu' needs device='cuda', got device={device!r}")
        if buffers == "memfd" and device != "cpu":
            raise ValueError(f"buffers='memfd' is for device='cpu', got device={device!r}")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device='cuda' needs a CUDA GPU (none found)")
        # Every rank's segment is host memory on the CPU (all `world_size` of them on this machine); on
        # GPUs at least one rank's buffers must fit (they are host-staged with remote peers over tcp/shm).
        check_fits_in_memory(layout, ranks=world_size if device == "cpu" else 1)
        self.cfg, self.world_size, self.node_size = cfg, world_size, node_size
        self.transport, self.device, self.timeout_s = transport, device, timeout_s
        self.gpu_wait, self.buffers, self.nics, self.proxies = gpu_wait, buffers, nics, proxies
        self._procs: list = []
        self._conns: list = []
        self._alive: set = set()  # ranks that got past the spawn bootstrap into `_rank_main`
        self._broken: str | None = None
        self._store_dir: str | None = None  # private (0700) directory of the bootstrap's file store
        self._cluster_id: str | None = None  # in the environment of the ranks and their proxies
        self._started: dict[int, int | None] = {}  # pid -> start time of every rank and proxy seen
        self._abort_words = None  # shared with the ranks: (run id, culprit) of the run being interrupted
        self._template: _Template | None = None  # device="cpu": the process that forks the ranks
        self._run_id = 0
        self._resets = 0

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if getattr(mp.current_process(), "_inheriting", False):
            # We are a process started by multiprocessing that is re-running the main module, which starts
            # a cluster at import: without a guard every rank would try to start its own ranks.
            if os.environ.get(_RANK_ENV):  # one of our ranks: the caller explains
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(_EXIT_UNGUARDED_MAIN)  # not SystemExit: a forkserver's child would exit 1 with it
            raise RuntimeError("LocalCluster: cannot start a cluster while this process is bootstrapping "
                               f"(multiprocessing is re-running {_main_module()}); {_GUARD}.")
        if self._procs:
            raise ValueError("LocalCluster is already started")
        ctx = mp.get_context("spawn")
        # multiprocessing's resource tracker starts with the first process spawned: start it before our
        # environment marks the cluster's processes (close() kills whatever carries the mark).
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        self._store_dir = tempfile.mkdtemp(prefix="moe_a2a-store-")  # mode 0700: only we can reach it
        self._cluster_id = secrets.token_hex(8)
        env = {_RANK_ENV: "1", _CLUSTER_ENV: self._cluster_id, "GLOO_SOCKET_IFNAME": "lo"}
        if self.device == "cpu":
            env["TRITON_INTERPRET"] = "1"  # kernels run on CPU tensors
            # The ranks run torch with one thread (set_num_threads(1)); their template forks them, so it
            # must not start BLAS/OpenMP worker threads at import (numpy's OpenBLAS would).
            for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
                env[name] = os.environ.get(name) or "1"
        # GPU ranks compile their kernels, whatever this process has set (a CPU run in it may have set it)
        unset = ["TRITON_INTERPRET"] if self.device == "cuda" else []
        saved = {k: os.environ.get(k) for k in [*env, *unset]}
        os.environ.update(env)  # the children inherit it (spawn execs with our environment)
        for k in unset:
            os.environ.pop(k, None)
        try:
            self._abort_words = ctx.RawArray("q", 2)
            rank_args = (self.world_size, os.path.join(self._store_dir, "store"), self.cfg, self.node_size,
                         self.transport, self.device, self.timeout_s,
                         {"gpu_wait": self.gpu_wait, "buffers": self.buffers, "nics": self.nics,
                          "proxies": self.proxies})
            if self.device == "cpu":
                # One template process (the forkserver's) forks every rank (a GPU rank must not be forked from a process
                # that may have touched CUDA while re-running the main module: those are spawned one by one).
                pipes = [ctx.Pipe() for _ in range(self.world_size)]
                control, control_theirs = ctx.Pipe(duplex=False)
                t = template_context({_RANK_ENV: "1"}, (_CLUSTER_ENV,)).Process(
                    target=_template_main, daemon=True, name="moe_a2a-ranks",
                    args=(self.world_size, rank_args, [theirs for _, theirs in pipes], control_theirs,
                          self._abort_words, dict(os.environ)))
                self._conns = [ours for ours, _ in pipes]
                t.start()
                self._template = _Template(t, control)
                self._started[t.pid] = _start_time(t.pid)
                self._procs = [_ForkedRank(self._template, r) for r in range(self.world_size)]
                for _, theirs in pipes:
                    theirs.close()
                control_theirs.close()
            else:
                for rank in range(self.world_size):
                    ours, theirs = ctx.Pipe()
                    p = ctx.Process(target=_rank_main, daemon=True, name=f"moe_a2a-rank{rank}",
                                    args=(rank, *rank_args, theirs, self._abort_words))
                    self._conns.append(ours)
                    p.start()
                    self._procs.append(p)
                    self._started[p.pid] = _start_time(p.pid)
                    theirs.close()
        except BaseException:
            self.close()
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            ready = self._collect("start-up", self.timeout_s + _START_ALLOWANCE_S)
        except BaseException:
            self.close()
            raise
        self._note_rank_pids()
        for _, proxies, _ in ready:  # (pid, start time) of each rank's proxies: their files are ours to remove
            for pid, started in proxies or ():
                self._started[pid] = started

    def run(self, fn: Callable, *args) -> list:
        """Call `fn(a2a, rank, *args)` on every rank; results in rank order.

        Tensors of any dtype may be in `args` and in the results (nested in containers too); results
        come back on the CPU.

        When `fn` raises on a rank, the other ranks' functions are interrupted at once (they raise
        `RunAborted` where they were, e.g. waiting for that rank in a call), and this raises RuntimeError
        naming the root cause first: the first rank's own exception with its traceback, then what the
        others saw (their timeouts, `CallAborted`, `RunAborted`). The cluster stays usable: before this
        raises, every rank renews its process group (a collective a failed function left open would
        desynchronise it; objects that `fn` kept from earlier runs built on the old group are void) and,
        if any rank's AllToAll was left in a call (or unusable), closes it and builds a new one. A rank
        that dies (or died since the last run) makes this raise at once; the cluster is then closed and
        must be rebuilt. A rank that does not answer within `timeout_s` + 10 s gives TimeoutError (the
        cluster is then closed)."""
        self._check_usable()
        self._run_id += 1
        payload = _dumps((fn, args))
        for c in self._conns:
            c.send(("run", self._run_id, payload))
        answers = self._collect("run", self.timeout_s + 10.0)
        errors = {r: a[0] for r, a in enumerate(answers) if a[0] is not None}
        if not errors:
            return [_loads(a[1]) for a in answers]
        ok = [r for r in range(self.world_size) if r not in errors]
        message = _failure("run", errors, ok)
        statuses = [a[2] for a in answers]
        rebuild = not (all(idle for idle, _ in statuses) and len({e for _, e in statuses}) == 1)
        try:
            self._reset(rebuild)
        except BaseException as exc:
            raise RuntimeError(message + f"\n(the rebuild after it failed, the cluster is closed: build a new "
                               f"LocalCluster)\n{exc}") from None
        if rebuild:
            raise RuntimeError(message + "\n(a call was left unfinished: every rank's AllToAll and process group "
                               "were rebuilt: the cluster is usable)")
        raise RuntimeError(message + "\n(every rank's AllToAll is idle at the same call and kept; the process group "
                           "was renewed: the cluster is usable)")

    def _check_usable(self) -> None:
        if self._broken:
            raise RuntimeError(f"LocalCluster is unusable: {self._broken}; build a new LocalCluster")
        if not self._procs:
            raise ValueError("LocalCluster is not started (use it as a context manager)")
        dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
        if dead:
            codes = ", ".join(str(self._procs[r].exitcode) for r in dead)
            self._broken = f"rank(s) {dead} died (exit code(s) {codes})"
            self.close()
            raise RuntimeError(f"LocalCluster is unusable: {self._broken} since the last run; the cluster is closed: "
                               f"build a new LocalCluster")

    def _reset(self, rebuild: bool) -> None:
        """Every rank renews its process group (a fresh file store) and, with `rebuild`, its AllToAll."""
        self._resets += 1
        store = os.path.join(self._store_dir, f"store-{self._resets}")
        for c in self._conns:
            c.send(("reset", store, rebuild))
        for r, (error, proxies, _) in enumerate(self._collect("rebuild", self.timeout_s + _START_ALLOWANCE_S)):
            if error is not None:  # _collect raised already; kept for clarity of the contract
                raise RuntimeError(f"rank {r} could not rebuild")
            for pid, started in proxies or ():
                self._started[pid] = started

    def _interrupt(self, ranks, culprit: int) -> None:
        """Make the functions of `ranks` raise RunAborted (in this run only)."""
        if self._abort_words is None:
            return
        self._abort_words[1] = culprit
        self._abort_words[0] = self._run_id
        for r in ranks:
            pid = self._procs[r].pid
            if pid is not None and self._procs[r].is_alive():
                try:
                    os.kill(pid, _ABORT_SIGNAL)
                except ProcessLookupError:
                    pass

    def _collect(self, what: str, timeout_s: float) -> list:
        """One answer per rank (in rank order): `(error or None, value, AllToAll status)`, error being
        `(traceback, info)`. In a run, the first error interrupts the ranks still running; start-up and
        rebuilds raise on any error (root cause first; the cluster is closed). A rank whose process ended
        without answering ("died", decided from the process, not from any text) gives TimeoutError at
        once (the others are interrupted and get a few seconds to report; the cluster is closed); ranks
        that ended during start-up before running `_rank_main` (the main module failed when re-run, e.g.
        no `__main__` guard) give RuntimeError."""
        answers: list = [None] * self.world_size
        pending = set(range(self.world_size))
        errors: dict[int, tuple] = {}
        died: dict[int, int | None] = {}  # rank -> exit code of a process that ended without answering
        deadline = time.monotonic() + timeout_s
        grace = None  # after a death (or a failed start-up): how long the others get to report
        while pending:
            for r in sorted(pending):
                c, p = self._conns[r], self._procs[r]
                if c.poll(0.01):
                    try:
                        msg = c.recv()
                    except EOFError:
                        p.join(1.0)
                        pending.discard(r)
                        died[r] = p.exitcode
                        continue
                    if msg[0] == "alive":
                        self._alive.add(r)
                        continue
                    pending.discard(r)
                    if msg[0] == "error":
                        errors[r] = msg[1]
                        answers[r] = (msg[1], None, msg[2])
                        if what == "run" and len(errors) == 1 and not died:
                            self._interrupt(pending, culprit=r)
                    else:
                        answers[r] = (None, msg[1], msg[2] if len(msg) > 2 else None)
                elif not p.is_alive():
                    pending.discard(r)
                    died[r] = p.exitcode
            if _EXIT_UNGUARDED_MAIN in died.values():
                break
            if (died or (errors and what != "run")) and grace is None:
                if died and what == "run":
                    self._interrupt(pending, culprit=_DIED)
                grace = time.monotonic() + 5.0
            if grace is not None and time.monotonic() > grace:
                break
            if time.monotonic() > deadline:
                self._broken = f"{what}: ranks {sorted(pending)} did not answer within {timeout_s:g}s"
                self.close()
                detail = ("\n" + _failure(what, errors, [])) if errors else ""
                raise TimeoutError(self._broken + detail)
        not_started = sorted(r for r, code in died.items()
                             if r not in self._alive and (code is None or code >= 0))
        if not_started:
            codes = sorted({died[r] for r in not_started}, key=str)
            self._broken = f"{what}: the rank processes could not start"
            self.close()
            if _EXIT_UNGUARDED_MAIN in codes:
                raise RuntimeError(f"LocalCluster: the rank processes could not start because {_main_module()} "
                                   "starts a LocalCluster when they re-run it (multiprocessing re-runs it in "
                                   f"every rank, as `__mp_main__`); {_GUARD}.")
            raise RuntimeError(f"LocalCluster: the rank processes {not_started} could not start: they exited "
                               f"(code {', '.join(map(str, codes))}) before running any LocalCluster code, while "
                               f"re-running {_main_module()} (multiprocessing re-runs it in every rank, "
                               "as `__mp_main__`) or loading their arguments; their output above says why. If "
                               f"the main module is a script, {_GUARD}.")
        if died:
            dead = sorted(died)
            self._broken = f"rank(s) {dead} died"
            self.close()
            raise TimeoutError(f"{what}: rank(s) {dead} died (exit code(s) "
                               f"{', '.join(str(died[q]) for q in dead)}); the cluster is closed and must be rebuilt "
                               f"(a new LocalCluster)" + ("; what the others saw:\n" + _failure(what, errors, [])
                                                          if errors else ""))
        if errors and what != "run":
            self._broken = f"{what} failed"
            self.close()
            raise RuntimeError(_failure(what, errors, [r for r, a in enumerate(answers) if a is not None and a[0] is None])
                               + "\n(the cluster is closed)")
        return answers

    def close(self) -> None:
        """Stop every rank (politely, then by force), then whatever else of the cluster still runs
        (proxies orphaned by a killed rank), and remove what they left: segments and libfabric shm
        regions in /dev/shm, the bootstrap's store directory. Idempotent."""
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10.0
        self._note_rank_pids()
        if self._cluster_id is not None and self._procs:
            # The proxies alive now (one may be starting): a killed rank's proxy dies by PR_SET_PDEATHSIG,
            # possibly before the scan below, and its files are found by its pid.
            self._started.update(_cluster_processes(self._cluster_id))
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        if self._template is not None:  # it exits once it has reaped every rank
            t = self._template.proc
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                t.kill()
                t.join()
            self._template.control.close()
            self._template = None
        if self._cluster_id is not None:
            # A rank killed by a signal leaves its proxy to the kernel's PR_SET_PDEATHSIG (asynchronous)
            # or to its ppid check: make sure, and learn their pids for the files below.
            self._started.update(_cluster_processes(self._cluster_id))
            self._kill_cluster_processes(deadline=time.monotonic() + 10.0)
        for pid, started in self._started.items():
            # A rank or proxy that was killed could not unlink its files: their names hold its pid.
            _remove_files_of(pid, started)
        for c in self._conns:
            c.close()
        self._procs, self._conns, self._started = [], [], {}
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def _note_rank_pids(self) -> None:
        """Forked ranks: their (pid, start time) as the template reported them (their files are ours)."""
        if self._template is not None:
            self._template.poll()
            self._started.update(self._template.pids.values())

    def _kill_cluster_processes(self, deadline: float) -> None:
        """SIGKILL every process still carrying this cluster's id; wait until each is gone or a zombie."""
        while True:
            left = {pid: t for pid, t in _cluster_processes(self._cluster_id).items() if not _is_zombie(pid)}
            if not left or time.monotonic() > deadline:
                return
            for pid, started in left.items():
                if _start_time(pid) == started:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            time.sleep(0.02)

    def kill_rank(self, rank: int) -> None:
        """Kill one rank process with SIGKILL, as a crash would (for fault-injection tests and demos): it
        cleans nothing up; `close()` does."""
        self._procs[rank].kill()
        self._procs[rank].join()
