"""`LocalCluster`: N ranks on this machine, one process each, for notebooks, tests and demos.

Each rank process joins a gloo group (bootstrap only), builds its own `AllToAll` (which starts its
own proxy process) and then runs the functions `run` sends it. Functions travel with cloudpickle,
so a function defined in a notebook cell works.
"""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import socket
import time
import traceback
from typing import Any, Callable

from .config import A2AConfig

_SHM_GLOB = "/dev/shm/moe_a2a-{pid}-*"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _rank_main(rank: int, world_size: int, port: int, cfg: A2AConfig, node_size: int, transport: str,
               device: str, timeout_s: float, options: dict, conn) -> None:
    """Body of one rank process: bootstrap, build AllToAll, serve `run` requests until told to stop."""
    import cloudpickle
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
                fn, args = cloudpickle.loads(msg)
                result = fn(a2a, rank, *args)
                if device == "cuda":
                    torch.cuda.synchronize()
                conn.send(("ok", _to_cpu(result)))
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
    the results in rank order (tensors moved to CPU).
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
        self._broken: str | None = None

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        env_interp = os.environ.get("TRITON_INTERPRET")
        if self.device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"  # children inherit it: kernels run on CPU tensors
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

        A rank that raises makes this raise RuntimeError with that rank's traceback; a rank that dies
        or does not answer within `timeout_s` gives TimeoutError (the cluster is then closed)."""
        import cloudpickle

        if self._broken:
            raise RuntimeError(f"LocalCluster is unusable: {self._broken}")
        if not self._procs:
            raise ValueError("LocalCluster is not started (use it as a context manager)")
        payload = cloudpickle.dumps((fn, args))
        for c in self._conns:
            c.send(payload)
        return self._collect("run", self.timeout_s + 10.0)

    def _collect(self, what: str, timeout_s: float) -> list:
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        errors = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            for r in sorted(pending):
                c = self._conns[r]
                if c.poll(0.01):
                    try:
                        status, value = c.recv()
                    except EOFError:
                        status, value = "dead", f"rank {r} exited (code {self._procs[r].exitcode})"
                    pending.discard(r)
                    if status == "ok" or status == "ready":
                        results[r] = value
                    else:
                        errors[r] = value
                elif not self._procs[r].is_alive():
                    pending.discard(r)
                    errors[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
            if errors and all(not self._procs[r].is_alive() or r not in pending for r in range(self.world_size)):
                break
            if time.monotonic() > deadline:
                self._broken = f"{what}: ranks {sorted(pending)} did not answer within {timeout_s:g}s"
                self.close()
                detail = "".join(f"\n--- rank {r} ---\n{m}" for r, m in sorted(errors.items()))
                raise TimeoutError(self._broken + detail)
        if errors:
            r = min(errors)
            died = [q for q in errors if "died" in str(errors[q]) or "exited" in str(errors[q])]
            if died:
                self._broken = f"ranks {died} died"
                self.close()
                raise TimeoutError(f"{what}: rank(s) {died} died; the others report:" +
                                   "".join(f"\n--- rank {q} ---\n{m}" for q, m in sorted(errors.items())))
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
