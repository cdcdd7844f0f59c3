"""The cluster's processes found in /proc (ranks and proxies, by the cluster id in their environment), their
identity (pid and start time) and the /dev/shm files an exited one left."""
from __future__ import annotations

import os

from ..protocol.memory import remove_process_shm_files

# Set in the ranks' environment (their proxies inherit it): finds every process of one cluster in
# /proc, orphaned proxies of killed ranks included.
_CLUSTER_ENV = "MOE_A2A_LOCAL_CLUSTER_ID"


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
