"""One results file for a part of the GPU test suite (`bash benchmarks/gpu/run.sh gpu-tests N`).

    python3 benchmarks/gpu/summarise_tests.py JUNIT_XML --part N --command "..." > RESULTS_FILE

Reads pytest's JUnit XML and writes: the commit, date, command, pass / fail / error / skip counts, the wall
time (the XML's), every failure and error by name with its first line, every skip with its reason, and the
slowest tests. Standard library only.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time
import xml.etree.ElementTree as ET


def read_cases(path: str) -> tuple[list[dict], float]:
    """(one dict per test case: name, seconds, outcome, message), the suite's wall time in s."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    cases, wall = [], 0.0
    for suite in suites:
        wall += float(suite.get("time", 0) or 0)
        for tc in suite.iter("testcase"):
            name = f"{tc.get('classname', '').replace('.', '/')}.py::{tc.get('name')}"
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = tc.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    message = (el.get("message") or el.text or "").strip().splitlines()[0][:200] \
                        if (el.get("message") or el.text) else ""
                    break
            cases.append({"name": name, "seconds": float(tc.get("time", 0) or 0), "outcome": outcome,
                          "message": message})
    return cases, wall


def summary(cases: list[dict], wall: float, part: str, command: str, slowest: int = 15) -> str:
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    commit = os.environ.get("MOE_A2A_COMMIT", "")  # a tree without .git (a copy) says which commit it is
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=False).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    lines = [f"GPU test suite, part {part}", f"commit: {commit}", time.strftime("date: %Y-%m-%d %H:%M UTC", time.gmtime()),
             f"command: {command}",
             f"result: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
             f"{counts['skipped']} skipped in {wall:.0f} s (pytest's wall time)"]
    for kind in ("failed", "error"):
        for c in (c for c in cases if c["outcome"] == kind):
            lines.append(f"{kind.upper()} {c['name']}: {c['message']}")
    skips = [c for c in cases if c["outcome"] == "skipped"]
    if skips:
        lines.append(f"skipped ({len(skips)}):")
        lines += [f"  {c['name']}: {c['message']}" for c in skips]
    lines.append(f"slowest {min(slowest, len(cases))} (s, summed over workers where pytest-xdist ran them):")
    lines += [f"  {c['seconds']:7.1f}  {c['name']}" for c in sorted(cases, key=lambda c: -c["seconds"])[:slowest]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit_xml")
    ap.add_argument("--part", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--slowest", type=int, default=15)
    args = ap.parse_args(argv)
    cases, wall = read_cases(args.junit_xml)
    print(summary(cases, wall, args.part, args.command, args.slowest), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
