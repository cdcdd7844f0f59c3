"""`LocalCluster`: N ranks on this machine, one process each, for notebooks, tests and demos.

Each rank process joins a gloo group (bootstrap only), builds its own `AllToAll` (which starts its
own proxy process) and then runs the functions `run` sends it. Functions travel with cloudpickle,
so a function defined in a notebook cell works; tensors travel as raw bytes (`_dumps` / `_loads`),
so every dtype (float8 included, which torch cannot pickle through cloudpickle) goes both ways.

Ranks are started with multiprocessing's "spawn": each re-runs the main module of a script (as
`__mp_main__`), so a script must start the cluster under `if __name__ == "__main__":`.
"""
from __future__ import annotations

import glob
import io
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any, Callable

import cloudpickle

from .config import A2AConfig

_SHM_GLOB = "/dev/shm/moe_a2a-{pid}-*"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _rank_main(rank: int, world_size: int, port: int, cfg: A2AConfig, node_size: int, transport: str,
               device: str, timeout_s: float, options: dict, conn) -> None:
    """Body of one rank process: bootstrap, build AllToAll, serve `run` requests until told to stop."""
    conn.send(("alive", None))  # past the spawn bootstrap: the main module re-run, the arguments loaded
    os.environ.pop(_RANK_ENV, None)
    import torch
    import torch.distributed as dist

    from .all_to_all import AllToAll

    a2a = None
    try:
        torch.set_num_threads(1)  # N ranks share the machine's cores
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=__import__("datetime").timedelta(seconds=timeout_s))
        dev = device
        if device == "cuda":
            dev = f"cuda:{rank % torch.cuda.device_count()}"
            torch.cuda.set_device(dev)
        a2a = AllToAll(cfg, node_group=node_size, transport=transport, device=dev, timeout_s=timeout_s,
                       **options)
        conn.send(("ready", None))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            try:
                fn, args = _loads(msg)
                result = fn(a2a, rank, *args)
                if device == "cuda":
                    torch.cuda.synchronize()
                conn.send(("ok", _dumps(result, to_cpu=True)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if a2a is not None:
            a2a.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class LocalCluster:
    """`world_size` ranks on this machine, `node_size` per simulated node (same-node peers share
    memory; others talk over `transport`).

    Args:
        cfg: the sizes, shared by every rank.
        world_size: number of rank processes.
        node_size: ranks per node (default: all on one node).
        transport: "shm", "tcp" or "auto" (here: shm).
        device: "cpu" (kernels under TRITON_INTERPRET=1) or "cuda" (rank i on GPU i % num_gpus).
        timeout_s: bound on start-up and on every `run`; a rank that dies or hangs ends in TimeoutError.
        gpu_wait: passed to every `AllToAll` ("kernel" is needed to capture CUDA graphs).
        buffers: passed to every `AllToAll` ("auto", "host", "gpu" or "memfd").
        nics: passed to every `AllToAll` ("auto" or a list of libfabric domain names).

    Use as a context manager; `run(fn, *args)` calls `fn(a2a, rank, *args)` on every rank and returns
    the results in rank order (tensors of any dtype, float8 included, go both ways; results come back
    on the CPU). In a script, start the cluster under `if __name__ == "__main__":` (the ranks re-run
    the main module); without the guard, start-up raises a RuntimeError saying so.
    """

    def __init__(self, cfg: A2AConfig, world_size: int = 4, node_size: int | None = None,
                 transport: str = "auto", device: str = "cpu", timeout_s: float = 30.0,
                 gpu_wait: str = "auto", buffers: str = "auto", nics="auto") -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        node_size = world_size if node_size is None else node_size
        cfg.layout(world_size, node_size)  # validates divisibility before any process starts
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if gpu_wait not in ("auto", "kernel", "host"):
            raise ValueError(f"gpu_wait must be 'auto', 'kernel' or 'host', got {gpu_wait!r}")
        if buffers not in ("auto", "host", "gpu", "memfd"):
            raise ValueError(f"buffers must be 'auto', 'host', 'gpu' or 'memfd', got {buffers!r}")
        if nics != "auto" and (isinstance(nics, str) or not isinstance(nics, (list, tuple)) or not nics):
            raise ValueError(f"nics must be 'auto' or a non-empty list of domain names, got {nics!r}")
        if buffers == "gpu" and device != "cuda":
            raise ValueError(f"buffers='gpu' needs device='cuda', got device={device!r}")
        if buffers == "memfd" and device != "cpu":
            raise ValueError(f"buffers='memfd' is for device='cpu', got device={device!r}")
        self.cfg, self.world_size, self.node_size = cfg, world_size, node_size
        self.transport, self.device, self.timeout_s = transport, device, timeout_s
        self.gpu_wait, self.buffers, self.nics = gpu_wait, buffers, nics
        self._procs: list = []
        self._conns: list = []
        self._alive: set = set()  # ranks that got past the spawn bootstrap into `_rank_main`
        self._broken: str | None = None

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
        ctx = mp.get_context("spawn")
        port = _free_port()
        env_interp = os.environ.get("TRITON_INTERPRET")
        if self.device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"  # children inherit it: kernels run on CPU tensors
        os.environ[_RANK_ENV] = "1"
        try:
            for rank in range(self.world_size):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=_rank_main, daemon=True, name=f"moe_a2a-rank{rank}",
                                args=(rank, self.world_size, port, self.cfg, self.node_size, self.transport,
                                      self.device, self.timeout_s,
                                      {"gpu_wait": self.gpu_wait, "buffers": self.buffers, "nics": self.nics},
                                      theirs))
                p.start()
                theirs.close()
                self._procs.append(p)
                self._conns.append(ours)
        finally:
            os.environ.pop(_RANK_ENV, None)
            if self.device == "cpu":
                if env_interp is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = env_interp
        try:
            self._collect("start-up", self.timeout_s + 60.0)  # + process start and imports
        except BaseException:
            self.close()
            raise

    def run(self, fn: Callable, *args) -> list:
        """Call `fn(a2a, rank, *args)` on every rank; results in rank order.

        Tensors of any dtype may be in `args` and in the results (nested in containers too); results
        come back on the CPU. A rank that raises makes this raise RuntimeError with that rank's
        traceback; a rank that dies or does not answer within `timeout_s` gives TimeoutError (the
        cluster is then closed)."""
        if self._broken:
            raise RuntimeError(f"LocalCluster is unusable: {self._broken}")
        if not self._procs:
            raise ValueError("LocalCluster is not started (use it as a context manager)")
        payload = _dumps((fn, args))
        for c in self._conns:
            c.send(payload)
        return [_loads(r) for r in self._collect("run", self.timeout_s + 10.0)]

    def _collect(self, what: str, timeout_s: float) -> list:
        """One answer per rank (in rank order). A rank that sent an error makes this raise RuntimeError;
        a rank whose process ended without answering ("died", decided from the process, not from any
        text) gives TimeoutError; ranks that ended during start-up before running `_rank_main` (the
        main module failed when re-run, e.g. no `__main__` guard) give RuntimeError."""
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        died: dict[int, int | None] = {}  # rank -> exit code of a process that ended without answering
        deadline = time.monotonic() + timeout_s
        while pending:
            for r in sorted(pending):
                c, p = self._conns[r], self._procs[r]
                if c.poll(0.01):
                    try:
                        status, value = c.recv()
                    except EOFError:
                        p.join(1.0)
                        pending.discard(r)
                        died[r] = p.exitcode
                        continue
                    if status == "alive":
                        self._alive.add(r)
                        continue
                    pending.discard(r)
                    if status in ("ok", "ready"):
                        results[r] = value
                    else:
                        errors[r] = value
                elif not p.is_alive():
                    pending.discard(r)
                    died[r] = p.exitcode
            if _EXIT_UNGUARDED_MAIN in died.values():
                break
            if (errors or died) and all(not self._procs[r].is_alive() for r in pending):
                break
            if time.monotonic() > deadline:
                self._broken = f"{what}: ranks {sorted(pending)} did not answer within {timeout_s:g}s"
                self.close()
                detail = "".join(f"\n--- rank {r} ---\n{m}" for r, m in sorted(errors.items()))
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
            self._broken = f"ranks {dead} died"
            self.close()
            raise TimeoutError(f"{what}: rank(s) {dead} died (exit code(s) "
                               f"{', '.join(str(died[q]) for q in dead)}); the others report:" +
                               "".join(f"\n--- rank {q} ---\n{m}" for q, m in sorted(errors.items())))
        if errors:
            r = min(errors)
            raise RuntimeError(f"{what}: rank {r} raised:\n{errors[r]}")
        return results

    def close(self) -> None:
        """Stop every rank (politely, then by force) and remove shared segments left behind."""
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 10.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for p in self._procs:
            # A killed rank cannot unlink its segment: its name starts with its pid.
            for path in glob.glob(_SHM_GLOB.format(pid=p.pid)):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def kill_rank(self, rank: int) -> None:
        """Kill one rank process (for fault-injection tests and demos)."""
        self._procs[rank].kill()
        self._procs[rank].join()


__all__ = ["LocalCluster"]
