"""End to end with `A2AConfig(combine_fp8=True)`: LocalCluster ranks (real processes, real proxies, real
libfabric) whose combine rows travel as fp8 e4m3 + fp32 scales, held against `reference.combine_fp8` by
the oracle (bitwise on CPU). One node (node-local pushes only) and two simulated nodes (the proxy's writes
of the smaller rows), with and without `buffers="staged"` (remote rows read from the staged copy)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.bench.demo import rank_roundtrip
from moe_a2a.config import A2AConfig
from moe_a2a.oracle import check_against_reference

from ..conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow]


@dataclass(frozen=True)
class Case:
    world: int
    node: int
    transport: str
    in_dtype: torch.dtype = torch.bfloat16
    hidden: int = 200            # two scale blocks, the last one short; H not a multiple of 16
    buffers: str = "auto"


CASES = [
    # one node: every combine row is pushed by a kernel into a peer's recv buffer, none crosses the wire
    pytest.param(Case(2, 2, "shm"), id="W2-N2-SHM-BF16-FP8COMBINE"),
    # two simulated nodes of two: node-local pushes and the proxy's writes of fp8 rows in one call
    pytest.param(Case(4, 2, "tcp", torch.float8_e4m3fn), id="W4-N2-TCP-FP8-FP8COMBINE"),
    # only remote rows staged: the reduce reads this node's rows and the other node's from two buffers
    pytest.param(Case(4, 2, "shm", buffers="staged"), id="W4-N2-SHM-BF16-STAGED-FP8COMBINE"),
]


def _cfg(c: Case) -> A2AConfig:
    return A2AConfig(max_num_tokens=5, num_experts=2 * c.world, experts_per_token=3, hidden_dim=c.hidden,
                     in_dtype=c.in_dtype, out_dtype=torch.bfloat16, max_private_tokens=1, combine_fp8=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("c", CASES)
def test_fp8_combine_matches_reference_combine_fp8(c: Case) -> None:
    cfg = _cfg(c)
    assert cfg.combine_stride_bytes < dataclasses.replace(cfg, combine_fp8=False).combine_stride_bytes
    with LocalCluster(cfg, world_size=c.world, node_size=c.node, transport=c.transport, device=TEST_DEVICE,
                      timeout_s=60.0, buffers=c.buffers) as cl:
        results = cl.run(rank_roundtrip, cfg.max_num_tokens, 1, 2, "random")
        assert check_against_reference(cfg, results) == []   # reference.combine_fp8 (oracle.check_call)
        # The rows really went through fp8: the out_dtype reference is far from what came back.
        assert check_against_reference(dataclasses.replace(cfg, combine_fp8=False), results) != []
        # Skewed (every route to expert 0: the remainder path) and duplicates, a rank with no tokens.
        results = cl.run(rank_roundtrip, cfg.max_num_tokens, 2, 1, "skew")
        assert check_against_reference(cfg, results) == []
        tokens = [0] + [cfg.max_num_tokens - r % 3 for r in range(1, c.world)]
        results = cl.run(rank_roundtrip, tokens, 3, 1, "dupes")
        assert check_against_reference(cfg, results) == []
