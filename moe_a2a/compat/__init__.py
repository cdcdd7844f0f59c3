"""Facades with the shapes inference engines already drive (not imported by the library itself).

- `moe_a2a.compat.Buffer`: DeepEP's low-latency `Buffer` (`low_latency_dispatch` / `low_latency_combine`);
  `moe_a2a.compat.deep_ep` is the whole DeepEP-shaped module (`Buffer`, `EventOverlap`, `Config`,
  `topk_idx_t`), which `import deep_ep` may resolve to (docs/compat.md).
- `moe_a2a.compat.vllm.MoeA2APrepareAndFinalize`: vLLM's modular fused-MoE prepare/finalize shape
  (import `moe_a2a.compat.vllm` explicitly; it looks for vLLM's types).
"""
from .deep_ep import Buffer, Config, EventOverlap, Handle, topk_idx_t

__all__ = ["Buffer", "Config", "EventOverlap", "Handle", "topk_idx_t"]
