#!/usr/bin/env bash
# Build an environment for the engines lane (tests/engines) on a CPU-only Linux host, Python 3.11:
#   bash tests/engines/build_env.sh VENV        (default VENV: ../engines-venv, beside the checkout)
# then, from the checkout:
#   VENV/bin/python -m pytest -m engines tests/engines
#
# - vLLM 0.33.0 in full, from the package index: it pins torch 2.14.0, whose index wheel is the GPU build;
#   it runs on a host without GPUs (vLLM's platform is then "unspecified", and the lane sets the little that
#   needs a device). vLLM's CPU wheels (`+cpu`, built against a CPU torch) are not on the package index.
#   A separate venv, not --system-site-packages: vLLM's torch pin would fight the project's own torch.
# - SGLang 0.5.23 `--no-deps` over it (its own pins, e.g. sgl-deep-ep, sglang-kernel, flash-attn-4, are GPU
#   builds; vLLM already brought most of the rest), plus the two modules its DeepEP dispatcher's import chain
#   needs that vLLM does not bring: IPython, gguf. Without sgl-deep-ep there is no real `deep_ep` here.
# - moe_a2a from this checkout (editable: its entry points are what the engines' plugin loaders find), pytest.
# About 10 GB of disk, a few minutes with a fast index. Never commit the venv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/../engines-venv}"
PY="${PYTHON:-python3}"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" "vllm==0.33.0"
"${PIP[@]}" --no-deps "sglang==0.5.23"
"${PIP[@]}" IPython gguf
"${PIP[@]}" -e "$ROOT" pytest pytest-timeout hypothesis
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("vllm", "sglang", "torch", "triton", "transformers", "moe_a2a"):
    print(f"{name}=={md.version(name)}")
PY
echo "engines lane: cd $ROOT && $VENV/bin/python -m pytest -m engines tests/engines"
