"""moe_a2a: expert-parallel dispatch and combine for Mixture-of-Experts inference.

Public face (docs/design.md, API): `A2AConfig`, `AllToAll`, `LocalCluster` and the executable
specification `reference.dispatch` / `reference.combine`.

Attributes are imported on first use, so `import moe_a2a` stays cheap and the proxy process
(which imports `moe_a2a.proxy.worker`) never pays for torch or triton.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "A2AConfig": ("moe_a2a.config", "A2AConfig"),
    "AllToAll": ("moe_a2a.all_to_all", "AllToAll"),
    "LocalCluster": ("moe_a2a.local", "LocalCluster"),
    "reference": ("moe_a2a.reference", None),
    "plan": ("moe_a2a.protocol.plan", None),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'moe_a2a' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    value = getattr(value, attr) if attr else value
    globals()[name] = value
    return value
