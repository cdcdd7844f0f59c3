"""`moe_a2a.compat.vllm.MoeA2APrepareAndFinalize`: importable without vLLM, and prepare -> experts ->
finalize equal to `reference.py` between real processes (sync and async, two micro-batches)."""
from __future__ import annotations

import types

import pytest
import torch

from moe_a2a import A2AConfig, LocalCluster, reference
from moe_a2a.oracle import combine_problems, default_max_ulps

from ..conftest import TEST_DEVICE
from .test_deep_ep import E, H, K, T_MAX, _inputs

pytestmark = [pytest.mark.slow]


def test_importable_without_vllm_and_says_its_format():
    from moe_a2a.compat import vllm as adapter

    assert adapter.FusedMoEActivationFormat.BatchedExperts.value == ("batched_experts",)
    meta = adapter.ExpertTokensMetadata(expert_num_tokens=torch.zeros(2, dtype=torch.int32), expert_num_tokens_cpu=None)
    assert meta.expert_num_tokens.shape == (2,)


def _adapter_rank(a2a, rank, use_async: bool):
    from moe_a2a.compat import Buffer
    from moe_a2a.compat.vllm import MoeA2APrepareAndFinalize

    W, dev = a2a.world_size, a2a.device
    results = []
    with Buffer(transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size) as buf:
        pf = MoeA2APrepareAndFinalize(buf, T_MAX, W)
        assert pf.topk_indices_dtype() == torch.int64 and pf.max_num_tokens_per_rank() == T_MAX
        assert pf.num_dispatchers() == W and pf.activation_format.name == "BatchedExperts"
        quant = types.SimpleNamespace(quant_dtype=None)
        batches = [(t.to(dev) for t in _inputs(rank, 30 + mb, T_MAX, "random")) for mb in range(2)]
        batches = [tuple(b) for b in batches]
        if use_async:  # both micro-batches dispatched before either is received
            pending = [pf.prepare_async(x, w, idx, E, None, False, quant) for x, idx, w in batches]
            prepared = []
            for hook, receiver in pending:
                hook()
                prepared.append(receiver())
        else:
            prepared = [pf.prepare(x, w, idx, E, None, False, quant) for x, idx, w in batches]
        for (x, idx, w), (ex, exs, meta, _, _) in zip(batches, prepared):
            assert exs is None and ex.dim() == 3
            y = (2 * ex.float()).to(torch.bfloat16)
            out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=dev)
            pf.finalize(out, y, w, idx, False, None)
            results.append({"count": meta.expert_num_tokens.clone(), "out": out})
    return results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_prepare_finalize_match_reference(use_async):
    W = 2
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=W, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        got = cl.run(_adapter_rank, use_async)
    cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                    expert_capacity=T_MAX * W)
    for mb in range(2):
        ins = [_inputs(r, 30 + mb, T_MAX, "random") for r in range(W)]
        want = reference.dispatch(cfg, [x for x, _, _ in ins], None, [i for _, i, _ in ins])
        ys = [(2 * x_ref.float()).to(torch.bfloat16) for _, x_ref, _ in want]
        outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins], ys)
        for r in range(W):
            assert torch.equal(got[r][mb]["count"].cpu(), want[r][0])
            assert combine_problems(got[r][mb]["out"].cpu(), outs[r], default_max_ulps(TEST_DEVICE)) == [], (mb, r)
