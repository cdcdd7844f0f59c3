"""The lab: the scale-out latency model, the GPU suites and one-off GPU scripts. Not part of the wheel, and
nothing in `moe_a2a` imports it (it imports `moe_a2a`). Run from the repository root:

    python -m benchmarks.latency_model ...   the scale-out MODEL (docs/latency-model.md)
    bash benchmarks/gpu/run.sh SUITE         quick | full | cross-node on a GPU machine (docs/benchmarks.md)
    python3 benchmarks/gpu/SCRIPT.py ...     one-off measurements the docs quote (each says which)
"""
