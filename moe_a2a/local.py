"""`LocalCluster`: N ranks on this machine, one process each, for notebooks, tests and demos.

Each rank process joins a gloo group (bootstrap only), builds its own `AllToAll` (which starts its
own proxy process) and then runs the functions `run` sends it. Functions travel with cloudpickle,
so a function defined in a notebook cell works; tensors travel as raw bytes (`_dumps` / `_loads`),
so every dtype (float8 included, which torch cannot pickle through cloudpickle) goes both ways.

Ranks start through multiprocessing's "spawn", which re-runs the main module of a script (as
`__mp_main__`), so a script must start the cluster under `if __name__ == "__main__":`. With
device="cpu" one spawned template process does that, imports torch and the kernels once and forks
every rank from itself (N ranks cost one start-up, not N: 32 ranks start in seconds on 2 cores); GPU
ranks are spawned one by one (a process that may have touched CUDA cannot be forked).

A failed `run` (a rank's function raised) interrupts the other ranks' functions at once (`RunAborted`,
through a signal and two shared words), reports the root cause first, and rebuilds every rank's
`AllToAll` and process group when a call was left half done, so the next `run` works. A rank that
died makes `run` raise at once; the cluster must then be rebuilt.

Nothing listens beyond this machine: the ranks bootstrap through a file store in a private directory
(`tempfile.mkdtemp`, mode 0700, removed on `close`), not torch's TCPStore (which listens on every
interface), and gloo's sockets are bound to the loopback interface (GLOO_SOCKET_IFNAME=lo).

Nothing outlives `close()`, whatever died: ranks and proxies (orphaned ones too: they carry this
cluster's id in their environment) are stopped, and the files they left in /dev/shm (segments
`moe_a2a-{pid}-*`, libfabric shm regions `{pid}:*`) are removed once they are gone.
"""
from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
import pickle
import secrets
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import cloudpickle

from .config import A2AConfig
from .protocol.words import MAX_PROXY_SHARDS
from .protocol.memory import check_fits_in_memory, remove_process_shm_files
from .runtime import placement

_TRANSPORTS = ("auto", "shm", "tcp", "efa", "verbs", "emulated")  # AllToAll's; efa/verbs need their devices
# Set in the ranks' environment (their proxies inherit it): finds every process of one cluster in
# /proc, orphaned proxies of killed ranks included.
_CLUSTER_ENV = "MOE_A2A_LOCAL_CLUSTER_ID"
# What start-up (and a rebuild) may take beyond timeout_s: process start, imports, proxies, bootstrap.
_START_ALLOWANCE_S = 60.0


# ---- processes and their files -----------------------------------------------------------------------
def _start_time(pid: int) -> int | None:
    """Start time of process `pid` (clock ticks since boot: with the pid, a process's identity; pids are
    reused, 32768 of them by default), None when no process has that pid (zombies still have it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22; the name may hold spaces


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # gone
    return stat[stat.rindex(b")") + 2:].split()[0] in (b"Z", b"X")


def _cluster_processes(cluster_id: str) -> dict[int, int]:
    """{pid: start time} of the live processes whose environment carries `cluster_id` (ranks, proxies)."""
    marker = f"{_CLUSTER_ENV}={cluster_id}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
        except OSError:  # gone, a zombie, or another user's
            continue
        started = _start_time(int(name))
        if started is not None:
            found[int(name)] = started
    return found


def _remove_files_of(pid: int, started: int | None) -> None:
    """Remove the /dev/shm files of an exited process of ours, unless its pid now names another process."""
    now = _start_time(pid)
    if now is None or now == started:  # gone, or still ours (a zombie: its pid is reserved)
        remove_process_shm_files(pid)


# ---- what travels between the caller and the ranks -------------------------------------------------
# torch cannot pickle every dtype through cloudpickle (float8: "UntypedStorage has no attribute
# 'dtype'"), so a tensor is written as its raw bytes + dtype + shape + device and rebuilt from them.
# Everything else (functions, lambdas, classes defined in a notebook) goes through cloudpickle as before.

def _rebuild_tensor(data: bytearray, dtype, shape: tuple, device: str, requires_grad: bool,
                    parameter: bool):
    """Inverse of `_TensorPickler.reducer_override`: a tensor from its raw (C-order) bytes."""
    import torch

    flat = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape)
    if device != "cpu":
        t = t.to(device)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


class _TensorPickler(cloudpickle.Pickler):
    """cloudpickle, except that a plain tensor (or `nn.Parameter`) of any dtype, wherever it sits in
    the object (lists, dicts, namedtuples, dataclasses, closures, modules), is written as raw bytes.
    The same tensor object twice is sent once (pickle's memo); two views of one storage become two
    independent copies."""

    def __init__(self, file, to_cpu: bool = False) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.to_cpu = to_cpu

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if (torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter)
                and obj.layout == torch.strided and not obj.is_quantized and obj.device.type != "meta"):
            device = "cpu" if self.to_cpu else str(obj.device)
            t = obj.detach().cpu().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else bytearray()  # C-order bytes
            return _rebuild_tensor, (pickle.PickleBuffer(raw), obj.dtype, tuple(obj.shape), device,
                                     obj.requires_grad, type(obj) is torch.nn.Parameter)
        return super().reducer_override(obj)  # cloudpickle's (functions and classes by value)


def _dumps(obj: Any, to_cpu: bool = False) -> bytes:
    """Serialise `obj` for the other side of a rank pipe (`to_cpu`: tensors come back on the CPU)."""
    buf = io.BytesIO()
    _TensorPickler(buf, to_cpu=to_cpu).dump(obj)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    """Inverse of `_dumps`."""
    return pickle.loads(data)


# ---- ranks ------------------------------------------------------------------------------------------
# A rank process re-runs the caller's main module before it runs `_rank_main` (multiprocessing
# "spawn"). If that module starts a LocalCluster itself (no `if __name__ == "__main__":` guard), the
# rank leaves with this exit code, and the caller raises a RuntimeError naming the guard.
_EXIT_UNGUARDED_MAIN = 87
_RANK_ENV = "MOE_A2A_LOCAL_CLUSTER_RANK"  # set for the rank processes while they start


def _main_module() -> str:
    where = getattr(sys.modules.get("__main__"), "__file__", None)
    return f"the main module ({where})" if where else "the main module"


_GUARD = ("put the code that starts the cluster under `if __name__ == \"__main__\":` (or in a function "
          "called only from there)")


class RunAborted(BaseException):
    """Raised inside a rank's function when another rank's function raised (or its process died) during
    the same `LocalCluster.run`: the rank stops where it was (typically waiting for that rank), so `run`
    reports the root cause at once instead of this rank's timeout. A BaseException, as KeyboardInterrupt,
    so an `except Exception` in the function does not swallow it."""


# The parent interrupts a rank's function with this signal (after writing the run and the culprit into
# the shared abort words); the rank raises RunAborted only if that run is the one it is running.
_ABORT_SIGNAL = signal.SIGUSR1
_DIED = -1  # culprit word: "a rank died" (its number is in the message the parent gives)


def _exception_info(exc: BaseException) -> dict:
    """What the parent needs to order the ranks' errors: root causes first, then their consequences (a
    peer's timeout or abort), then the ranks interrupted by `run` itself; ties by when they were raised."""
    from .all_to_all import CallAborted

    tier = 2 if isinstance(exc, RunAborted) else 1 if isinstance(exc, (TimeoutError, CallAborted)) else 0
    text = str(exc).strip().splitlines()
    return {"type": type(exc).__name__, "line": text[0][:300] if text else "", "tier": tier, "t": time.monotonic()}


def _a2a_status(a2a) -> tuple:
    """(idle and usable, epoch) of a rank's AllToAll after a function ran: a failed run needs no rebuild when
    every rank is idle, usable and at the same epoch (an attribute that is not there means "rebuild")."""
    if a2a is None:
        return (False, -1)
    idle = (not getattr(a2a, "_closed", True) and getattr(a2a, "_error", 1) is None
            and getattr(a2a, "_state", 1) == 0)
    return (idle, getattr(a2a, "epoch", -1))


def _rank_main(rank: int, world_size: int, store: str, cfg: A2AConfig, node_size: int, transport: str,
               device: str, timeout_s: float, options: dict, conn, abort_words) -> None:
    """Body of one rank process: bootstrap (file store `store`, gloo on loopback), build AllToAll, serve
    `run` requests (and rebuilds after a failed run) until told to stop."""
    conn.send(("alive", os.getpid()))  # past the spawn bootstrap: the main module re-run, the arguments loaded
    os.environ.pop(_RANK_ENV, None)
    import datetime

    import torch
    import torch.distributed as dist

    from .all_to_all import AllToAll

    running = [None]  # the run id while the function of that run is on the stack

    def on_abort(signum, frame) -> None:
        run_id, culprit = int(abort_words[0]), int(abort_words[1])
        if running[0] is not None and running[0] == run_id:
            running[0] = None  # once
            why = "a rank died" if culprit == _DIED else f"rank {culprit} raised (its error is reported first)"
            raise RunAborted(f"rank {rank}: run interrupted here because {why}")

    signal.signal(_ABORT_SIGNAL, on_abort)

    def init_group(store_path: str, timeout: float) -> None:
        # A file store (no TCPStore listening on every interface) and gloo's sockets on loopback only.
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))

    def build(store_path: str):
        # The group serves start-up first (AllToAll's bootstrap exchanges): it gets the start-up allowance,
        # not the calls' timeout_s, which many ranks starting on few cores can exceed.
        init_group(store_path, timeout_s + _START_ALLOWANCE_S)
        built = AllToAll(cfg, node_group=node_size, transport=transport, device=dev, timeout_s=timeout_s, **options)
        # Started: what the functions do with the group (the facade's bootstrap, their own collectives) is
        # bounded by timeout_s again (a private torch function: without it the allowance stays).
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is not None:
            try:
                set_timeout(datetime.timedelta(seconds=timeout_s))
            except Exception:  # noqa: BLE001 - only a longer wait in a failing collective
                pass
        conn.send(("ready", [(h.proc.pid, _start_time(h.proc.pid)) for h in built.proxies]))
        return built

    a2a = None
    try:
        torch.set_num_threads(1)  # N ranks share the machine's cores
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dev = device
        if device == "cuda":
            dev = f"cuda:{rank % torch.cuda.device_count()}"
            torch.cuda.set_device(dev)
        a2a = build(store)
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg[0] == "reset":
                # After a failed run, every rank together: a new process group (a collective that a failed
                # function left open would desynchronise the old one) and, when a call was left half done
                # (`msg[2]`), a new AllToAll too.
                _, store_path, rebuild = msg
                if rebuild and a2a is not None:
                    try:
                        a2a.close()
                    except Exception:  # noqa: BLE001 - its files are removed when the cluster closes anyway
                        pass
                    a2a = None
                if dist.is_initialized():
                    dist.destroy_process_group()
                if a2a is None:
                    a2a = build(store_path)
                else:  # AllToAll uses its group only while it is built
                    init_group(store_path, timeout_s)
                    conn.send(("ready", [(h.proc.pid, _start_time(h.proc.pid)) for h in a2a.proxies]))
                continue
            _, run_id, payload = msg
            running[0] = run_id
            try:
                fn, args = _loads(payload)
                result = fn(a2a, rank, *args)
                if device == "cuda":
                    torch.cuda.synchronize()
                running[0] = None
                answer = ("ok", _dumps(result, to_cpu=True), _a2a_status(a2a))
            except BaseException as exc:
                running[0] = None
                answer = ("error", (traceback.format_exc(), _exception_info(exc)), _a2a_status(a2a))
            conn.send(answer)
    except BaseException as exc:
        try:
            conn.send(("error", (traceback.format_exc(), _exception_info(exc)), _a2a_status(None)))
        except OSError:
            pass
    finally:
        signal.signal(_ABORT_SIGNAL, signal.SIG_IGN)
        if a2a is not None:
            a2a.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _template_main(world_size: int, rank_args: tuple, conns: list, control, abort_words) -> None:
    """The ranks' template process (device="cpu"): import what every rank needs once, then fork the ranks
    from this process, so N ranks cost one start-up (importing torch and triton: seconds of CPU) instead of
    N; then reap them, telling the caller each one's exit code. Forking is safe here: nothing has touched a
    GPU or started a thread pool (the ranks' environment asks for one BLAS/OpenMP thread)."""
    import torch
    import torch.distributed  # noqa: F401 - imported once, here, for every rank

    from . import all_to_all  # noqa: F401 - the kernels too (TRITON_INTERPRET is set: interpreted)

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
            the number of remote peers per rank).

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
        if proxies != "auto" and (isinstance(proxies, bool) or not isinstance(proxies, int) or proxies < 1
                                  or proxies > min(max(1, remote), MAX_PROXY_SHARDS)):
            raise ValueError(f"proxies must be 'auto' or an int in [1, {min(max(1, remote), MAX_PROXY_SHARDS)}] "
                             f"(at most the {remote} remote peers of a rank), got {proxies!r}")
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
            # We are a process started with "spawn" that is re-running the main module, which starts
            # a cluster at import: without a guard every rank would try to start its own ranks.
            if os.environ.get(_RANK_ENV):
                raise SystemExit(_EXIT_UNGUARDED_MAIN)  # one of our ranks: the caller explains
            raise RuntimeError("LocalCluster: cannot start a cluster while this process is bootstrapping "
                               f"(multiprocessing 'spawn' is re-running {_main_module()}); {_GUARD}.")
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
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the children inherit it (spawn execs with our environment)
        try:
            self._abort_words = ctx.RawArray("q", 2)
            rank_args = (self.world_size, os.path.join(self._store_dir, "store"), self.cfg, self.node_size,
                         self.transport, self.device, self.timeout_s,
                         {"gpu_wait": self.gpu_wait, "buffers": self.buffers, "nics": self.nics,
                          "proxies": self.proxies})
            if self.device == "cpu":
                # One spawned template process forks every rank (a GPU rank must not be forked from a process
                # that may have touched CUDA while re-running the main module: those are spawned one by one).
                pipes = [ctx.Pipe() for _ in range(self.world_size)]
                control, control_theirs = ctx.Pipe(duplex=False)
                t = ctx.Process(target=_template_main, daemon=True, name="moe_a2a-ranks",
                                args=(self.world_size, rank_args, [theirs for _, theirs in pipes], control_theirs,
                                      self._abort_words))
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
                                   "starts a LocalCluster when they re-run it (multiprocessing 'spawn' re-runs it in "
                                   f"every rank, as `__mp_main__`); {_GUARD}.")
            raise RuntimeError(f"LocalCluster: the rank processes {not_started} could not start: they exited "
                               f"(code {', '.join(map(str, codes))}) before running any LocalCluster code, while "
                               f"re-running {_main_module()} (multiprocessing 'spawn' re-runs it in every rank, "
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


__all__ = ["LocalCluster"]
