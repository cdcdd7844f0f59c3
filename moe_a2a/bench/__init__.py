"""The `moe-a2a bench` and `moe-a2a demo` commands (user tools); nothing in the library imports this package.

    moe_a2a.bench.main           `moe-a2a bench ...`: kernels, e2e, timeline, nccl
    moe_a2a.bench.kernels        each Triton kernel vs plain torch vs the floor (GPU)
    moe_a2a.bench.graph          CUDA-graph replay vs eager vs NCCL vs the floor (`bench e2e --graph`)
    moe_a2a.bench.nccl           the all_to_all_single baseline `bench e2e --graph` runs beside ours
                                 (also `moe-a2a bench nccl`, python -m moe_a2a.bench.nccl)
    moe_a2a.bench.demo           `moe-a2a demo` and the inputs the end-to-end tests share

The maintainers' instruments (the proxy alone against synthetic peers, libfabric costs, the soak, the
GPU -> proxy flag round trip) and the lab (the scale-out latency model, the GPU suites, one-off scripts)
are the top-level `benchmarks/` folder of the repository, outside the package: `python -m
benchmarks.<name>` from the repository root.

`from moe_a2a.bench import main, build_parser` gives the `bench` dispatcher's functions (so the
package attribute `main` is the function; the module is `sys.modules["moe_a2a.bench.main"]`).
"""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
