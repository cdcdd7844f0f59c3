"""`_launch.LaunchCache`: remembered launches, checked with a stand-in kernel (the real ones are exercised
on the GPU by every kernel test: the launchers remember their launches there)."""
from __future__ import annotations

import logging

import torch

from moe_a2a.triton_kernels import _launch as launch


class _Compiled:
    packed_metadata, function = "meta", "fn"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(args)


class _Kernel:
    """What LaunchCache needs of a JITFunction: `.fn` and `kernel[grid](*args, **kwargs)` -> compiled."""

    def __init__(self, fail_on_run=False):
        self.calls, self.runs = [], []
        self.fail_on_run = fail_on_run

        def fn(a_ptr, n, b_ptr=None, BLOCK=16, FLAG=False):
            pass

        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            compiled = _Compiled(self.runs)
            if self.fail_on_run:
                def boom(*a):
                    raise TypeError("a launcher of another shape")
                compiled.run = boom
            return compiled
        return launch


def test_remembered_launch_replays_arguments_in_order_with_pointers_as_ints(monkeypatch):
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda index: 1234)
    kernel = _Kernel()
    cache = launch.LaunchCache(kernel, size=2)
    a = torch.zeros(8)
    key = ("k", launch.tensor_key(a))
    assert not cache.has(key) and not cache.hit(key)
    cache.launch(key, (3,), a, 5, BLOCK=32, num_warps=4)
    assert len(kernel.calls) == 1 and cache.has(key)
    assert cache.hit(key) and len(kernel.calls) == 1  # no new Triton launch
    grid_and_stream, args = kernel.runs[0][:4], kernel.runs[0][9:]
    assert grid_and_stream == (3, 1, 1, 1234)
    assert args == (a.data_ptr(), 5, None, 32, False)  # every parameter, defaults filled, num_warps not one
    # the oldest key goes first when the cache is full
    cache.launch("k2", (1,), a, 6)
    cache.launch("k3", (1,), a, 7)
    assert not cache.has(key) and cache.has("k2") and cache.has("k3")
    # no key: launched, never remembered
    cache.launch(None, (1,), a, 8)
    assert not cache.has(None)


def test_a_launcher_that_refuses_the_call_turns_the_cache_off(monkeypatch, caplog):
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda index: 0)
    monkeypatch.setattr(launch, "_warned", False)
    kernel = _Kernel(fail_on_run=True)
    cache = launch.LaunchCache(kernel)
    cache.launch("k", (1,), torch.zeros(1), 1)
    assert cache.has("k")
    with caplog.at_level(logging.WARNING, logger="moe_a2a"):
        assert not cache.hit("k")           # the caller then launches through Triton
    assert not cache.enabled and not cache.has("k")
    cache.launch("k", (1,), torch.zeros(1), 1)
    assert not cache.has("k")
    # Said loudly, once per process: a second cache that falls back logs nothing more.
    warnings = [r for r in caplog.records if r.name == "moe_a2a" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "remembered kernel launches are OFF" in warnings[0].getMessage()
    assert "a launcher of another shape" in warnings[0].getMessage()
    other = launch.LaunchCache(_Kernel(fail_on_run=True))
    other.launch("k", (1,), torch.zeros(1), 1)
    with caplog.at_level(logging.WARNING, logger="moe_a2a"):
        assert not other.hit("k")
    assert len([r for r in caplog.records if r.name == "moe_a2a"]) == 1


def test_interpreted_launches_are_not_remembered():
    class Interpreted(_Kernel):
        def __getitem__(self, grid):
            return lambda *a, **k: None  # TRITON_INTERPRET=1 launches return nothing
    cache = launch.LaunchCache(Interpreted())
    cache.launch("k", (1,), torch.zeros(1), 1)
    assert not cache.has("k")


# ---- the interpreter's nested calls ---------------------------------------------------------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ..conftest import interpreter_only  # noqa: E402


@triton.jit
def _row_sum_helper(x):  # a nested call (tl.sum is itself a jit function that sees triton.language.core)
    return tl.sum(x, axis=1)


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    x = tl.load(x_ptr + r[:, None] * C + c[None, :])
    tl.store(out_ptr + r, _row_sum_helper(x) + tl.cumsum(r, axis=0).to(tl.float32))


@interpreter_only("it checks the interpreter's nested calls")
def test_interpreter_nested_calls_skip_repatching_and_the_launch_restores_the_language():
    """Under TRITON_INTERPRET=1 the package makes a launch patch both language modules once and nested
    `@triton.jit` calls skip their own patch (`_launch._interpreter_device_calls_skip_repatching`): the same
    results, and after the launch neither module is left patched."""
    assert launch._interpreter_device_calls_skip_repatching()  # applied at import; applying again is a no-op
    before = (tl.sum, tl.load, tl.core.load, tl.core.reshape, tl.core.tensor.__add__)
    x = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    out = torch.zeros(4)
    _row_sums_kernel[(1,)](x, out, R=4, C=8)
    assert torch.equal(out, x.sum(dim=1) + torch.tensor([0.0, 1.0, 3.0, 6.0]))
    assert (tl.sum, tl.load, tl.core.load, tl.core.reshape, tl.core.tensor.__add__) == before


def test_a_fraction_of_programs_per_sm_gives_a_whole_grid_of_at_least_one(monkeypatch):
    from moe_a2a.config import A2AConfig

    layout = A2AConfig(max_num_tokens=128, num_experts=16, experts_per_token=4, hidden_dim=64).layout(2, 2)
    monkeypatch.setattr(launch, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    grids = {}
    for share in (1, 0.25, 0.001):
        monkeypatch.setattr(launch, "PROGRAMS_PER_SM", share)
        (programs,), rows = launch.persistent_grid(cuda, layout, (2, 8))
        grids[share] = programs
        assert isinstance(programs, int) and rows == 2
    assert grids == {1: min(132, -(-layout.max_recv_routes // 2)), 0.25: 33, 0.001: 1}
