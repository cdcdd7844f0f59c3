#!/usr/bin/env bash
# All set-up on a fresh Debian CPU machine (and idempotent on a prepared one):
# libfabric (tcp + shm providers, headers for the struct-layout test), then the package with its
# test extras. torch==2.13.0 is the CPU build available locally on these machines.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! dpkg -s libfabric1 libfabric-dev libfabric-bin >/dev/null 2>&1; then
  $SUDO apt-get install -y -q libfabric1 libfabric-dev libfabric-bin >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q libfabric1 libfabric-dev libfabric-bin >/dev/null; }
fi
python3 -m pip install -q torch==2.13.0 2>&1 | grep -v "Running pip as the 'root'" || true
python3 -m pip install -q -e '.[test]' 2>&1 | grep -v "Running pip as the 'root'" || true
