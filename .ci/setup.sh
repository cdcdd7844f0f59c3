#!/usr/bin/env bash
# All set-up on a fresh Debian CPU machine (and idempotent on a prepared one):
# libfabric (tcp + shm providers, headers for the struct-layout test), then the package with its
# test extras. torch==2.13.0 is the CPU build available from the configured package index.
# A failed install fails set-up (non-zero exit, with a message), so `setup.sh && ...` stops there.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! dpkg -s libfabric1 libfabric-dev libfabric-bin >/dev/null 2>&1; then
  $SUDO apt-get install -y -q libfabric1 libfabric-dev libfabric-bin >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q libfabric1 libfabric-dev libfabric-bin >/dev/null; }
fi

# pip's output without the harmless "Running pip as the 'root' user" warning; pip's exit status decides
# (pipefail: the filter itself always succeeds, even when it prints nothing).
pip_install() {
  if ! python3 -m pip install -q "$@" 2>&1 | { grep -v "Running pip as the 'root' user" || true; }; then
    echo "setup.sh: FAILED: python3 -m pip install $* (pip's errors above; is the package index reachable?" \
         "pip config list / PIP_INDEX_URL say which one is used)" >&2
    exit 1
  fi
}
pip_install torch==2.13.0
pip_install -e '.[test]'
