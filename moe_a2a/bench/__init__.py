"""Benchmarks, the demo and the scale-out latency model; nothing in the library imports this package.

    moe_a2a.bench.main           `moe-a2a bench ...`: kernels, flags, e2e, timeline, nccl, transport
    moe_a2a.bench.kernels        each Triton kernel vs plain torch vs the floor (GPU)
    moe_a2a.bench.transport      libfabric costs (python -m moe_a2a.bench.transport)
    moe_a2a.bench.nccl           the all_to_all_single baseline (python -m moe_a2a.bench.nccl)
    moe_a2a.bench.demo           `moe-a2a demo` and the rank function the end-to-end tests share
    moe_a2a.bench.latency_model  the scale-out MODEL (python -m moe_a2a.bench.latency_model)

`from moe_a2a.bench import main, build_parser` gives the `bench` dispatcher's functions (so the
package attribute `main` is the function; the module is `sys.modules["moe_a2a.bench.main"]`).
"""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
