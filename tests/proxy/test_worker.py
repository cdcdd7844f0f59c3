"""The proxy process's start-up."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow]  # a Python process of its own per case

# Plants what a dead process that had this pid left behind, then opens an shm endpoint, clearing first or not.
_RECYCLED_PID = r'''
import os, sys
from moe_a2a.proxy.engine import TransferEngine
from moe_a2a.proxy.worker import clear_stale_regions
open(f"/dev/shm/{os.getpid()}:0:0", "wb").write(bytes(4096))
if sys.argv[1] == "clear":
    print("removed:", clear_stale_regions())
try:
    TransferEngine("shm", timeout_s=5).close()
    print("opened")
except Exception as exc:
    print("failed:", exc)
finally:
    clear_stale_regions()
'''


def _run(mode: str) -> str:
    r = subprocess.run([sys.executable, "-c", _RECYCLED_PID, mode], cwd=ROOT, capture_output=True, text=True,
                       timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.timeout(60)
def test_a_recycled_pids_stale_shm_region_is_cleared_before_the_endpoint_opens():
    """libfabric's shm provider names its region by pid; a region a dead process left under a pid the
    kernel then gave a proxy made that proxy's endpoint fail with -FI_EBUSY (seen in CI: pid_max 32768,
    hundreds of processes). The proxy clears its own pid's regions before it opens anything."""
    assert "failed: fi_enable failed: -FI_EBUSY" in _run("keep")  # the failure, reproduced
    out = _run("clear").splitlines()
    assert out[0].startswith("removed: [") and ":0:0" in out[0] and out[1] == "opened", out
