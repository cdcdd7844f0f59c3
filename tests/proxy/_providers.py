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
    """`pytest.param`s of `providers`. tcp and shm are software providers of every libfabric we run on
    (.ci/setup.sh installs it): one that is missing is a broken install, not a missing device, so its tests
    fail (libfabric's fi_getinfo error names it) instead of being skipped."""
    return [pytest.param(p, id=p) for p in providers]
