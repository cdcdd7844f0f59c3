"""Facades with the shapes inference engines already drive (not imported by the library itself).

- `moe_a2a.compat.Buffer`: DeepEP's low-latency `Buffer` (`low_latency_dispatch` / `low_latency_combine`).
"""
from .deep_ep import Buffer, Handle

__all__ = ["Buffer", "Handle"]
