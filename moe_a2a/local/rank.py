"""One rank process: `_rank_main` (bootstrap, its AllToAll, the `run` requests and rebuilds), and how the
caller interrupts its function (`RunAborted`, the abort signal and words)."""
from __future__ import annotations

import os
import signal
import time
import traceback

from ..config import A2AConfig
from .codec import _dumps, _loads
from .processes import _start_time

# What start-up (and a rebuild) may take beyond timeout_s: process start, imports, proxies, bootstrap.
_START_ALLOWANCE_S = 60.0
_RANK_ENV = "MOE_A2A_LOCAL_CLUSTER_RANK"  # set for the rank processes while they start


class RunAborted(BaseException):
    """Raised inside a rank's function when another rank's function raised (or its process died) during
    the same `LocalCluster.run`: the rank stops where it was (typically waiting for that rank), so `run`
    reports the root cause at once instead of this rank's timeout. A BaseException, as KeyboardInterrupt,
    so an `except Exception` in the function does not swallow it."""


# The parent interrupts a rank's function with this signal (after writing the run and the culprit into
# the shared abort words); the rank raises RunAborted only if that run is the one it is running. A real-time
# signal: on GPU ranks a handler set installed mid-run (HUP, INT, QUIT, ILL, ABRT, BUS, USR1, SEGV, USR2, TERM,
# XCPU, XFSZ, SYS: LLVM's, as Triton compiles in-process) took SIGUSR1 over and the interrupt was lost.
_ABORT_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1
_DIED = -1  # culprit word: "a rank died" (its number is in the message the parent gives)


def _arm_abort_signal(handler) -> None:
    """Install `handler` for the abort signal and unblock it in this (the function's) thread; again before
    every run, so that a library set up since cannot keep it."""
    signal.signal(_ABORT_SIGNAL, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {_ABORT_SIGNAL})


def _exception_info(exc: BaseException) -> dict:
    """What the parent needs to order the ranks' errors: root causes first, then their consequences (a
    peer's timeout or abort), then the ranks interrupted by `run` itself; ties by when they were raised."""
    from ..all_to_all import CallAborted

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

    from ..all_to_all import AllToAll

    running = [None]  # the run id while the function of that run is on the stack

    def on_abort(signum, frame) -> None:
        run_id, culprit = int(abort_words[0]), int(abort_words[1])
        if running[0] is not None and running[0] == run_id:
            running[0] = None  # once
            why = "a rank died" if culprit == _DIED else f"rank {culprit} raised (its error is reported first)"
            raise RunAborted(f"rank {rank}: run interrupted here because {why}")

    _arm_abort_signal(on_abort)

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
            _arm_abort_signal(on_abort)
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

