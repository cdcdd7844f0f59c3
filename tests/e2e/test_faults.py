"""Faults and exposure of a LocalCluster, with real processes: nothing listens beyond loopback while it
runs, and nothing (files in /dev/shm, processes, the bootstrap's store) outlives `close()`, also when a
rank or a proxy was killed with SIGKILL.

Other test runs may share this machine's /dev/shm, so "no new file" is checked for the files that name
a process of the cluster under test (`moe_a2a-{pid}-*` segments, libfabric shm regions `{pid}:*`)."""
from __future__ import annotations

import ipaddress
import os
import signal
import time

import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.config import A2AConfig
from moe_a2a.local import _CLUSTER_ENV, _cluster_processes

from .._procnet import listening_sockets, socket_inodes
from ..conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow]


CFG = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8, in_dtype=torch.float32)


# ---- /proc helpers ------------------------------------------------------------------------------
def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _gone(pid: int) -> bool:
    """No such process, or a zombie (an orphan of a killed rank waits for init to reap it)."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2:].split()[0] in (b"Z", b"X")


def _live_children() -> set[int]:
    """Live (not zombie) child processes of this one, multiprocessing's resource tracker and forkserver (which
    LocalCluster starts once for every later CPU cluster) excepted."""
    me, kids = os.getpid(), set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = open(f"/proc/{name}/stat", "rb").read()
            cmdline = open(f"/proc/{name}/cmdline", "rb").read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if int(fields[1]) == me and fields[0] not in (b"Z", b"X") and b"resource_tracker" not in cmdline \
                and b"forkserver" not in cmdline:
            kids.add(int(name))
    return kids


def _files_of(pids, names) -> list[str]:
    return sorted(n for n in names for p in pids if n.startswith((f"moe_a2a-{p}-", f"{p}:")))


def _proxy_pid(a2a, rank):
    return a2a.proxies[0].proc.pid


def _close_and_check(a2a, rank):
    """AllToAll.close(): its proxy's libfabric region and its segment are gone; trace() says closed."""
    pid, seg = a2a.proxies[0].proc.pid, a2a.segment.path
    a2a.close()
    a2a.close()  # idempotent
    try:
        a2a.trace()
        traced = "no error"
    except ValueError as exc:
        traced = str(exc)
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"{pid}:")] + [seg] * os.path.exists(seg)
    return {"left": left, "trace": traced}


# ---- 1. nothing listens beyond loopback ---------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cluster_listens_on_loopback_only(transport):
    """No TCPStore on 0.0.0.0/[::]: the bootstrap is a file store in a private directory, gloo binds to
    loopback; over tcp the proxies' libfabric endpoints listen on loopback too (every rank is local)."""
    with LocalCluster(CFG, world_size=2, node_size=1, transport=transport, device=TEST_DEVICE, timeout_s=30) as cl:
        ranks = [p.pid for p in cl._procs]
        proxies = cl.run(_proxy_pid)
        store = cl._store_dir
        assert os.stat(store).st_mode & 0o777 == 0o700 and os.listdir(store) == ["store"]
        listening = listening_sockets()
        exposed = {}
        for pid in ranks + proxies:
            inodes = socket_inodes(pid)
            exposed[pid] = [(a, port) for a, port, ino in listening if ino in inodes and not _is_loopback(a)]
        rank_listeners = [(a, port) for pid in ranks for a, port, ino in listening if ino in socket_inodes(pid)]
    assert rank_listeners, "gloo's listening sockets were not found: the check would pass vacuously"
    assert all(not exposed[pid] for pid in ranks + proxies), exposed
    assert not os.path.exists(store), "the bootstrap's store directory outlived close()"


# ---- 2. nothing outlives close(), whatever was killed --------------------------------------------
def _die(a2a, rank, victim):
    if rank == victim:
        os._exit(3)
    from moe_a2a.bench.demo import rank_roundtrip
    return rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 7, 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["kill_rank", "rank_exits_mid_call", "kill_proxy"])
def test_nothing_outlives_close_after_a_sigkill(fault):
    shm_before = set(os.listdir("/dev/shm"))
    kids_before = _live_children()
    gloo_env = os.environ.get("GLOO_SOCKET_IFNAME")  # the caller's environment is restored after start
    timeout_s = 8.0
    cl = LocalCluster(CFG, world_size=2, node_size=1, transport="shm", device=TEST_DEVICE, timeout_s=timeout_s)
    try:
        cl.start()
        ranks = [p.pid for p in cl._procs]
        proxies = cl.run(_proxy_pid)
        cluster_id, store = cl._cluster_id, cl._store_dir
        ours = set(ranks) | set(proxies) | set(_cluster_processes(cluster_id))
        # 2 libfabric shm regions; the segments were unlinked once every peer had mapped them
        assert len(_files_of(ours, os.listdir("/dev/shm"))) == 2
        if fault == "kill_rank":
            cl.kill_rank(1)
        elif fault == "rank_exits_mid_call":
            with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] died"):
                cl.run(_die, 1)  # closes the cluster itself
        else:
            os.kill(proxies[1], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not _gone(proxies[1]) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert any(n.startswith(f"{proxies[1]}:") for n in os.listdir("/dev/shm")), "nothing to clean up?"
            # AllToAll.close() of the rank whose proxy died removes the dead proxy's region itself.
            closed = cl.run(_close_and_check)
            assert all(c["left"] == [] for c in closed), closed
            assert all(c["trace"].startswith("AllToAll is closed") for c in closed), closed
    finally:
        start = time.monotonic()
        cl.close()
        cl.close()  # idempotent
        took = time.monotonic() - start
    assert took < 30, f"close() took {took:.1f}s"
    deadline = time.monotonic() + 10  # orphaned proxies die by PR_SET_PDEATHSIG, asynchronously
    while time.monotonic() < deadline and not all(map(_gone, ours)):
        time.sleep(0.05)
    assert [p for p in ours if not _gone(p)] == [], "processes of the cluster outlived close()"
    assert _live_children() - kids_before == set(), "child processes outlived close()"
    assert _cluster_processes(cluster_id) == {}
    new = set(os.listdir("/dev/shm")) - shm_before
    assert _files_of(ours, new) == [], f"/dev/shm files of the cluster outlived close(): {sorted(new)}"
    assert not os.path.exists(store)
    assert os.environ.get(_CLUSTER_ENV) is None and os.environ.get("GLOO_SOCKET_IFNAME") == gloo_env


@pytest.mark.timeout(300)
def test_close_after_a_clean_run_leaves_nothing_either():
    shm_before = set(os.listdir("/dev/shm"))
    with LocalCluster(CFG, world_size=2, node_size=1, transport="shm", device=TEST_DEVICE, timeout_s=30) as cl:
        ours = set(p.pid for p in cl._procs) | set(cl.run(_proxy_pid))
        closed = cl.run(_close_and_check)  # AllToAll.close() inside a live cluster, then the cluster's
        assert all(c["left"] == [] and c["trace"].startswith("AllToAll is closed") for c in closed), closed
        assert len(_files_of(ours, os.listdir("/dev/shm"))) == 0
    assert all(map(_gone, ours))
    assert _files_of(ours, set(os.listdir("/dev/shm")) - shm_before) == []
