"""The soak benchmark's machinery on a few calls: results checked, resources sampled, nothing left."""
from __future__ import annotations

import pytest
import torch

from benchmarks import soak
from moe_a2a.config import A2AConfig
from ..conftest import interpreter_only

pytestmark = [pytest.mark.slow]  # a LocalCluster of its own


@interpreter_only("its ranks run on the CPU (--device cpu / device='cpu')")
@pytest.mark.timeout(300)
def test_soak_checks_every_call_and_reports_growth():
    cfg = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=16,
                    in_dtype=torch.float8_e4m3fn, scale_block=8, expert_padding=2)
    res = soak.run(cfg, world=2, node=1, transport="shm", calls=8, warmup=2, sample_every=4, timeout=30.0,
                   chunk=5)
    assert res["dev_shm_left_after_close"] == []
    for r in res["per_rank"]:
        assert r["num_problems"] == 0, r["problems"]
        assert [s["call"] for s in r["samples"]] == [0, 4, 7]  # after warm-up, every 4, and the last
        assert set(r["growth"]) >= {"rank_rss_bytes", "rank_fds", "proxy_rss_bytes", "proxy_fds", "dev_shm_entries"}
        assert r["growth"]["rank_fds"] == 0 and r["growth"]["proxy_fds"] == 0
