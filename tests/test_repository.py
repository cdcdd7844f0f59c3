"""The repository stands alone: nothing in it points to a file outside it (the working notes the
project started from live elsewhere; docs/design.md is the project's own account)."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"DESIGN\.md|DESIGN section|\bDESIGN §|shared/reference|\.\./shared|000_d398671e694e9250")


def test_no_reference_points_outside_the_repository():
    hits = []
    for path in ROOT.rglob("*"):
        if path.suffix not in {".py", ".md", ".sh", ".ipynb", ".toml", ".txt", ".cfg"} or not path.is_file():
            continue
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {".git", "old_pkg", ".hypothesis"} or "egg-info" in str(rel) or path == pathlib.Path(__file__):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)
