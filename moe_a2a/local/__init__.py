"""`LocalCluster`: N ranks on this machine, one process each, for notebooks, tests and demos.

Each rank process joins a gloo group (bootstrap only), builds its own `AllToAll` (which starts its
own proxy process) and then runs the functions `run` sends it. Functions travel with cloudpickle,
so a function defined in a notebook cell works; tensors travel as raw bytes (`_dumps` / `_loads`),
so every dtype (float8 included, which torch cannot pickle through cloudpickle) goes both ways.

Ranks start through multiprocessing ("spawn", or "forkserver"), which re-runs the main module of a script
(as `__mp_main__`), so a script must start the cluster under `if __name__ == "__main__":`. With
device="cpu" one template process does that and forks every rank from itself (N ranks cost one start-up,
not N: 32 ranks start in seconds on 2 cores); the template comes from multiprocessing's forkserver, which
this process starts once with torch and the interpreted kernels imported, so a cluster after the first
starts in about a second instead of the seconds of importing torch (most of a CPU test's time). GPU ranks
are spawned one by one (a process that may have touched CUDA cannot be forked).

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

# The files: cluster.py (LocalCluster), rank.py (a rank process), template.py (the process that forks the
# CPU ranks), codec.py (what travels between the caller and the ranks), processes.py (finding and
# reaping the cluster's processes in /proc). The names below are what other modules and tests import.
from .cluster import LocalCluster, cluster_device  # noqa: F401
from .codec import _dumps, _loads  # noqa: F401
from .processes import _CLUSTER_ENV, _cluster_processes  # noqa: F401
from .rank import RunAborted  # noqa: F401

__all__ = ["LocalCluster"]
