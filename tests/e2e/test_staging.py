"""Only remote rows staged (`buffers="staged"`): rows between ranks of one node stay in that node's
buffers (GPU memory on a GPU, a shared file of their own on a CPU), and only rows to or from other nodes
pass through the host-staged send/recv buffers in the segment that the proxy writes from and into.
Real processes, real proxies, real libfabric; the results are checked against the reference too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.bench.demo import rank_roundtrip
from moe_a2a.oracle import check_against_reference
from moe_a2a.config import A2AConfig
from moe_a2a.protocol import plan

from ..conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow]


def _rows_written(a2a, offset_bytes: int, stride: int, row_bytes: int, n: int, at=None) -> list[bool]:
    """Row i of the n rows at `offset_bytes` from the base (or row `at[i]`): does it hold any nonzero byte?
    (Buffers start zero-filled, and the test's payloads are random normals, never all zero.)"""
    at = list(range(n)) if at is None else [int(v) for v in at[:n]]
    rows = a2a.base[offset_bytes: offset_bytes + (max(at, default=-1) + 1) * stride].cpu().view(-1, stride)
    return (rows[at, :row_bytes] != 0).any(dim=1).tolist()


def _where_rows_went(a2a, rank: int):
    res = rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 5, 1)
    cfg, lay = a2a.cfg, a2a.layout
    lo, hi = a2a.node_slots.tolist()
    n = int((res["calls"][0]["indices"] >= 0).sum())  # live routes = slots used
    node = [lo <= s < hi for s in range(n)]
    sd, sc = cfg.dispatch_stride_bytes, cfg.combine_stride_bytes
    comb = lay.combine_recv_offset_bytes
    # A remote peer's first P rows are packed into its private staging slot (behind the count row), the
    # rest at their slots (plan.private_stage_rows): where each slot's row is in the staging send buffer.
    staged_at = plan.private_stage_rows(a2a.counts[rank].cpu().numpy().astype(np.int64), rank, lay)
    return {
        "result": res, "node": node, "remote_peers": lay.remote_peers(rank),
        # dispatch rows as packed: this node's in the node send buffer, the others' in the staging one
        "send_node": _rows_written(a2a, a2a.send_offset_bytes, sd, cfg.x_bytes, n),
        "send_staged": _rows_written(a2a, a2a.stage_send_offset_bytes, sd, cfg.x_bytes, n, staged_at),
        # expert outputs for this rank's routes: this node's experts pushed them into the node recv
        # buffer, the other nodes' proxies wrote them into the staging recv buffer
        "recv_node": _rows_written(a2a, a2a.recv_offset_bytes + comb, sc, cfg.y_bytes, n),
        "recv_staged": _rows_written(a2a, a2a.stage_recv_offset_bytes + comb, sc, cfg.y_bytes, n),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_only_rows_to_and_from_other_nodes_are_staged(transport):
    cfg = A2AConfig(max_num_tokens=6, num_experts=8, experts_per_token=3, hidden_dim=24, in_dtype=torch.bfloat16,
                    expert_padding=2)
    with LocalCluster(cfg, world_size=4, node_size=2, transport=transport, device=TEST_DEVICE, timeout_s=60.0,
                      buffers="staged") as cl:
        out = cl.run(_where_rows_went)
    assert check_against_reference(cfg, [o["result"] for o in out]) == []
    for rank, o in enumerate(out):
        node = o["node"]
        assert any(node) and not all(node), f"rank {rank}: the routing must reach both nodes ({node})"
        assert o["send_node"] == node, f"rank {rank}: only this node's dispatch rows in device buffers"
        assert o["send_staged"] == [not v for v in node], f"rank {rank}: only remote dispatch rows staged"
        assert o["recv_node"] == node, f"rank {rank}: this node's expert outputs land in device buffers"
        assert o["recv_staged"] == [not v for v in node], f"rank {rank}: only remote expert outputs staged"


def _placement(a2a, rank):
    return a2a.placement, a2a.host_staged, a2a.node_slots is not None


@pytest.mark.timeout(300)
def test_host_placement_still_stages_everything():
    """buffers="host" (the comparison point of the benchmarks): one buffer for every row, no split."""
    cfg = A2AConfig(max_num_tokens=4, num_experts=4, experts_per_token=2, hidden_dim=16, in_dtype=torch.bfloat16)
    with LocalCluster(cfg, world_size=2, node_size=1, transport="shm", device=TEST_DEVICE, timeout_s=60.0,
                      buffers="host") as cl:
        assert set(cl.run(_placement)) == {("host", True, False)}
        assert check_against_reference(cfg, cl.run(rank_roundtrip, 4, 3, 2)) == []


def test_staged_buffers_are_refused_with_a_clear_error_when_misspelled():
    with pytest.raises(ValueError, match="buffers must be 'auto', 'staged'"):
        LocalCluster(A2AConfig(max_num_tokens=2, num_experts=2, experts_per_token=1, hidden_dim=8,
                               in_dtype=torch.bfloat16), world_size=2, buffers="stage")


def _nothing_staged(a2a, rank):
    res = rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 8, 2)
    lay = a2a.layout
    staged = a2a.base[a2a.stage_send_offset_bytes: a2a.stage_send_offset_bytes + lay.send_bytes].cpu()
    return res, a2a.with_proxy, bool(staged.any()), a2a.node_slots.tolist()


@pytest.mark.timeout(300)
def test_staged_on_one_node_stages_nothing():
    """Every rank on one node: every slot is this node's, so no row reaches the staging buffers."""
    cfg = A2AConfig(max_num_tokens=5, num_experts=4, experts_per_token=2, hidden_dim=16, in_dtype=torch.bfloat16)
    with LocalCluster(cfg, world_size=2, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60.0,
                      buffers="staged") as cl:
        out = cl.run(_nothing_staged)
    assert check_against_reference(cfg, [o[0] for o in out]) == []
    for res, with_proxy, staged, (first, end) in out:
        live = int((res["calls"][-1]["indices"] >= 0).sum())  # node_slots are the last call's
        assert not with_proxy and not staged and (first, end) == (0, live)
