"""How the launchers launch (private: `from . import _launch as launch`): the word a row is copied in,
block sizes and grids, and remembered launches (`LaunchCache`) that skip Triton's per-call binding.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os

import torch
import triton

from ..config import Layout, ceil_div, next_power_of_2

log = logging.getLogger("moe_a2a")
_Tensor = torch.Tensor

# The compiled names of the four data kernels (`triton.jit(repr=...)`; the Python names stay descriptive).
# DeepEP's profiler helper (`bench_kineto`) takes the one profiler row whose name holds "dispatch" (or
# "combine") and, with receive hooks, the trace events holding "::dispatch", split in send / receive.
# So the send and receive kernels of each op share one C++-mangled symbol, which the profiler demangles
# to `moe_a2a::dispatch()` / `moe_a2a::combine()`; no other kernel's name holds either word.
DISPATCH_SYMBOL = "_ZN7moe_a2a8dispatchEv"
COMBINE_SYMBOL = "_ZN7moe_a2a7combineEv"


def compiled_as(symbol: str):
    """`triton.jit(repr=compiled_as(S))`: the kernel's compiled (and profiled) name is S."""
    return lambda _specialization: symbol


def _interpreter_device_calls_skip_repatching() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) patches `triton.language` once per launch and again at every
    call of a nested `@triton.jit` function (`inspect.getmembers` over the modules, ~1.5 ms: 45% of a call's
    time at test sizes, our kernels calling a few hundred helpers a call). Here a launch patches both language
    modules a function can see (`triton.language` and `triton.language.core`: the launch's scope restores
    them), so a nested call finds them patched and skips its own: the same interpretation, faster. Applied only
    where the interpreter is the one this was written against (else nothing changes); returns whether it was."""
    from triton.runtime import interpreter

    cls = getattr(interpreter, "InterpretedFunction", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if cls is None or patch_lang is None:
        return False
    if getattr(cls.__call__, "_moe_a2a", False):
        return True
    try:
        body, patch = inspect.getsource(cls.__call__), inspect.getsource(patch_lang)
    except (OSError, TypeError):
        return False
    if ("_patch_lang(self.fn)" not in body or "self.rewrite()" not in body or "fn.__globals__" not in patch
            or not hasattr(interpreter, "InterpreterError")):
        return False
    import triton.language as tl

    both = type("_BothLanguages", (), {"__globals__": {"tl": tl, "core": tl.core}})

    def launch_patch(fn):
        return patch_lang(both)  # what every nested function's own patch would patch, once, in the launch's scope

    def device_call(self, *args, **kwargs):
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    device_call._moe_a2a = True
    interpreter._patch_lang = launch_patch
    cls.__call__ = device_call
    return True


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_device_calls_skip_repatching()

# Persistent programs per SM of the unpack / combine-pack kernels: 1 beats 2 and 4 on H200
# (docs/perf-notes.md). A fraction gives a rank that share of the SMs (a probe: slower with 8 ranks a GPU).
PROGRAMS_PER_SM = 1
# Programs of those kernels without a GPU (interpreter): few, but more than one, so the persistent
# loop's stride is exercised.
CPU_PROGRAMS = 3
# Largest copy chunk of one row, in bytes: 2 KB = 4 warps x 32 lanes x 16 bytes, one vector per lane.
MAX_CHUNK_BYTES = 2048
# Rows per tile of the unpack / combine-pack loop. Each tile pays a one-hot lookup over the W*L pairs,
# so bigger tiles amortise it, but at decode there are only ~1000 rows for 132 SMs: small tiles at
# decode, larger ones when a rank sends more than LARGE_ROUTES routes (prefill).
ROWS_PER_TILE = 8
ROWS_PER_TILE_LARGE = 16
LARGE_ROUTES = 4096
# The interpreter pays per operation, not per element, so it takes big tiles.
CPU_ROWS_PER_TILE = 32
# Tokens per program of pack / reduce in the interpreter (1 on GPU).
CPU_TOKENS_PER_PROGRAM = 64


# ================================================================================================
# Words, blocks and grids
# ================================================================================================
def word_bytes(row_bytes: int, *byte_quantities: int) -> tuple[int, torch.dtype]:
    """Widest word (4, 2 or 1 bytes) that divides a row's length and every address quantity."""
    for size, dtype in ((4, torch.int32), (2, torch.int16), (1, torch.uint8)):
        if row_bytes % size == 0 and all(q % size == 0 for q in byte_quantities):
            return size, dtype
    raise AssertionError("unreachable")


def align_words(word_bytes: int, *byte_quantities: int) -> int:
    """Words every row start is a multiple of: 16 bytes' worth when all starts are 16-aligned (the
    compiler then issues 16-byte vector accesses), else 1 (no hint)."""
    return 16 // word_bytes if all(q % 16 == 0 for q in byte_quantities) else 1


def as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same memory as `t` ([N, H] any dtype, last stride 1) viewed as [N, bytes/word] words."""
    u8 = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return u8 if dtype == torch.uint8 else u8.view(dtype)


def chunk_words(row_words: int, word_bytes: int) -> int:
    return min(next_power_of_2(max(row_words, 1)), MAX_CHUNK_BYTES // word_bytes)


def num_warps(block_elems: int, elem_bytes: int) -> int:
    """One 16-byte vector per lane per access: warps = bytes / (32 lanes * 16 bytes), in [1, 8]."""
    return max(1, min(8, block_elems * elem_bytes // 512))


def tokens_per_program(device: torch.device, num_tokens: int) -> int:
    """Pack / reduce: one token per program on a GPU (decode T=128 x a few chunks fills 132 SMs); all
    tokens in one program in the interpreter, which pays per operation, not per element."""
    return 1 if device.type == "cuda" else min(next_power_of_2(num_tokens), CPU_TOKENS_PER_PROGRAM)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_grid(device: torch.device, layout: Layout,
                    rows_per_tile: tuple[int, int] = (ROWS_PER_TILE, ROWS_PER_TILE_LARGE)) -> tuple[tuple[int], int]:
    """(grid, rows per tile) of the persistent kernels; `rows_per_tile`: (small, large) layouts' tiles on a
    GPU. The grid is fixed by the device and the buffer capacity, never by the data (that would need a host
    sync and break CUDA graphs)."""
    max_rows = layout.max_recv_routes
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = max(1, int(_sm_count(index) * PROGRAMS_PER_SM))  # a fraction: a share of the SMs
        rows_per_tile = rows_per_tile[1] if layout.max_routes > LARGE_ROUTES else rows_per_tile[0]
    else:
        programs, rows_per_tile = CPU_PROGRAMS, CPU_ROWS_PER_TILE
    return (max(1, min(programs, ceil_div(max_rows, rows_per_tile))),), rows_per_tile


# ================================================================================================
# Remembered launches (GPU): the eager path without Triton's per-call argument binding
# ================================================================================================
def tensor_key(t: torch.Tensor | None):
    """What of a tensor argument a launch depends on: address, dtype, shape, strides (None for None)."""
    return None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride())


def key(*args) -> tuple:
    """The key of a launch from every argument of its launcher: tensors by `tensor_key`, the rest as is."""
    # tensor_key inlined, in a list comprehension: every eager launch computes one (no generator frame).
    return tuple([(a.data_ptr(), a.dtype, a.shape, a.stride()) if isinstance(a, _Tensor) else a for a in args])


class LaunchCache:
    """Launches of one kernel remembered by a key the launcher computes from its own arguments.

    Triton binds and specialises every argument in Python on each launch (~40 µs for our ~30-argument
    kernels on an H200 host). A launcher whose key fixes every argument (data pointers, shapes,
    strides, ints, the config) can skip that, and its own checks and arithmetic: a hit calls the
    compiled kernel's C launcher with the arguments remembered in order, pointers as ints (no reference
    to a caller's tensor is kept, so a freed address that comes back under a new tensor hits again).
    Only CUDA launches are remembered. That C launcher is Triton's internal interface: when it refuses
    the call (another Triton version), the cache turns itself off, logs a warning once per process, and
    every call takes Triton's own path.
    """

    def __init__(self, kernel, size: int = 64) -> None:
        self.kernel, self.size = kernel, size
        self.enabled = True
        self._entries: dict = {}
        params = inspect.signature(kernel.fn).parameters
        self._names = list(params)
        self._defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}

    def clear(self) -> None:
        self._entries.clear()

    def has(self, key) -> bool:
        return self.enabled and key in self._entries

    def hit(self, key) -> bool:
        """Launch the remembered kernel for `key` on the current stream; False when there is none."""
        entry = self._entries.get(key) if self.enabled else None
        if entry is None:
            return False
        compiled, grid, args, device_index = entry
        try:
            compiled.run(grid[0], grid[1], grid[2], current_stream(device_index), compiled.function,
                         compiled.packed_metadata, None, None, None, *args)
        except Exception as error:  # a Triton whose launcher takes other arguments: fall back for good
            self._fall_back(f"its launcher refused the remembered call ({type(error).__name__}: {error})")
            return False
        return True

    def launch(self, key, grid: tuple, *args, **kwargs) -> None:
        """Launch through Triton and, on a GPU, remember the launch under `key`."""
        compiled = self.kernel[grid](*args, **kwargs)
        if not self.enabled or key is None or compiled is None:  # None: the interpreter launched it
            return
        if not hasattr(compiled, "packed_metadata"):
            self._fall_back("its compiled kernel has no packed_metadata")
            return
        device_index = torch.cuda.current_device()
        values = dict(zip(self._names, args))
        ordered = []
        for name in self._names:
            v = values[name] if name in values else kwargs[name] if name in kwargs else self._defaults[name]
            ordered.append(v.data_ptr() if isinstance(v, torch.Tensor) else v)
        if len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (compiled, tuple(grid) + (1,) * (3 - len(grid)), tuple(ordered), device_index)

    def _fall_back(self, why: str) -> None:
        global _warned
        self.enabled = False
        self._entries.clear()
        if not _warned:
            _warned = True
            log.warning("moe_a2a: remembered kernel launches are OFF (kernel %s: %s; has Triton %s changed its "
                        "launcher interface?): every eager call now pays Triton's argument binding, tens of "
                        "µs per kernel", getattr(self.kernel.fn, "__name__", "?"), why, triton.__version__)


_warned = False  # the fallback is logged once per process, whichever cache meets it first


def current_stream(device_index: int) -> int:
    """The raw current CUDA stream of a device: what Triton itself launches on. torch.cuda.current_stream()
    builds a Stream object (tens of µs per call); this is a C call."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(device_index) if get is not None else torch.cuda.current_stream(device_index).cuda_stream
