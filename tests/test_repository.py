"""The repository stands alone: every document it mentions by file name is in it (a user has nothing
else; the project's own account of its design is docs/design.md)."""
from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = {".py", ".md", ".sh", ".ipynb", ".toml"}
SKIP = {".git", ".hypothesis", "old_pkg"}
# A document named in text: a path or bare name ending in .md, .txt or .ipynb (not part of a longer path
# or a URL, not an output written under $OUT).
MENTION = re.compile(r"(?<![\w$/.:-])((?:\.\./|[\w-]+/)*[\w-]+\.(?:md|txt|ipynb))\b")


def _tracked() -> list[pathlib.Path]:
    """The repository's files: git's tracked and untracked-but-not-ignored ones (a virtualenv or build
    output inside the checkout is not the repository), or every file when there is no git."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, check=True).stdout.decode()
        found = [ROOT / name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        found = list(ROOT.rglob("*"))
    return [p for p in found if p.is_file() and not SKIP & set(p.relative_to(ROOT).parts)
            and "egg-info" not in str(p)]


def _resolves(mention: str, source: pathlib.Path, names: set[str], paths: set[str]) -> bool:
    """In the repository: as a path from the root, from the mentioning file's folder (without leaving
    the repository), or as the name of one of its files."""
    if mention in paths:
        return True
    target = (source.parent / mention).resolve()
    if target.exists():
        return target.is_relative_to(ROOT)
    return ".." not in mention and pathlib.PurePath(mention).name in names


@pytest.mark.slow
def test_every_document_mentioned_is_in_the_repository():
    files = _tracked()
    names = {p.name for p in files}
    paths = {str(p.relative_to(ROOT)) for p in files}
    missing = []
    for path in files:
        if path.suffix not in SOURCES or path == pathlib.Path(__file__).resolve():  # (its made-up examples)
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in MENTION.finditer(line):
                if not _resolves(m.group(1), path, names, paths):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {m.group(1)}")
    assert not missing, "documents named but not in the repository:\n" + "\n".join(missing)


def test_the_check_finds_an_outside_document(tmp_path):
    # the check itself: a name nowhere in the repository, and a path that leaves it, are both caught
    names, paths = {"design.md"}, {"docs/design.md"}
    src = ROOT / "docs" / "design.md"
    assert _resolves("docs/design.md", src, names, paths) and _resolves("design.md", src, names, paths)
    assert not _resolves("working-notes.md", src, names, paths)
    assert not _resolves("../../outside/design.md", src, names, paths)


# ---- the marker rules of tests/conftest.py, checked themselves --------------------------------------
def test_a_skip_for_want_of_a_gpu_needs_the_gpu_marker_and_every_skip_a_reason():
    from .conftest import INTERPRETER_ONLY, skip_rule_violations

    gpu_skip = pytest.mark.skipif(True, reason="needs a CUDA GPU (compiled kernels)").mark
    [problem] = skip_rule_violations("t", [gpu_skip])
    assert "not marked gpu" in problem, problem
    assert skip_rule_violations("t", [gpu_skip, pytest.mark.gpu.mark]) == []
    assert skip_rule_violations("t", [pytest.mark.skip(reason="cuda graphs").mark]) != []
    assert skip_rule_violations("t", [pytest.mark.skipif(True, reason=INTERPRETER_ONLY + "on a GPU it faults").mark]) == []
    assert skip_rule_violations("t", [pytest.mark.skipif(True, reason="tcp offers one domain here").mark]) == []
    [problem] = skip_rule_violations("t", [pytest.mark.skipif(True).mark])
    assert "without a reason" in problem


def test_a_test_that_starts_processes_must_be_marked_slow():
    from .conftest import spawn_rule_violation

    assert "is not marked slow" in spawn_rule_violation("t", [], ["subprocess ['true']"])
    assert spawn_rule_violation("t", [pytest.mark.slow.mark], ["subprocess ['true']"]) is None
    assert spawn_rule_violation("t", [], []) is None


@pytest.mark.slow
def test_the_process_watch_sees_subprocesses_and_multiprocessing():
    import multiprocessing
    import os

    from . import conftest

    before = len(conftest.SPAWNS)
    subprocess.run(["true"], check=True)
    p = multiprocessing.get_context("fork").Process(target=os.getpid)
    p.start()
    p.join(30)
    seen = conftest.SPAWNS[before:]
    assert p.exitcode == 0 and any(s.startswith("subprocess ['true']") for s in seen), seen
    assert any(s.startswith("multiprocessing ") for s in seen) and "os.fork" in seen, seen
