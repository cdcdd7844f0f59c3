"""Every command line the README shows still works: each runs with `--help` appended (which also
type-checks every flag value written before it), and the demo runs for real at a tiny size.

Command lines are the lines of ```bash blocks that start with `moe-a2a`, `python -m` or `python3 -m`
(trailing `# comments` dropped). The first two command lines (`bash .ci/setup.sh && ...`: install,
then demo / tests) are only checked to be there, at the top: they install packages.
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from .conftest import interpreter_only

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _bash_blocks(text: str) -> list[list[str]]:
    return [block.splitlines() for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)]


def _commands(text: str) -> list[str]:
    cmds = []
    for block in _bash_blocks(text):
        for line in block:
            line = line.strip()
            if line.startswith(("moe-a2a", "python -m", "python3 -m")):
                cmds.append(line)
    return cmds


COMMANDS = _commands(README.read_text())


def _argv(line: str) -> list[str]:
    """The command as an argv run with this interpreter (the installed `moe-a2a` script beside it
    when there is one, else `python -m moe_a2a.cli`)."""
    words = shlex.split(line, comments=True)
    if words[0] == "moe-a2a":
        script = Path(sys.executable).with_name("moe-a2a")
        return ([str(script)] if script.exists() else [sys.executable, "-m", "moe_a2a.cli"]) + words[1:]
    assert words[0] in ("python", "python3") and words[1] == "-m", line
    return [sys.executable] + words[1:]


def _run(argv: list[str], timeout: float, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", **env_vars)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_setup_lines_open_the_readme():
    first = _bash_blocks(README.read_text())[0]
    lines = [l.strip() for l in first if l.strip()]
    assert len(lines) >= 2
    assert lines[0].startswith("bash .ci/setup.sh && moe-a2a demo"), lines[0]
    assert lines[1].startswith("bash .ci/setup.sh && TRITON_INTERPRET=1 python3 -m pytest"), lines[1]
    assert (ROOT / ".ci" / "setup.sh").exists()


def test_readme_shows_commands():
    assert any(c.startswith("moe-a2a bench") for c in COMMANDS)
    assert any(c.startswith(("python -m", "python3 -m")) for c in COMMANDS)
    assert not any("docs/" in w for c in COMMANDS for w in shlex.split(c, comments=True)), \
        "README commands must not write into docs/ (committed files)"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("line", COMMANDS)
def test_readme_command_help(line):
    r = _run(_argv(line) + ["--help"], timeout=100)
    assert r.returncode == 0, f"{line} --help: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip().startswith("usage:"), r.stdout
    assert "Traceback" not in r.stderr, r.stderr


@interpreter_only("its ranks run on the CPU (--device cpu / device='cpu')")
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_runs_small():
    """`moe-a2a demo` for real: 2 ranks, 1 per node, one call (about 15 s on 2 CPU cores)."""
    r = _run(_argv("moe-a2a demo --world-size 2 --node-size 1 --iters 1"), timeout=170)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "match reference.py" in r.stdout
    assert re.search(r"^  transport: \S+", r.stdout, re.M), r.stdout
    assert re.search(r"^  send/recv buffers: (host|ipc|nic)", r.stdout, re.M), r.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cmd", ["bench kernels", "bench kernels --preset decode", "bench nccl",
                                 "bench e2e --device cuda", "demo --device cuda"])
def test_gpu_commands_say_so_on_cpu(cmd):
    # No GPU visible to the command, here or on the GPU machine: it must say so, not crash.
    r = _run(_argv("moe-a2a " + cmd), timeout=100, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moe-a2a {cmd.split(' --')[0]}") \
        and lines[0].endswith("needs a CUDA GPU (none found)"), r.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_world_size_0_is_a_flag_error():
    r = _run(_argv("moe-a2a demo --world-size 0"), timeout=100)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-a2a demo: error:") and "--world-size" in last and ">= 1" in last, r.stderr
    assert "Traceback" not in r.stderr
