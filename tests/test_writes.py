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

from .conftest import TEST_DEVICE

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
