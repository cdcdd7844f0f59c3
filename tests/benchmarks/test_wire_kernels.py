"""benchmarks/gpu/wire_kernels.py's summary of every rank's kernel positions (the runs themselves need a GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))

import wire_kernels  # noqa: E402


def test_each_position_names_its_slowest_rank():
    ranks = [[("route", 3.0), ("pack", 10.0), ("wait", 50.0)],
             [("route", 4.0), ("pack", 9.0), ("wait", 2.0)],
             [("route", 3.5), ("pack", 12.5), ("wait", 7.0)]]
    assert wire_kernels._slowest(ranks) == [("route", 4.0, 1), ("pack", 12.5, 2), ("wait", 50.0, 0)]
