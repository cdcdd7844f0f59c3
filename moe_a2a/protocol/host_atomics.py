"""Release stores and acquire loads of int64 words in shared memory, from Python.

The model process, its proxy and the GPU signal each other through int64 epoch flags in the rank's
shared segment (`worker.Flags`). Whoever sees a flag reach an epoch then reads the data published
before it (count rows, the error message, ...). So every flag store must be a *release* store (this
thread's earlier writes are visible before the flag) and every flag load that guards later reads an
*acquire* load (those reads are not satisfied before it).

- x86-64 (TSO): aligned 8-byte plain loads and stores already are acquire loads and release stores
  (stores are not reordered with earlier stores, loads not with later loads), and each access is a
  C call of its own in CPython, which no compiler moves across another. We keep them plain (one
  8-byte access through ctypes): they are faster.
- Elsewhere (aarch64, e.g. Grace; also 32-bit x86, where a plain int64 access may be split in two),
  plain accesses give no such order. We call libatomic's `__atomic_store_8(ptr, val,
  __ATOMIC_RELEASE)` and `__atomic_load_8(ptr, __ATOMIC_ACQUIRE)` through ctypes (stlr / ldar on
  aarch64). Without libatomic this module refuses to import (RuntimeError naming `libatomic1`).

`MOE_A2A_HOST_ATOMICS=libatomic` in the environment, or `set_backend("libatomic")`, takes the
libatomic path on x86-64 too (the tests run both paths there).

Cost per call, measured on an x86-64 development machine (Python 3.11, timeit, best of 5 x
200 000 calls through the module): plain store 100 ns, load 95 ns; libatomic store 410 ns, load
310 ns (ctypes' foreign call is nearly all of it). `Flags[Flag.X]` costs 245 ns (store) and 205 ns
(load) plain, as the numpy indexing it replaced did (225 ns, 245 ns); 630 ns and 465 ns on libatomic.

Addresses must be 8-byte aligned, inside a live mapping, and values must fit in int64 (ctypes
wraps larger ones silently). Nothing is checked: these sit in the proxy's polling loops.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["store_release", "load_acquire", "set_backend", "backend", "PLAIN_IS_ORDERED", "FORCE_ENV"]

FORCE_ENV = "MOE_A2A_HOST_ATOMICS"  # "libatomic": take the libatomic path even where plain is enough
# Plain aligned 8-byte accesses are release/acquire here (64-bit x86; 32-bit x86 may tear them).
PLAIN_IS_ORDERED = (platform.machine().lower() in ("x86_64", "amd64")
                    and ctypes.sizeof(ctypes.c_void_p) == 8)

_ATOMIC_ACQUIRE, _ATOMIC_RELEASE = 2, 3  # GCC's __ATOMIC_* memory orders
_LIBRARY_NAMES = ("libatomic.so.1", "atomic")  # soname first: find_library runs ldconfig (slow)
_c_int64_at = ctypes.c_int64.from_address
_lib = None


def _libatomic():
    global _lib
    if _lib is None:
        for name in _LIBRARY_NAMES:
            path = name if name.startswith("lib") else ctypes.util.find_library(name)
            if not path:
                continue
            try:
                lib = ctypes.CDLL(path)
                store, load = lib.__atomic_store_8, lib.__atomic_load_8
            except (OSError, AttributeError):
                continue
            store.argtypes, store.restype = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int), None
            load.argtypes, load.restype = (ctypes.c_void_p, ctypes.c_int), ctypes.c_int64
            _lib = lib
            break
        else:
            raise RuntimeError(
                f"moe_a2a needs libatomic (__atomic_store_8/__atomic_load_8) for ordered flag stores "
                f"and loads on {platform.machine()}, and could not load it (tried {', '.join(_LIBRARY_NAMES)}): "
                f"install the libatomic1 package (apt-get install libatomic1; dnf install libatomic)")
    return _lib


def _plain_store(addr: int, value: int) -> None:
    _c_int64_at(addr).value = value


def _plain_load(addr: int) -> int:
    return _c_int64_at(addr).value


def _make_libatomic():
    lib = _libatomic()
    store, load = lib.__atomic_store_8, lib.__atomic_load_8

    def _atomic_store(addr: int, value: int) -> None:
        store(addr, value, _ATOMIC_RELEASE)

    def _atomic_load(addr: int) -> int:
        return load(addr, _ATOMIC_ACQUIRE)

    return _atomic_store, _atomic_load


def store_release(addr: int, value: int) -> None:
    """Store int64 `value` at `addr` (8-byte aligned): this thread's earlier writes are visible to
    whoever sees the value (replaced by the selected backend at import)."""
    raise AssertionError("unreachable: set_backend runs at import")


def load_acquire(addr: int) -> int:
    """Load the int64 at `addr` (8-byte aligned): this thread's later reads see everything written
    before the release store that wrote the value (replaced by the selected backend at import)."""
    raise AssertionError("unreachable: set_backend runs at import")


backend = ""  # "plain" or "libatomic": the path store_release / load_acquire take now


def set_backend(name: str | None = None) -> str:
    """Select "plain" (x86-64 only), "libatomic", or None: the default (libatomic unless
    PLAIN_IS_ORDERED; libatomic when MOE_A2A_HOST_ATOMICS=libatomic). Returns the name selected.
    Callers must look the functions up through the module (`host_atomics.store_release(...)`)."""
    global store_release, load_acquire, backend
    if name is None:
        forced = os.environ.get(FORCE_ENV, "")
        if forced not in ("", "libatomic"):
            raise ValueError(f"{FORCE_ENV}={forced!r}: the only accepted value is 'libatomic'")
        name = "plain" if PLAIN_IS_ORDERED and not forced else "libatomic"
    if name == "plain":
        if not PLAIN_IS_ORDERED:
            raise ValueError(f"plain loads and stores are not acquire/release on {platform.machine()}")
        store_release, load_acquire = _plain_store, _plain_load
    elif name == "libatomic":
        store_release, load_acquire = _make_libatomic()
    else:
        raise ValueError(f"unknown host atomics backend {name!r} (plain, libatomic)")
    backend = name
    return name


set_backend()
