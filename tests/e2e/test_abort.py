"""Bad input on one rank aborts that call on every rank, fast, and the next call works everywhere
(no rebuild), between real processes: node-local (shm, mapped memory) and across simulated nodes
(tcp and shm through the proxies). A bad index on a GPU is dropped, said once, and not fatal."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.all_to_all import AllToAll, CallAborted
from moe_a2a.bench.demo import make_inputs
from moe_a2a.oracle import check_against_reference, fill_sentinel, record_call, toy_expert
from moe_a2a.config import A2AConfig

from ..conftest import TEST_DEVICE, interpreter_only

pytestmark = [pytest.mark.slow]

CFG = A2AConfig(max_num_tokens=6, num_experts=12, experts_per_token=2, hidden_dim=32, in_dtype=torch.float8_e4m3fn,
                scale_block=16, out_dtype=torch.bfloat16)
BAD_CALL = 1


def _bad_input(kind: str, x, xs, idx):
    """The rejected input of the bad rank's call BAD_CALL (every kind a ValueError before sending)."""
    if kind == "index":
        idx = idx.clone()
        idx[0, 0] = CFG.num_experts + 3
    elif kind == "shape":
        x = x[:, :-1]
    elif kind == "dtype":
        x = x.float()
    return x, xs, idx


def _bad_combine_input(kind: str, res, w, y):
    """The rejected combine input of the bad rank's call BAD_CALL."""
    if kind == "combine_weights_dtype":
        w = w.to(torch.bfloat16)
    elif kind == "combine_weights_shape":
        w = w[:, :1]
    elif kind == "combine_weights_strided":
        w = w.t().contiguous().t()  # last stride != 1
    elif kind == "combine_out_dtype":
        res = res.float()
    elif kind == "combine_out_rows":
        res = res[:-1]
    elif kind == "combine_expert_y_rows":
        y = y[:1]
    return res, w, y


def _bad_combine_bound_m(kind: str, T: int, dev):
    """The rejected `bound_m` of the bad rank's combine (None for other kinds)."""
    if kind == "combine_bound_m_int64":
        return torch.tensor([T], dtype=torch.int64, device=dev)
    if kind == "combine_bound_m_float":
        return torch.tensor([float(T)], dtype=torch.float32, device=dev)
    if kind == "combine_bound_m_negative":
        return torch.tensor([-1], dtype=torch.int32, device=dev)
    return None


def _calls(a2a, rank: int, bad_rank: int, kind: str, n_calls: int):
    cfg, dev = a2a.cfg, a2a.device
    num, ex, exs = a2a.empty_dispatch_outputs()
    out = []
    for it in range(n_calls):
        x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, cfg.max_num_tokens, 50 + it))
        bad = it == BAD_CALL and rank == bad_rank
        bound_m = None
        if bad and kind == "bound_m":
            bound_m = torch.tensor([-1], dtype=torch.int32, device=dev)
        elif bad and not kind.startswith("combine_"):
            x, xs, idx = _bad_input(kind, x, xs, idx)
        res = torch.zeros(cfg.max_num_tokens, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
        fill_sentinel(ex, exs)
        t0 = time.monotonic()
        try:
            a2a.dispatch(num, ex, exs, x, xs, idx, bound_m=bound_m)
            y = toy_expert(ex, exs, cfg)
            c_res, c_w, c_y = _bad_combine_input(kind, res, w, y) if bad else (res, w, y)
            c_bound = _bad_combine_bound_m(kind, x.shape[0], dev) if bad else None
            a2a.combine(c_res, idx, c_w, c_y, bound_m=c_bound)
            a2a.check()
        except ValueError as exc:
            out.append({"error": "ValueError", "message": str(exc), "seconds": time.monotonic() - t0})
            continue
        except CallAborted as exc:
            out.append({"error": "CallAborted", "message": str(exc), "seconds": time.monotonic() - t0})
            continue
        out.append({"error": None, **record_call(cfg, x, xs, idx, w, num, ex, exs, res)})
    return out


def _calls_as_kernel_waiter(a2a, rank: int, bad_rank: int, kind: str, n_calls: int):
    """As a rank whose host never waits (one GPU per rank): no look at the count rows on the host, so
    only what the unpack kernel recorded (Flag.ABORTED) tells it, at the end of its combine."""
    a2a._status.aborted_sources = lambda epoch: []
    return _calls(a2a, rank, bad_rank, kind, n_calls)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,node,transport,kind,host_looks", [
    (2, 2, "shm", "index", True),   # node-local: peers synchronise through mapped memory
    (3, 1, "tcp", "shape", True),   # every peer remote: the abort travels with the count row, via the proxies
    (4, 2, "shm", "dtype", True),   # mixed: a node peer and remote peers
    (3, 1, "tcp", "shape", False),  # the peers learn it from their unpack kernel's record (GPU ranks do)
    (2, 1, "shm", "bound_m", True),  # a negative device-side token count: refused like any bad input
    # Bad combine input: the rank finishes the call void; node peers learn it from the combine_aborted
    # word its combine pack writes, remote peers from its proxy's COMBINE_ABORTED immediates.
    (2, 2, "shm", "combine_weights_dtype", True),
    (3, 1, "tcp", "combine_weights_shape", True),
    (4, 2, "shm", "combine_out_dtype", True),
    (4, 2, "tcp", "combine_out_rows", False),
    (2, 2, "shm", "combine_weights_strided", False),
    (3, 1, "shm", "combine_expert_y_rows", True),
    # combine's own bound_m: its dtype (int64, float32) and, on a CPU, its value, refused before sending.
    (2, 2, "shm", "combine_bound_m_int64", True),
    (2, 1, "tcp", "combine_bound_m_float", False),
    pytest.param(2, 2, "shm", "combine_bound_m_negative", True,
                 marks=interpreter_only("combine's bound_m value is checked on a CPU only (no host sync)")),
], ids=["node-local-index", "remote-tcp-shape", "mixed-shm-dtype", "remote-tcp-kernel-record", "remote-shm-bound-m",
        "node-local-combine-weights-dtype", "remote-tcp-combine-weights-shape", "mixed-shm-combine-out-dtype",
        "mixed-tcp-combine-out-rows-kernel-record", "node-local-combine-weights-strided-kernel-record",
        "remote-shm-combine-expert-y-rows", "node-local-combine-bound-m-int64",
        "remote-tcp-combine-bound-m-float32-kernel-record", "node-local-combine-bound-m-negative"])
def test_bad_input_on_one_rank_aborts_the_call_everywhere_and_the_next_call_works(world, node, transport, kind,
                                                                                 host_looks):
    bad_rank, n_calls = world - 1, 4
    with LocalCluster(CFG, world_size=world, node_size=node, transport=transport, device=TEST_DEVICE,
                      timeout_s=30) as cl:
        results = cl.run(_calls if host_looks else _calls_as_kernel_waiter, bad_rank, kind, n_calls)
    good = [i for i in range(n_calls) if i != BAD_CALL]
    if TEST_DEVICE == "cuda" and kind == "index":
        # A GPU checks index values on the device, without a host sync: the bad route is dropped (never
        # sent), the call goes on, and the bad rank alone is told, once, at the end of its combine.
        assert results[bad_rank][BAD_CALL]["error"] == "ValueError", results[bad_rank][BAD_CALL]
        assert "indices[0, 0]" in results[bad_rank][BAD_CALL]["message"]
        assert all(results[r][BAD_CALL]["error"] is None for r in range(world) if r != bad_rank)
        results = [[c for i, c in enumerate(calls) if i != BAD_CALL] for calls in results]
        assert all(c["error"] is None for calls in results for c in calls)
        assert check_against_reference(CFG, [{"calls": calls} for calls in results]) == []
        return
    for r, calls in enumerate(results):
        bad = calls[BAD_CALL]
        if r == bad_rank:
            assert bad["error"] == "ValueError" and "aborted this call" in bad["message"], bad
            if kind.startswith("combine_bound_m"):
                assert bad["message"].startswith("bound_m: expected"), bad
        else:
            assert bad["error"] == "CallAborted", bad
            assert f"aborted by rank {bad_rank}" in bad["message"] and "rejected" in bad["message"], bad
            # README's Errors bullet: within 2 s, on a loaded 2-core CPU machine (interpreter) as on a GPU shared
            # by the ranks of several tests at once (host waits, time-sliced: 1.05-1.13 s seen on an H100)
            print(f"rank {r} learnt of the abort in {bad['seconds']:.3f} s")
            assert bad["seconds"] < 2.0, bad
    assert all(results[r][i]["error"] is None for r in range(world) for i in good), \
        [[c.get("message") for c in calls] for calls in results]
    ok = [{"calls": [calls[i] for i in good]} for calls in results]
    assert check_against_reference(CFG, ok) == []


def _bad_receive_outputs(a2a, rank: int):
    """A wrong receive buffer after the send half: refused, the call stays open, a corrected receive
    completes it."""
    cfg, dev = a2a.cfg, a2a.device
    num, ex, exs = a2a.empty_dispatch_outputs()
    x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, cfg.max_num_tokens, 7))
    fill_sentinel(ex, exs)
    a2a.dispatch(num, ex, exs, x, xs, idx, do_recv=False)
    refused = None
    try:
        a2a.dispatch(num, ex[:1], exs, x, xs, idx, do_send=False)
    except ValueError as exc:
        refused = str(exc)
    a2a.dispatch(num, ex, exs, x, xs, idx, do_send=False)
    res = torch.zeros(cfg.max_num_tokens, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
    a2a.combine(res, idx, w, toy_expert(ex, exs, cfg))
    return refused, record_call(cfg, x, xs, idx, w, num, ex, exs, res)


@pytest.mark.timeout(300)
def test_bad_receive_outputs_are_refused_and_a_corrected_receive_completes_the_call():
    with LocalCluster(CFG, world_size=2, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=30) as cl:
        results = cl.run(_bad_receive_outputs)
    assert all(refused is not None and refused.startswith("out_expert_x:") for refused, _ in results), results
    assert check_against_reference(CFG, [{"calls": [call]} for _, call in results]) == []


def _abort_then_a_call_of_another_instance(a2a, rank: int):
    """Rank 1's first call of instance A is refused. Rank 0, as a rank whose host never waits (one GPU per
    rank), issues A's dispatch, then a whole call of instance B, then A's combine, where it learns of the
    abort (DeepEP's two calls in flight). Rank 1 must reach B's call without waiting for A's combine, which
    rank 0 issues after it; then a good call of A on both."""
    cfg, dev = a2a.cfg, a2a.device
    a, out, seconds = a2a, [], None
    if rank == 0:
        a._status.aborted_sources = lambda epoch: []
    with AllToAll(cfg, node_group=a.layout.node_size, transport=a.transport, device=dev, timeout_s=a.timeout_s) as b:

        def call(inst, seed, bad=False, combine_late=None):
            num, ex, exs = inst.empty_dispatch_outputs()
            fill_sentinel(ex, exs)
            x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, cfg.max_num_tokens, seed))
            res = torch.zeros(cfg.max_num_tokens, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
            inst.dispatch(num, ex, exs, x[:, :-1] if bad else x, xs, idx)
            if combine_late is not None:
                combine_late()
            inst.combine(res, idx, w, toy_expert(ex, exs, cfg))
            inst.check()
            return record_call(cfg, x, xs, idx, w, num, ex, exs, res)

        t0 = time.monotonic()
        try:
            call(a, 60, bad=rank == 1, combine_late=(lambda: out.append(call(b, 61))) if rank == 0 else None)
        except (ValueError, CallAborted) as exc:
            seconds, error = time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
        if rank == 1:
            out.append(call(b, 61))
        out.append(call(a, 62))
    return error, seconds, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,node,transport", [(2, 2, "shm"), (2, 1, "tcp")], ids=["node-local", "remote-tcp"])
def test_an_aborting_rank_does_not_wait_for_the_aborted_calls_combine_before_its_next_call(world, node, transport):
    with LocalCluster(CFG, world_size=world, node_size=node, transport=transport, device=TEST_DEVICE,
                      timeout_s=20) as cl:
        results = cl.run(_abort_then_a_call_of_another_instance)
    (error0, _, calls0), (error1, seconds1, calls1) = results
    assert error1.startswith("ValueError: x: expected") and "aborted this call" in error1, error1
    assert error0.startswith("CallAborted") and "aborted by rank 1" in error0, error0
    assert seconds1 < 5.0, seconds1  # it did not wait for rank 0's combine of that call (issued after B's call)
    assert check_against_reference(CFG, [{"calls": calls0}, {"calls": calls1}]) == []


CAP_CFG = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=32, in_dtype=torch.bfloat16,
                    expert_capacity=6)
CAP_CALL = 1


def _capacity_calls(a2a, rank: int, n_calls: int):
    """Call CAP_CALL routes every token of every rank to expert 0 (rank 0's): more rows than its capacity."""
    cfg, dev = a2a.cfg, a2a.device
    num, ex, exs = a2a.empty_dispatch_outputs()
    out = []
    for it in range(n_calls):
        x, xs, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, cfg.max_num_tokens, 80 + it))
        if it == CAP_CALL:
            idx = torch.zeros_like(idx)  # 2 routes per token, 4 tokens, every rank: 8 * W rows > 6
        else:
            t = torch.arange(idx.shape[0], device=dev)[:, None]
            k = torch.arange(idx.shape[1], device=dev)[None, :]
            idx = ((t + 4 * k + rank) % cfg.num_experts).to(idx.dtype)  # every expert: one row per rank
        res = torch.zeros(cfg.max_num_tokens, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
        fill_sentinel(ex)
        t0 = time.monotonic()
        try:
            a2a.dispatch(num, ex, None, x, None, idx)
            a2a.combine(res, idx, w, toy_expert(ex, None, cfg))
            a2a.check()
        except (RuntimeError, CallAborted) as exc:
            out.append({"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0})
            continue
        out.append({"error": None, **record_call(cfg, x, None, idx, w, num, ex, None, res)})
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,node,transport", [(2, 2, "shm"), (2, 1, "tcp"), (4, 2, "shm")],
                         ids=["node-local", "remote-tcp", "mixed-shm"])
def test_capacity_overflow_aborts_the_call_everywhere_and_the_next_call_works(world, node, transport):
    n_calls = 3
    with LocalCluster(CAP_CFG, world_size=world, node_size=node, transport=transport, device=TEST_DEVICE,
                      timeout_s=30) as cl:
        results = cl.run(_capacity_calls, n_calls)
    over = results[0][CAP_CALL]
    assert over["error"] == "CapacityExceeded" and "local expert 0 (expert 0)" in over["message"], over
    assert "aborted on every rank" in over["message"], over
    for r in range(1, world):
        bad = results[r][CAP_CALL]
        assert bad["error"] == "CallAborted" and "aborted by rank 0" in bad["message"], bad
        assert bad["seconds"] < 2.0, bad
    good = [i for i in range(n_calls) if i != CAP_CALL]
    assert all(results[r][i]["error"] is None for r in range(world) for i in good), \
        [[c.get("message") for c in calls] for calls in results]
    assert check_against_reference(CAP_CFG, [{"calls": [calls[i] for i in good]} for calls in results]) == []


SEQ_CFG = dataclasses.replace(CAP_CFG, expert_capacity=8)
# good, bad combine weights on rank 1, good, good, every route to expert 0 (rank 0 over capacity), good, good
SEQUENCE = ("good", "weights", "good", "good", "overflow", "good", "good")


def _sequence_without_check(a2a, rank: int):
    """SEQUENCE with no `check()` (which waits for the device) between calls: what a call's kernels recorded
    must be said by that call's own `combine`, never by a later one (issue 42: on a GPU the next good call
    raised the earlier abort on one rank)."""
    cfg, dev = a2a.cfg, a2a.device
    num, ex, _ = a2a.empty_dispatch_outputs()
    out = []
    for it, kind in enumerate(SEQUENCE):
        x, _, idx, w = (t if t is None else t.to(dev) for t in make_inputs(cfg, rank, cfg.max_num_tokens, 90 + it))
        if kind == "overflow":
            idx = torch.zeros_like(idx)  # 2 routes per token, 4 tokens, every rank: 8 * W rows > 8
        else:
            t = torch.arange(idx.shape[0], device=dev)[:, None]
            k = torch.arange(idx.shape[1], device=dev)[None, :]
            idx = ((t + 4 * k + rank + it) % cfg.num_experts).to(idx.dtype)
        res = torch.zeros(cfg.max_num_tokens, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
        fill_sentinel(ex)
        try:
            a2a.dispatch(num, ex, None, x, None, idx)
            a2a.combine(res, idx, w.to(torch.bfloat16) if kind == "weights" and rank == 1 else w, toy_expert(ex, None, cfg))
        except (ValueError, RuntimeError) as exc:
            out.append({"error": type(exc).__name__, "message": str(exc)})
            continue
        out.append({"error": None, **record_call(cfg, x, None, idx, w, num, ex, None, res)})
    a2a.check()  # nothing left over either
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,node,transport", [(2, 2, "shm"), (2, 1, "tcp")], ids=["node-local", "remote-tcp"])
def test_an_abort_never_reaches_a_later_call(world, node, transport):
    """good -> bad -> good -> good, for an abort at the combine (bad weights) and an expert over capacity, on
    every device and wait mode (on one GPU: host waits alone, kernel waits under MPS; `run.sh gpu-tests`)."""
    with LocalCluster(SEQ_CFG, world_size=world, node_size=node, transport=transport, device=TEST_DEVICE,
                      timeout_s=30) as cl:
        results = cl.run(_sequence_without_check)
    said = [[c["error"] and f"{c['error']}: {c['message'][:80]}" for c in calls] for calls in results]
    for it, kind in enumerate(SEQUENCE):
        if kind == "weights":
            assert results[1][it]["error"] == "ValueError" and "aborted this call" in results[1][it]["message"], said
            assert results[0][it]["error"] == "CallAborted" and "aborted by rank 1" in results[0][it]["message"], said
        elif kind == "overflow":
            assert results[0][it]["error"] == "CapacityExceeded", said
            assert results[1][it]["error"] == "CallAborted" and "aborted by rank 0" in results[1][it]["message"], said
        else:
            assert all(calls[it]["error"] is None for calls in results), said
    good = [i for i, kind in enumerate(SEQUENCE) if kind == "good"]
    assert check_against_reference(SEQ_CFG, [{"calls": [calls[i] for i in good]} for calls in results]) == []
