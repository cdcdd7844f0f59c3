"""benchmarks/facade_python.py runs (tiny sizes) and reports what docs/perf-notes.md quotes from it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ..conftest import interpreter_only

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow]  # the benchmark runs as a process of its own


@interpreter_only("its ranks run on the CPU (--device cpu / device='cpu')")
@pytest.mark.timeout(300)
def test_facade_python_smoke_reports_each_variant_and_the_lines_a_pair_runs():
    out = subprocess.run([sys.executable, "benchmarks/facade_python.py", "--smoke", "--lines"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    for variant in ("facade", "facade_in_place", "a2a_prequantised"):
        assert re.search(rf"^  {variant} +median +[\d.]+ µs, fastest batch +[\d.]+ µs$", out.stdout, re.M), out.stdout
    lines = dict(re.findall(r"^  (\w+): (\d+) lines a pair", out.stdout, re.M))
    # The facade's pair runs its own code on top of its instances' (which run what AllToAll's own pair does).
    assert int(lines["facade_in_place"]) > int(lines["a2a_prequantised"]) > 100, out.stdout
