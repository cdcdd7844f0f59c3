"""LocalCluster: results in rank order, a raising rank's traceback, clean-up of processes and segments."""
import glob
import os

import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.config import A2AConfig

from .conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow]


def _who(a2a, rank, tag):
    if rank == 1 and tag == "boom":
        raise ValueError("boom from the rank function")
    return {"rank": rank, "tag": tag, "world": a2a.world_size, "tensor": torch.full((2,), rank)}


@pytest.mark.timeout(300)
def test_results_errors_and_cleanup():
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8, in_dtype=torch.float32)
    with LocalCluster(cfg, world_size=2, node_size=1, transport="shm", device=TEST_DEVICE, timeout_s=30) as cl:
        pids = [p.pid for p in cl._procs]
        out = cl.run(_who, "hello")
        assert [o["rank"] for o in out] == [0, 1] and all(o["world"] == 2 for o in out)
        assert out[1]["tensor"].device.type == "cpu" and out[1]["tensor"].tolist() == [1, 1]
        with pytest.raises(RuntimeError, match="rank 1 raised:(.|\n)*boom from the rank function"):
            cl.run(_who, "boom")
        assert cl.run(_who, "again")[0]["tag"] == "again"  # a raising function does not break the cluster
        segments = [path for pid in pids for path in glob.glob(f"/dev/shm/moe_a2a-{pid}-*")]
        assert len(segments) == 2  # one shared segment per rank while running
    for pid in pids:
        assert not glob.glob(f"/dev/shm/moe_a2a-{pid}-*"), "segments left behind"
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_bad_cluster_arguments_are_refused_before_starting():
    cfg = A2AConfig(num_experts=8)
    with pytest.raises(ValueError, match="node_size"):
        LocalCluster(cfg, world_size=4, node_size=3)
    with pytest.raises(ValueError, match="divisible"):
        LocalCluster(cfg, world_size=3)
    with pytest.raises(ValueError, match="device"):
        LocalCluster(cfg, world_size=2, device="tpu")
    with pytest.raises(ValueError, match="buffers"):
        LocalCluster(cfg, world_size=2, buffers="pinned")
    with pytest.raises(ValueError, match="buffers='gpu' needs device='cuda'"):
        LocalCluster(cfg, world_size=2, device="cpu", buffers="gpu")
    with pytest.raises(ValueError, match="gpu_wait"):
        LocalCluster(cfg, world_size=2, gpu_wait="spin")
