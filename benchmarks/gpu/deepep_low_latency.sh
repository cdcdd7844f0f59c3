#!/usr/bin/env bash
# DeepEP's own low-latency test, unchanged, against moe_a2a's DeepEP facade (docs/compat.md).
#
#   bash benchmarks/gpu/deepep_low_latency.sh DEEPEP_CHECKOUT [--shared-gpu] [the test's arguments, e.g. --num-processes 2]
#
# DEEPEP_CHECKOUT is a checkout of deepseek-ai/DeepEP (its deep_ep/utils/ and tests/legacy/test_low_latency.py
# are used from there and never copied into this repository). The `deep_ep` package the test imports is
# assembled under a temporary folder: `moe_a2a.compat.deep_ep` as the package, DeepEP's own test utilities as
# `deep_ep.utils`, and a stand-in for its C++ extension holding only the names those utilities import.
# --shared-gpu: more processes than GPUs; `deep_ep.utils.envs` is then ours (benchmarks/gpu/
# deepep_shared_gpu_envs.py: DeepEP's module with an init_dist that shares GPUs and uses gloo), the rest DeepEP's.
# DEEPEP_TEST: another test of tests/legacy/ to run the same way (deepep_intranode.sh: test_intranode.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
test=${DEEPEP_TEST:-test_low_latency.py}
src=$(cd "${1:?usage: deepep_low_latency.sh DEEPEP_CHECKOUT [--shared-gpu] [test arguments]}" && pwd); shift
shared=0; [ "${1:-}" = "--shared-gpu" ] && { shared=1; shift; }
for need in deep_ep/utils/envs.py tests/legacy/test_low_latency.py "tests/legacy/$test"; do
  [ -f "$src/$need" ] || { echo "$(basename "$0"): $src has no $need (a DeepEP checkout?)" >&2; exit 2; }
done
shim=$(mktemp -d); trap 'rm -rf "$shim"' EXIT
mkdir -p "$shim/deep_ep"
cat > "$shim/deep_ep/__init__.py" <<'PY'
"""What DeepEP's tests import as `deep_ep`: moe_a2a's facade (assembled by benchmarks/gpu/deepep_low_latency.sh)."""
from moe_a2a.compat.deep_ep import *  # noqa: F401,F403
PY
cat > "$shim/deep_ep/_C.py" <<'PY'
"""Stand-in for DeepEP's C++ extension: the names its test utilities import; none is called by this test."""


class EventHandle:
    pass


def __getattr__(name):
    raise AttributeError(f"deep_ep._C.{name}: DeepEP's C++ extension is not part of moe_a2a")
PY
if [ "$shared" = 1 ]; then  # DeepEP's utilities one by one, its envs.py replaced by ours (which loads it)
  mkdir "$shim/deep_ep/utils"
  for f in "$src"/deep_ep/utils/*.py; do [ "$(basename "$f")" = envs.py ] || ln -s "$f" "$shim/deep_ep/utils/"; done
  cp benchmarks/gpu/deepep_shared_gpu_envs.py "$shim/deep_ep/utils/envs.py"
  export MOE_A2A_DEEPEP_ENVS="$src/deep_ep/utils/envs.py"
else
  ln -s "$src/deep_ep/utils" "$shim/deep_ep/utils"
fi
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
python3 "$src/tests/legacy/$test" "$@"
