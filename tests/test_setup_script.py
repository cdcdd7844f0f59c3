""".ci/setup.sh: a failed pip install fails set-up with a message (it used to be hidden behind
`| grep -v ... || true`); pip's harmless root warning stays filtered. Runs the script against fake
`python3` and `dpkg` on PATH (a temporary folder), so nothing is installed or removed for real."""
import os
import stat
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / ".ci" / "setup.sh"

pytestmark = [pytest.mark.slow]  # runs .ci/setup.sh in bash
ROOT_WARNING = ("WARNING: Running pip as the 'root' user can result in broken permissions and conflicting "
                "behaviour with the system package manager.")


def _shim(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _run_setup(tmp_path: Path, fail_on: str | None):
    """setup.sh with a fake `python3 -m pip install` that logs its arguments, prints pip's root warning
    and exits 1 when its arguments contain `fail_on`; `dpkg -s` says libfabric is installed."""
    bin_dir, log = tmp_path / "bin", tmp_path / "pip.log"
    bin_dir.mkdir()
    _shim(bin_dir, "dpkg", "exit 0\n")
    _shim(bin_dir, "apt-get", "echo 'apt-get must not run: dpkg says the packages are installed' >&2; exit 3\n")
    _shim(bin_dir, "python3", f"""
if [ "$1 $2" != "-m pip" ]; then echo "unexpected python3 call: $*" >&2; exit 3; fi
echo "$*" >> {log}
echo "{ROOT_WARNING}" >&2
case "$*" in *"{fail_on or '@never@'}"*)
  echo "ERROR: Could not find a version that satisfies the requirement (from versions: none)" >&2
  echo "ERROR: No matching distribution found" >&2
  exit 1;;
esac
exit 0
""")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


@pytest.mark.parametrize("fail_on", ["torch==2.13.0", ".[test]"])
def test_a_failed_pip_install_fails_setup_with_a_message(tmp_path, fail_on):
    proc, calls = _run_setup(tmp_path, fail_on)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "No matching distribution found" in proc.stdout + proc.stderr  # pip's own error is shown
    assert "setup.sh: FAILED: python3 -m pip install" in proc.stderr and fail_on in proc.stderr
    assert "Running pip as the 'root' user" not in proc.stdout + proc.stderr
    assert "apt-get must not run" not in proc.stderr
    assert len(calls) == (1 if fail_on.startswith("torch") else 2)  # stops at the first failure


def test_successful_installs_pass_quietly_without_the_root_warning(tmp_path):
    proc, calls = _run_setup(tmp_path, None)
    assert proc.returncode == 0, proc.stderr
    assert "Running pip as the 'root' user" not in proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == ""
    assert calls == ["-m pip install -q torch==2.13.0", "-m pip install -q -e .[test]"]
