"""The lab: the maintainers' instruments, the scale-out latency model, the GPU suites and one-off GPU
scripts. Not part of the wheel, and nothing in `moe_a2a` imports it (it imports `moe_a2a`). Run from the
repository root:

    python -m benchmarks.latency_model ...   the scale-out MODEL (docs/latency-model.md)
    python -m benchmarks.proxy ...           the real proxy process alone against synthetic peers
    python -m benchmarks.transport ...       libfabric costs: post, scatter, round trip, bandwidth
    python -m benchmarks.soak ...            many checked calls on CPU, resources watched for growth
    python -m benchmarks.flags ...           the GPU -> proxy process -> GPU flag round trip (GPU)
    bash benchmarks/gpu/run.sh SUITE         quick | full | cross-node on a GPU machine (docs/benchmarks.md)
    python3 benchmarks/gpu/SCRIPT.py ...     one-off measurements the docs quote (each says which)
"""
