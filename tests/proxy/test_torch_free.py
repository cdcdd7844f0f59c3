"""A folder is a process: `moe_a2a/proxy/` holds what runs in the proxy process, which never imports torch
(it would take seconds to start and hundreds of MB for nothing). Each module is imported in a fresh
interpreter, so nothing another test imported hides a torch import."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import moe_a2a.proxy

PROXY_DIR = pathlib.Path(moe_a2a.proxy.__file__).parent
MODULES = ["moe_a2a.proxy"] + sorted(f"moe_a2a.proxy.{p.stem}" for p in PROXY_DIR.glob("*.py") if p.stem != "__init__")


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
def test_importing_a_proxy_module_loads_no_torch(module):
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "bad = sorted(m for m in ('torch', 'triton') if m in sys.modules); "
            "print(' '.join(bad)); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"import {module} loaded: {out.stdout.strip()} {out.stderr[-2000:]}"
