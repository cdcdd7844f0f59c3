"""Which libfabric providers this machine has, for tests parametrised over them."""
from __future__ import annotations

import pytest

from moe_a2a.proxy import libfabric as lf

PROVIDERS = ("tcp", "shm")


def available(provider: str) -> bool:
    try:
        lf.getinfo(provider).close()
    except (OSError, lf.FabricError):
        return False
    return True


def provider_params(providers=PROVIDERS) -> list:
    """`pytest.param`s of `providers`, each skipped (saying why) where libfabric lacks it."""
    return [pytest.param(p, marks=pytest.mark.skipif(not available(p), reason=f"libfabric provider {p} unavailable"))
            for p in providers]
