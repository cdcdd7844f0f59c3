#!/usr/bin/env bash
# DeepEP's own intranode (normal-mode) test, unchanged, against moe_a2a's DeepEP facade (docs/compat.md).
#
#   bash benchmarks/gpu/deepep_intranode.sh DEEPEP_CHECKOUT [--shared-gpu] [the test's arguments, e.g. --num-processes 2]
#
# DEEPEP_CHECKOUT is a checkout of deepseek-ai/DeepEP (its deep_ep/utils/, tests/legacy/test_intranode.py and the
# tests/legacy/test_low_latency.py it imports are used from there and never copied into this repository). The `deep_ep` package the test imports is
# assembled under a temporary folder: `moe_a2a.compat.deep_ep` as the package, DeepEP's own test utilities as
# `deep_ep.utils`, and a stand-in for its C++ extension holding only the names those utilities import.
# --shared-gpu: more processes than GPUs; `deep_ep.utils.envs` is then ours (benchmarks/gpu/
# deepep_shared_gpu_envs.py: DeepEP's module with an init_dist that shares GPUs and uses gloo), the rest DeepEP's.
# Passes at 2 and 8 processes on 1 x H200 under MPS (2026-12-02, docs/compat.md). Memory at the test's defaults
# (4096 tokens, hidden 7168, top-8): about 6 GB a rank at 8 processes (two instances for bf16 and fp8 calls).
set -euo pipefail
# The same assembly as the low-latency test (deepep_low_latency.sh), another test of DeepEP's.
DEEPEP_TEST=test_intranode.py exec bash "$(dirname "$0")/deepep_low_latency.sh" "$@"
