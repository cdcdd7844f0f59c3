"""RDMA writes per call, counted by the proxies themselves (`AllToAll.writes_posted`), between real
processes: what the protocol promises about the wire. A dispatch costs each remote peer one write (its
count row and its first P rows), plus a remainder write only when the pair overflows its private region;
a combine one write; no barrier writes (docs/protocol.md)."""
from __future__ import annotations

import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.bench.demo import rank_roundtrip
from moe_a2a.config import A2AConfig

from ..conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow]


def _count_writes(a2a, rank: int, calls: int):
    before = a2a.writes_posted()
    res = rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 11, calls)
    after = a2a.writes_posted()
    L, W = a2a.layout.num_local_experts, a2a.world_size
    routes = []  # per call: live routes from this rank to each destination rank
    for call in res["calls"]:
        idx = call["indices"].cpu()
        routes.append(torch.bincount(idx[idx >= 0] // L, minlength=W).tolist())
    return {"dispatch": after["dispatch"] - before["dispatch"], "combine": after["combine"] - before["combine"],
            "routes": routes, "remote": a2a.layout.remote_peers(rank), "private_rows": a2a.layout.private_rows}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,node,transport,private", [
    (3, 1, "shm", None),   # every peer remote, private regions large enough
    (4, 2, "tcp", None),   # a node peer (no writes) and two remote peers
    (3, 1, "shm", 1),      # one private row: most pairs overflow into a remainder write
], ids=["remote-shm", "mixed-tcp", "overflow-shm"])
def test_writes_per_call_are_what_the_protocol_says(world, node, transport, private):
    cfg = A2AConfig(max_num_tokens=5, num_experts=12, experts_per_token=3, hidden_dim=16, in_dtype=torch.bfloat16,
                    max_private_tokens=private)
    calls = 3
    with LocalCluster(cfg, world_size=world, node_size=node, transport=transport, device=TEST_DEVICE,
                      timeout_s=60) as cl:
        results = cl.run(_count_writes, calls)
    for rank, got in enumerate(results):
        remote, P = got["remote"], got["private_rows"]
        overflow = sum(routes[d] > P for routes in got["routes"] for d in remote)
        assert got["dispatch"] == calls * len(remote) + overflow, (rank, got)
        assert got["combine"] == calls * len(remote), (rank, got)
    if private == 1:
        assert any(sum(r[d] > 1 for r in g["routes"] for d in g["remote"]) for g in results)  # it did overflow


def _node_local_writes(a2a, rank: int):
    rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 3, 2)
    return a2a.writes_posted()


@pytest.mark.timeout(300)
def test_every_rank_on_one_node_posts_no_write():
    cfg = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=16, in_dtype=torch.bfloat16)
    with LocalCluster(cfg, world_size=2, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        assert cl.run(_node_local_writes) == [{"dispatch": 0, "combine": 0}] * 2


# ---- several proxies per rank (AllToAll(proxies=k)) ----------------------------------------------
def _roundtrip_per_proxy(a2a, rank: int, calls: int):
    before = a2a.writes_posted(per_proxy=True)
    res = rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 11, calls)
    after = a2a.writes_posted(per_proxy=True)
    L, W = a2a.layout.num_local_experts, a2a.world_size
    res["routes"] = []
    for call in res["calls"]:
        idx = call["indices"].cpu()
        res["routes"].append(torch.bincount(idx[idx >= 0] // L, minlength=W).tolist())
    res["per_proxy"] = [{ph: a[ph] - b[ph] for ph in a} for a, b in zip(after, before)]
    res["remote"], res["private_rows"] = a2a.layout.remote_peers(rank), a2a.layout.private_rows
    res["k"] = a2a.num_proxies
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("node,transport,private", [
    (2, "tcp", None),   # one node peer, two remote peers: one per proxy
    # every peer remote (proxy 0 carries peers {0, 2} \ {r}, proxy 1 {1, 3} \ {r}) and overflowing: remainder
    # writes, planned from rows copied by both proxies
    (1, "shm", 1),
], ids=["w4n2-tcp", "w4n1-overflow-shm"])
def test_two_proxies_per_rank_match_the_reference_and_split_the_writes(node, transport, private):
    from moe_a2a.oracle import check_against_reference

    cfg = A2AConfig(max_num_tokens=5, num_experts=12, experts_per_token=3, hidden_dim=16, in_dtype=torch.bfloat16,
                    max_private_tokens=private)
    calls = 3
    with LocalCluster(cfg, world_size=4, node_size=node, transport=transport, device=TEST_DEVICE, timeout_s=60,
                      proxies=2) as cl:
        results = cl.run(_roundtrip_per_proxy, calls)
    assert check_against_reference(cfg, results) == []
    for rank, got in enumerate(results):
        assert got["k"] == 2 and len(got["per_proxy"]) == 2
        remote, P = got["remote"], got["private_rows"]
        for j, posted in enumerate(got["per_proxy"]):
            # Proxy j posts only to its own destinations p % 2 == j: one private write each per call (+ a
            # remainder on overflow), one combine write each.
            mine = [d for d in remote if d % 2 == j]
            overflow = sum(routes[d] > P for routes in got["routes"] for d in mine)
            assert posted == {"dispatch": calls * len(mine) + overflow, "combine": calls * len(mine)}, (rank, j, got)
        total = {ph: sum(p[ph] for p in got["per_proxy"]) for ph in ("dispatch", "combine")}
        overflow = sum(routes[d] > P for routes in got["routes"] for d in remote)
        assert total == {"dispatch": calls * len(remote) + overflow, "combine": calls * len(remote)}, (rank, got)


def _proxy_pids(a2a, rank):
    return [h.proc.pid for h in a2a.proxies]


def _clean_call(a2a, rank):
    rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 3, 1)


def _roundtrip_error(a2a, rank):
    import time

    start = time.monotonic()
    try:
        rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 5, 1)
        return None, time.monotonic() - start
    except (RuntimeError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


@pytest.mark.timeout(300)
def test_a_dead_secondary_proxy_is_reported_and_close_leaves_nothing():
    import os
    import signal
    import time

    from .test_faults import _files_of, _gone

    cfg = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=16, in_dtype=torch.bfloat16)
    shm_before = set(os.listdir("/dev/shm"))
    timeout_s = 10.0
    cl = LocalCluster(cfg, world_size=4, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=timeout_s,
                      proxies=2)
    try:
        cl.start()
        ranks = [p.pid for p in cl._procs]
        proxies = cl.run(_proxy_pids)
        assert all(len(p) == 2 for p in proxies)
        cl.run(_clean_call)  # every proxy works first
        victim = proxies[1][1]  # rank 1's secondary proxy
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _gone(victim) and time.monotonic() < deadline:
            time.sleep(0.05)
        outcome = cl.run(_roundtrip_error)  # (message of the error raised or None, seconds) per rank
    finally:
        cl.close()
    ours = set(ranks) | {p for ps in proxies for p in ps}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(map(_gone, ours)):
        time.sleep(0.05)
    assert [p for p in ours if not _gone(p)] == [], "processes of the cluster outlived close()"
    assert _files_of(ours, set(os.listdir("/dev/shm")) - shm_before) == []
    # The rank whose proxy died names it within a few seconds (its watch thread polls every 0.25 s); the
    # other ranks miss that proxy's writes and time out naming rank 1.
    msg, took = outcome[1]
    assert msg is not None and "proxy process exited" in msg and "proxy 1 of 2" in msg, outcome
    assert took < 5, outcome
    assert all(m is not None for m, _ in outcome), outcome


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", [0, -1, 3, True, 1.5, "two"])
def test_invalid_proxies_are_refused(bad):
    cfg = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=16, in_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="proxies"):
        LocalCluster(cfg, world_size=4, node_size=2, transport="shm", device=TEST_DEVICE, proxies=bad)


def _rank_with_proxies(rank: int, world: int, store: str, proxies: int, queue) -> None:
    """One rank built by hand (LocalCluster gives every rank the same options): AllToAll(proxies=...)."""
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from moe_a2a import AllToAll

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=16, in_dtype=torch.bfloat16)
    try:
        AllToAll(cfg, node_group=2, transport="shm", device="cpu", timeout_s=30, proxies=proxies).close()
        queue.put((rank, None))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.timeout(200)
def test_ranks_with_different_numbers_of_proxies_are_refused_on_every_rank(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world, ks = 4, [2, 2, 1, 2]
    procs = [ctx.Process(target=_rank_with_proxies, args=(r, world, str(tmp_path / "store"), ks[r], queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=150) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    # Refused by the configuration fingerprint, before any buffer or proxy exists, naming who had what.
    assert all(m is not None and m.startswith("ValueError") and "proxies: 2 on ranks 0, 1, 3; 1 on rank 2" in m
               for m in got.values()), got
