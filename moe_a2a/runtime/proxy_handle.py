"""The model process's side of its proxy processes: what a proxy needs to start (`ProxySpec`) and the
handle that starts, bootstraps and stops one (`ProxyHandle`). Torch-free; the proxy process itself is
`worker.py`, which the model process never imports."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ..config import Layout
from ..protocol.segment import Flags
from ..protocol.words import Flag
from .memory import SharedSegment, send_fds


@dataclass(frozen=True)
class ProxySpec:
    """Everything the proxy needs to start (picklable, torch-free)."""

    layout: Layout
    rank: int
    segment: str
    host_staged: bool      # send/recv buffers live in the segment (else: GPU memory)
    provider: str
    timeout_s: float
    parent_pid: int
    spin_s: float = 1e-3   # busy-poll this long before backing off to short sleeps
    # Between calls a proxy with a core of its own busy-polls this long before sleeping: a sleep there
    # delayed the next call's ROUTE_READY by up to 1.2 ms (2 x H200, graph replays back to back,
    # 2026-11-30). A model step longer than this pays one wake-up (<= 1 ms) per call instead.
    between_calls_spin_s: float = 0.2
    idle_yield: bool = False  # sched_yield in the engine's waits (more busy processes than cores)
    # (memory kind, device ordinal, send size, recv size) of the model's send/recv buffers when they
    # are not in the segment: "cuda" (cuMem) or "host" (memfd). Their POSIX FDs follow the spec on
    # the socket; the proxy maps them and registers them with the NIC ("cuda": FI_HMEM_CUDA).
    fd_buffers: tuple[str, int, int, int] | None = None
    domains: tuple[str, ...] | None = None  # the NICs (libfabric domains) to open; None: the first
    # Every rank runs on this host: a socket provider (tcp) listens on 127.0.0.1 only, so other hosts
    # cannot reach the proxy's endpoint (docs/threat-model.md). No effect on shm/efa/verbs.
    local_only: bool = False
    # This process is proxy `shard` of `shards` of its rank: it carries the remote peers p with
    # p % shards == shard. Shard 0 (the primary) raises the flags the kernels read.
    shard: int = 0
    shards: int = 1
    # Where the proxy runs (topology.choose_proxy_cpus): MOE_A2A_PROXY_CPUS as the model process read
    # it (None: unset), and the rank's GPU (CUDA ordinal, UUID for NVML; None: a CPU run, not pinned).
    cpu_override: str | None = None
    gpu_ordinal: int | None = None
    gpu_uuid: str | None = None
    # Transport "emulated": its NIC settings as the model process read them (MOE_A2A_EMULATED_NIC; "": none).
    emulated_nic: str = ""
    # Shrink mode: a peer a wait times out on is masked (segment words), not an error (docs/protocol.md, section 6, shrink mode).
    shrink: bool = False



class ProxyHandle:
    """The owner's side: starts the proxy process and finishes its bootstrap."""

    def __init__(self, spec: ProxySpec, fds: tuple[int, ...] = ()) -> None:
        self.spec = spec
        # The CPUs the proxy process may run on and why (what it reports with "ready"; empty until then).
        self.cpus: list[int] = []
        self.cpus_reason: str | None = None
        # What its engine runs on (`TransferEngine.fabric_info`, with "ready"; None: the emulated NIC, or not yet).
        self.fabric_info: dict | None = None
        ours, theirs = socket.socketpair()
        self._sock = ours
        self.conn = Connection(os.dup(ours.fileno()))
        self.proc = subprocess.Popen([sys.executable, "-m", "moe_a2a.proxy.worker", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], close_fds=True)
        theirs.close()
        self.conn.send(spec)
        if fds:
            send_fds(ours, list(fds))

    def _recv(self, what: str, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"rank {self.spec.rank}: proxy process did not answer ({what}) within {timeout_s:g}s")
        msg = self.conn.recv()
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "error":
            raise RuntimeError(msg[1])
        return msg

    def address(self, timeout_s: float):
        """(engine address, segment region descriptor, GPU recv region descriptor or None) of the
        proxy, for the bootstrap exchange."""
        return self._recv("address", timeout_s)

    def finish(self, table, timeout_s: float, node_local: bool = False) -> None:
        """Give the proxy every rank's (address, descriptor, segment name, GPU recv descriptor or None)
        and whether the calls bypass it (`node_local`); wait until ready (with where it runs)."""
        self.conn.send((table, bool(node_local)))
        msg = self._recv("ready", timeout_s)
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "ready":  # else a bare "ready"
            self.cpus, self.cpus_reason = list(msg[1]["cpus"]), msg[1]["reason"]
            self.fabric_info = msg[1].get("fabric")
            if self.fabric_info:  # here too: the proxy process has no log handler of its own
                from .libfabric import log_fabric_once

                log_fabric_once(self.fabric_info)

    def tell_board(self, address: tuple, prefix: str) -> None:
        """Where the failure board is (`runtime.status.FailureBoard`): the proxy reads it from its socket when
        its model process dies, and posts the death there (`protocol.board.post_failure`) before it exits."""
        try:
            self.conn.send(("board", address, prefix))
        except OSError:  # the proxy is gone: its rank's watch reports that
            pass

    def stop(self, seg: SharedSegment | None, layout: Layout, timeout_s: float = 5.0) -> None:
        """Ask the proxy to exit (SIGKILL after `timeout_s`), reap it and remove the files it left in
        /dev/shm: libfabric's shm provider names its 16 MiB region `{pid}:...` after the proxy, and a
        killed proxy cannot unlink it. The files go while the exited proxy is still an unreaped zombie,
        so its pid cannot have been reused; a proxy already reaped elsewhere (`proc.poll()`) loses its
        files only when no process holds its pid now. Idempotent."""
        import select

        from .memory import remove_process_shm_files

        proc = self.proc

        def exited_unreaped(wait_s: float | None) -> bool:
            """Wait until the proxy has exited, without reaping it (pidfd; else waitid(WNOWAIT) polls)."""
            try:
                pidfd = os.pidfd_open(proc.pid)
            except (AttributeError, OSError):
                pidfd = None
            if pidfd is not None:
                try:
                    return bool(select.select([pidfd], [], [], wait_s)[0])
                finally:
                    os.close(pidfd)
            deadline = None if wait_s is None else time.monotonic() + wait_s
            while True:
                try:
                    if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                        return True
                except ChildProcessError:
                    return True
                if deadline is not None and time.monotonic() > deadline:
                    return False
                time.sleep(0.01)

        if seg is not None and seg._mmap is not None:
            Flags(seg, layout)[Flag.SHUTDOWN] = 1
        if proc.returncode is None:
            if not exited_unreaped(timeout_s):
                os.kill(proc.pid, signal.SIGKILL)  # not proc.kill(): its poll() could reap it first
                exited_unreaped(timeout_s)  # SIGKILL ends it at once unless the kernel holds it (D state)
            remove_process_shm_files(proc.pid, segments=False)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:  # unkillable for now: leave it rather than hang close()
                pass
        elif not os.path.exists(f"/proc/{proc.pid}"):
            remove_process_shm_files(proc.pid, segments=False)
        for closable in (self.conn, self._sock):
            try:
                closable.close()
            except OSError:
                pass
