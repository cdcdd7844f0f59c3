"""`AllToAll.fabric_info`: what each proxy's engine runs on, reported by the proxy process with "ready"."""
from __future__ import annotations

import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.config import A2AConfig
from moe_a2a.proxy import libfabric as lf


def _fabric(a2a, rank):
    return a2a.fabric_info


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_all_to_all_shows_the_library_and_provider_its_proxy_runs_on():
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=16, in_dtype=torch.bfloat16)
    with LocalCluster(cfg, world_size=2, node_size=1, transport="tcp", device="cpu", timeout_s=30) as cl:
        per_rank = cl.run(_fabric)
    lib = lf.library_info()  # the proxies load the same library as this process (same environment)
    assert len(per_rank) == 2
    for infos in per_rank:
        [info] = infos  # one proxy per rank
        assert (info["path"], info["version"], info["api_version"]) == (lib["path"], lib["version"], lib["api_version"])
        assert info["provider"] == "tcp;ofi_rxm" and info["hmem"] == "not requested" and info["domains"]
