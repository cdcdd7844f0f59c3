"""SGLang 0.5.23's own DeepEP dispatcher over the facade (`_sglang_rank.py` says what each mode runs)."""
from __future__ import annotations

import importlib.util

import pytest

from ._launch import run_ranks

pytestmark = [pytest.mark.engines, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                 reason="SGLang is not importable here (the engines lane: tests/engines/build_env.sh "
                                        "builds an environment with vLLM 0.33.0 and SGLang 0.5.23)")]

MAX_ERROR = 2e-2  # bf16 outputs against an fp32 reference: ~5e-3 seen
FORMATS = {"low_latency": ["DEEPEP_LL", "DEEPEP_LL"], "normal": ["DEEPEP_NORMAL", "DEEPEP_NORMAL"],
           "auto": ["DEEPEP_NORMAL", "DEEPEP_LL"]}  # auto: a prefill batch, then a decode batch


@pytest.mark.timeout(700)
@pytest.mark.parametrize("mode", list(FORMATS), ids=["LOW-LATENCY", "NORMAL", "AUTO"])
def test_sglang_deepep_dispatcher_over_the_facade(mode, tmp_path):
    reports = run_ranks("tests.engines._sglang_rank", mode, tmp_path,
                        {"SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "8"})
    for rep in reports:
        # The dispatcher module, imported before the plugins, bound a real deep_ep's classes or (here, none
        # installed: use_deepep_before_plugins is False) none; the plugin patched it to the facade's.
        assert rep["use_deepep"] is True, rep
        assert rep["buffer_class"] == "moe_a2a.compat.deep_ep.Buffer" and rep["buffer"] == "moe_a2a.compat.deep_ep"
        assert rep["formats"] == FORMATS[mode], rep
        assert len(rep["errors"]) == 2 and max(rep["errors"]) < MAX_ERROR, rep
