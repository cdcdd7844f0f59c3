"""Shrink mode of `moe_a2a.compat.Buffer` (DeepEP's `enable_shrink`), between real processes: ranks that
stop calling (at their dispatch, their combine, their clean, as DeepEP's own shrink test has them) or are
killed outright are masked by every survivor, and the later calls complete among the survivors with the
stopped ranks' tokens dropped, checked against torch."""
from __future__ import annotations

import os
import time

import pytest
import torch

from moe_a2a.oracle import combine_problems, default_max_ulps

from ..conftest import TEST_DEVICE
from ..proxy._peers import Died, run_peers

pytestmark = [pytest.mark.slow]

T, E, K, H = 4, 12, 4, 64
APIS = ("dispatch", "combine", "clean")


def _inputs(rank: int, call: int):
    g = torch.Generator().manual_seed(1000 * call + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g, dtype=torch.float32)
    return x, idx, w


def _shrink_rank(comm, store: str, node_size: int, stops: dict, calls: int, timeout_s: float, transport: str,
                 device: str = TEST_DEVICE):
    """One rank: `calls` rounds of dispatch, identity expert, combine, clean; stops (returns, or with
    ("kill", api) SIGKILLs itself) at `stops[rank] = (call, api)`. Returns what it saw per call.
    On a GPU every rank shares it (shrink mode waits on the host)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from moe_a2a.compat import Buffer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=comm.rank, world_size=comm.size)
    rank, W = comm.rank, comm.size
    buf = Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, W, E), enable_shrink=True,
                 explicitly_destroy=True, transport=transport, node_group=node_size, timeout_s=timeout_s,
                 device=device)
    status = torch.zeros(W, dtype=torch.int32)
    stop, seen = stops.get(rank), []

    def stopping(call, api) -> bool:
        if stop is None or stop[:2] != (call, api):
            return False
        if len(stop) > 2:  # killed outright: no close, no goodbye (its proxy follows its parent)
            comm.die()
        return True

    def mask() -> list[int]:
        buf.low_latency_query_mask_buffer(status)
        return status.nonzero().flatten().tolist()

    for call in range(calls):
        x, idx, w = (t.to(device) for t in _inputs(rank, call))
        got = {}
        if stopping(call, "dispatch"):
            break
        t0 = time.monotonic()
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        # Plain lists: tensors would travel back through shared memory that dies with the process.
        got.update(dispatch_s=time.monotonic() - t0, count=count.tolist(), layout=handle[1].tolist(),
                   mask_dispatch=mask())
        y = recv_x.clone()  # the identity expert
        if stopping(call, "combine"):
            break
        t0 = time.monotonic()
        combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
        got.update(combine_s=time.monotonic() - t0, combined=combined.float().tolist(), mask_combine=mask())
        if stopping(call, "clean"):
            break
        t0 = time.monotonic()
        buf.clean_low_latency_buffer(T, H, E)
        got.update(clean_s=time.monotonic() - t0, mask_clean=mask())
        seen.append(got)
    buf.destroy()
    return seen


def _before(stop, call: int, api: str) -> bool:
    """The rank with `stop` no longer takes part in (call, api)."""
    return stop is not None and (stop[0], APIS.index(stop[1])) <= (call, APIS.index(api))


def _check(got: list, W: int, stops: dict, calls: int) -> None:
    L = E // W
    survivors = [r for r in range(W) if r not in stops]
    for r in survivors:
        assert len(got[r]) == calls, (r, len(got[r]))
        for call in range(calls):
            g = got[r][call]
            for api in APIS:
                expected = sorted(q for q in range(W) if _before(stops.get(q), call, api))
                assert g[f"mask_{api}"] == expected, (r, call, api, g[f"mask_{api}"], expected)
            ins = [_inputs(s, call) for s in range(W)]
            senders = [s for s in range(W) if not _before(stops.get(s), call, "dispatch")]
            for l in range(L):
                e = r * L + l
                per_source = [int((ins[s][1] == e).sum()) if s in senders else 0 for s in range(W)]
                assert int(g["count"][l]) == sum(per_source), (r, call, l)
                begin = 0
                for s in range(W):  # DeepEP's layout range: (begin << 32) | count per source
                    assert int(g["layout"][l][s]) == (begin << 32) | per_source[s], (r, call, l, s)
                    begin += per_source[s]
            x, idx, w = ins[r]
            owners_back = [o for o in range(W) if not _before(stops.get(o), call, "combine")]
            keep = (idx >= 0) & torch.isin(torch.where(idx >= 0, idx // L, 0), torch.tensor(owners_back))
            acc = torch.zeros(x.shape, dtype=torch.float32)  # the reference's sum: fp32, k order, one cast
            for k in range(idx.shape[1]):
                acc += torch.where(keep[:, k], w[:, k], 0.0)[:, None] * x.float()  # a dropped route adds 0
            got_bf16 = torch.tensor(g["combined"]).to(torch.bfloat16)  # exact: it was bf16
            assert combine_problems(got_bf16, acc.to(torch.bfloat16), default_max_ulps(TEST_DEVICE)) == [], (r, call)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("node_size", [6, 3], ids=["node-local", "remote"])
def test_ranks_that_stop_at_dispatch_combine_and_clean_are_masked_and_the_rest_goes_on(tmp_path, node_size):
    """DeepEP's shrink test's pattern, on one node and across two simulated nodes: rank 1 stops at its
    first dispatch, rank 3 at its first combine, rank 5 at its first clean (each closes its Buffer, so
    posts to it fail); each survivor's mask grows exactly at those points, and every call after them is
    right among the survivors (routes to masked experts dropped, tokens of masked sources not received)."""
    W, calls, timeout_s = 6, 2, 6.0
    stops = {1: (0, "dispatch"), 3: (0, "combine"), 5: (0, "clean")}
    got = run_peers(W, _shrink_rank, str(tmp_path / "store"), node_size, stops, calls, timeout_s, "shm",
                    timeout_s=500)
    _check(got, W, stops, calls)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("node_size", [2], ids=["remote"])
def test_a_rank_killed_outright_is_masked_within_twice_the_timeout_and_later_calls_complete(tmp_path, node_size):
    """SIGKILL between two calls, across simulated nodes (its proxy goes with it; its node peer learns it
    from its own waits, the other node's ranks from their proxies): the survivors' next call masks it within
    2 x timeout_s and completes; the calls after it take no timeout at all. (A rank that stops on one node:
    the test above.)"""
    W, calls, timeout_s = 4, 3, 6.0
    stops = {2: (1, "dispatch", "kill")}
    got = run_peers(W, _shrink_rank, str(tmp_path / "store"), node_size, stops, calls, timeout_s, "shm",
                    timeout_s=500)
    assert isinstance(got[2], Died), got[2]
    _check(got, W, stops, calls)
    for r in (0, 1, 3):
        first = got[r][1]
        assert first["dispatch_s"] + first["combine_s"] + first["clean_s"] < 2 * timeout_s, first
        later = got[r][2]
        # No wait timed out: one that did would take timeout_s alone (the three halves take 2.5-3.2 s on a
        # loaded 2-core machine, so half of timeout_s was too tight a bound).
        assert later["dispatch_s"] + later["combine_s"] + later["clean_s"] < timeout_s, later


def _refusals_rank(comm, store: str):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from moe_a2a.compat import Buffer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=comm.rank, world_size=comm.size)
    seen = []
    for make in (lambda: Buffer(None, num_rdma_bytes=12345, enable_shrink=True, device="cpu"),  # not a hint's bytes
                 lambda: Buffer(None).low_latency_query_mask_buffer(torch.zeros(1, dtype=torch.int32))):
        try:
            make()
            seen.append(None)
        except ValueError as exc:
            seen.append(str(exc))
    buf = Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, 1, E), enable_shrink=True,
                 transport="shm", timeout_s=5.0, device="cpu")
    status = torch.ones(1, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    seen.append(status.tolist())
    for bad in (lambda: buf.low_latency_update_mask_buffer(0, True), lambda: buf.low_latency_update_mask_buffer(7, True),
                lambda: buf.low_latency_query_mask_buffer(torch.zeros(2, dtype=torch.int32))):
        try:
            bad()
            seen.append(None)
        except ValueError as exc:
            seen.append(str(exc))
    buf.destroy()
    return seen


@pytest.mark.timeout(120)
def test_shrink_mode_refuses_unknown_sizes_masking_itself_and_bad_mask_tensors(tmp_path):
    got = run_peers(1, _refusals_rank, str(tmp_path / "store"), timeout_s=100)[0]
    assert "get_low_latency_rdma_size_hint" in got[0], got[0]
    assert "enable_shrink=True" in got[1], got[1]
    assert got[2] == [0]
    assert "this rank" in got[3] and "[0, 1)" in got[4] and "mask_status" in got[5], got[3:]
