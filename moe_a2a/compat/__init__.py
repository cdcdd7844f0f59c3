"""Facades with the shapes inference engines already drive (not imported by the library itself).

- `moe_a2a.compat.Buffer`: DeepEP's low-latency `Buffer` (`low_latency_dispatch` / `low_latency_combine`);
  `moe_a2a.compat.deep_ep` is the whole DeepEP-shaped module (`Buffer`, `EventOverlap`, `Config`,
  `topk_idx_t`), which `import deep_ep` may resolve to (docs/compat.md).
- `moe_a2a.compat.vllm.MoeA2APrepareAndFinalize`: vLLM's modular fused-MoE prepare/finalize shape
  (import `moe_a2a.compat.vllm` explicitly; it looks for vLLM's types).
- `moe_a2a.compat.plugin.install`: the engines' plugin entry point; with `MOE_A2A_AS_DEEP_EP=1` it makes
  `import deep_ep` resolve to the facade, else it does nothing. `python -m moe_a2a.compat.launch CMD`
  does the same for every process CMD starts (docs/compat.md).

The names below are imported on first use, so loading the plugin entry point costs no torch import
when the switch is off.
"""
from __future__ import annotations

import importlib

__all__ = ["Buffer", "Config", "EventOverlap", "Handle", "topk_idx_t"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'moe_a2a.compat' has no attribute {name!r}")
    value = getattr(importlib.import_module("moe_a2a.compat.deep_ep"), name)
    globals()[name] = value
    return value
