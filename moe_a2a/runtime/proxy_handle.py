"""The model process's side of its proxy processes: the handle that starts, bootstraps and stops one
(`ProxyHandle`); what a proxy needs to start is `protocol.proxy_spec.ProxySpec`. Torch-free; the proxy
process itself is `proxy/worker.py`, which the model process never imports."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from ..config import Layout
from ..protocol.memory import SharedSegment, remove_process_shm_files, send_fds
from ..protocol.proxy_spec import ProxySpec
from ..protocol.segment import Flags
from ..protocol.words import Flag


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
                from ..proxy.libfabric import log_fabric_once

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
