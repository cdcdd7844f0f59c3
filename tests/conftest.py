"""Test settings shared by every test.

CI has no GPU: kernels run in the Triton interpreter on CPU tensors. On the GPU machine run the same
property tests with compiled kernels by setting MOE_A2A_TEST_DEVICE=cuda (and not TRITON_INTERPRET),
e.g. `MOE_A2A_TEST_DEVICE=cuda python -m pytest tests/triton_kernels`.
"""
import os
import re
import sys

import pytest

TEST_DEVICE = os.environ.get("MOE_A2A_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def examples(n: int) -> int:
    """Hypothesis examples for a property test: all of them in CI; a quarter with compiled kernels,
    where every new shape costs a compilation (about a second) on the GPU machine."""
    return n if TEST_DEVICE == "cpu" else max(10, n // 4)


# ---- markers: `gpu` (GPU-only tests) and `slow` (tests that start processes) ------------------------
# `-m "not gpu"` is the CPU suite, `-m "not slow"` the tests that run in this process alone. Both rules are
# enforced here, so they cannot rot: a skip that speaks of a GPU on a test without `gpu` fails collection,
# and a test that starts a process without `slow` fails.
# The reason of a skip for a test of the Triton interpreter's path, skipped where kernels are compiled.
INTERPRETER_ONLY = "runs only in the Triton interpreter (MOE_A2A_TEST_DEVICE=cpu): "


def interpreter_only(why: str):
    """Skip where kernels are compiled (MOE_A2A_TEST_DEVICE=cuda): the test is of the interpreter's path."""
    return pytest.mark.skipif(TEST_DEVICE != "cpu", reason=INTERPRETER_ONLY + why)


def missing_gpus(devices: int = 1) -> str | None:
    """Why a `gpu` test cannot run here (None: it can). GPU tests run with compiled kernels, on the GPU
    machine: at least `devices` CUDA GPUs and MOE_A2A_TEST_DEVICE=cuda."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < devices:
        return f"needs {devices} CUDA GPU(s), {have} here"
    if TEST_DEVICE != "cuda":
        return "needs MOE_A2A_TEST_DEVICE=cuda (compiled kernels; here they run in the interpreter on CPU tensors)"
    return None


_SPEAKS_OF_A_GPU = re.compile(r"\bGPUs?\b|\bCUDA\b|\bcuda\b")


def skip_rule_violations(nodeid: str, marks) -> list[str]:
    """What breaks the skip rules in a test's marks: a skip without a reason, or one that speaks of a GPU on
    a test not marked `gpu` (interpreter-only skips excepted)."""
    names = {m.name for m in marks}
    out = []
    for m in marks:
        if m.name not in ("skip", "skipif"):
            continue
        reason = m.kwargs.get("reason") or (m.args[0] if m.name == "skip" and m.args else "")
        if not reason:
            out.append(f"{nodeid}: a {m.name} without a reason")
        elif _SPEAKS_OF_A_GPU.search(reason) and "gpu" not in names and not reason.startswith(INTERPRETER_ONLY):
            out.append(f"{nodeid}: skipped for want of a GPU ({reason!r}) but not marked gpu: use @pytest.mark.gpu")
    return out


def pytest_collection_modifyitems(config, items):
    problems = []
    for item in items:
        problems += skip_rule_violations(item.nodeid, list(item.iter_markers()))
        gpu = item.get_closest_marker("gpu")
        if gpu is not None:
            missing = missing_gpus(gpu.kwargs.get("devices", 1))
            if missing:
                why = gpu.kwargs.get("reason", "")
                item.add_marker(pytest.mark.skip(reason=f"GPU test, {missing}{': ' + why if why else ''}"))
    if problems:
        raise pytest.UsageError("marker rules (tests/conftest.py):\n" + "\n".join(problems))


# Processes started by the test running now: multiprocessing, subprocess and os.fork, recorded by the
# patches below, except where a library probes the machine (ctypes.util runs ldconfig, platform uname,
# matplotlib's font manager runs fc-list on a machine without its font cache) or Triton compiles (its own
# ptxas / C compiler): none is the test's doing.
SPAWNS: list[str] = []
_NOT_THE_TESTS = ("ctypes/util.py", "/platform.py", "/triton/", "/matplotlib/")


def _record(what: str) -> None:
    f = sys._getframe(2)
    while f is not None:
        if any(part in f.f_code.co_filename for part in _NOT_THE_TESTS):
            return
        f = f.f_back
    SPAWNS.append(what)


def _watch_spawns() -> None:
    import multiprocessing.process
    import os
    import subprocess

    start, popen_init = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def watched_start(self, *a, **k):
        _record(f"multiprocessing {self.name}")
        return start(self, *a, **k)

    def watched_init(self, args, *a, **k):
        _record(f"subprocess {str(args)[:120]}")
        return popen_init(self, args, *a, **k)

    multiprocessing.process.BaseProcess.start = watched_start
    subprocess.Popen.__init__ = watched_init
    os.register_at_fork(before=lambda: _record("os.fork"))


def spawn_rule_violation(nodeid: str, marks, spawns) -> str | None:
    """Why a test with `marks` may not have started `spawns` (None: it may)."""
    if not spawns or "slow" in {m.name for m in marks}:
        return None
    return (f"{nodeid} started {len(spawns)} process(es) ({'; '.join(spawns[:3])}) but is not marked slow: "
            "every test that starts processes carries @pytest.mark.slow (tests/conftest.py)")


def pytest_configure(config):
    _watch_spawns()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    SPAWNS.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and report.passed:
        why = spawn_rule_violation(item.nodeid, list(item.iter_markers()), SPAWNS)
        if why:
            report.outcome, report.longrepr = "failed", why
    return report
