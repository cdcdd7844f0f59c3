"""vLLM 0.33's own DeepEP backends over the facade (`_vllm_rank.py` says what each scenario runs)."""
from __future__ import annotations

import importlib.util

import pytest

from ._launch import run_ranks

pytestmark = [pytest.mark.engines, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not importable here (the engines lane: tests/engines/build_env.sh "
                                        "builds an environment with vLLM 0.33.0 and SGLang 0.5.23)")]

MAX_ERROR = 2e-2  # bf16 outputs against an fp32 reference: ~5e-3 seen

# scenario -> (the prepare/finalize class vLLM builds, the layer's hidden size after vLLM rounds it)
SCENARIOS = {
    "ll": ("vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll.DeepEPLLPrepareAndFinalize", 2048),
    "ll_adapter": ("moe_a2a.compat.vllm.MoeA2APrepareAndFinalize", 1000),
    "ht": ("vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht.DeepEPHTPrepareAndFinalize", 1024),
}


@pytest.mark.timeout(700)
@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=["LL-VLLM-OWN", "LL-MOE-A2A-ADAPTER", "HT-VLLM-OWN"])
def test_vllm_deepep_backend_over_the_facade(scenario, tmp_path):
    env = {"MOE_A2A_VLLM_PREPARE_FINALIZE": "1"} if scenario == "ll_adapter" else {}
    reports = run_ranks("tests.engines._vllm_rank", scenario, tmp_path, env)
    prepare_finalize, hidden = SCENARIOS[scenario]
    for rep in reports:
        # load_general_plugins() aliased deep_ep; vLLM's manager built the facade's Buffer
        assert rep["has_deep_ep"] and rep["deep_ep"] == "moe_a2a.compat.deep_ep", rep
        assert rep["buffer"] == "moe_a2a.compat.deep_ep.Buffer", rep
        assert rep["prepare_finalize"] == prepare_finalize and rep["hidden"] == hidden, rep
        assert len(rep["errors"]) == 2 and max(rep["errors"]) < MAX_ERROR, rep
