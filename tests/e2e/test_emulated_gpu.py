"""The emulated NIC's CUDA carrier (transport="emulated" on a GPU): GPU buffers shared as cuMem POSIX FDs
("nic" placement), copied by each proxy's stream, immediates written by the stream after the copy.

Written to run with one GPU (2 ranks on 2 simulated nodes share it: host waits) and with one GPU per
rank (kernel waits). Run on the GPU machine with compiled kernels:

    MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/e2e/test_emulated_gpu.py
"""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.gpu(reason="the emulated NIC's CUDA carrier")]

IMM = 0x5A000000


def _cuda_pair(comm, nbytes: int, nic: str):
    """Engine level, two processes: each writes the other's GPU recv buffer (with a host header, a
    zero-length write and a large write) and the other's host buffer from GPU memory; checks what landed."""
    import ctypes

    import numpy as np
    from cuda.bindings import driver as cu

    from moe_a2a.proxy.emulated import emulated_engine as EmulatedEngine
    from moe_a2a.proxy.nic_settings import parse_nic_settings
    from moe_a2a.proxy.engine import ACCESS_SOURCE, ACCESS_SOURCE_AND_TARGET, ACCESS_TARGET
    from moe_a2a.protocol.memory import CuMemBuffer, MemfdBuffer, cuda_primary_context

    cuda_primary_context(0)
    ngpu = cu.cuDeviceGetCount()[1]
    me, peer = comm.rank, 1 - comm.rank
    ordinal = me % ngpu
    eng = EmulatedEngine(cuda_device=ordinal, nic=parse_nic_settings(nic), max_senders=4, timeout_s=20,
                         idle_yield=True)
    send, recv = CuMemBuffer(nbytes, ordinal), CuMemBuffer(nbytes, ordinal)
    pattern = ((np.arange(nbytes, dtype=np.int64) * (3 + me)) % 251).astype(np.uint8)
    assert cu.cuMemcpyHtoD(send.addr, pattern.ctypes.data, nbytes)[0] == cu.CUresult.CUDA_SUCCESS
    host = MemfdBuffer(1 << 16)
    rs = eng.register(send.addr, send.size, ACCESS_SOURCE, cuda_device=ordinal)
    rr = eng.register(recv.addr, recv.size, ACCESS_TARGET, cuda_device=ordinal)
    rh = eng.register(host.addr, host.size, ACCESS_SOURCE_AND_TARGET)
    table = comm.allgather((eng.address, rr.descriptor(), rh.descriptor()))
    [p] = eng.connect([table[peer][0]])
    data, to_host = eng.peer_group([p], [table[peer][1]]), eng.peer_group([p], [table[peer][2]])
    big = nbytes // 2
    imm = [IMM | (me << 8) | k for k in range(5)]
    eng.post(data, rs, [(0, 0, 1000, 64, imm[0]), (0, 0, 0, 8192, imm[1]), (0, 4096, big, big - 4096, imm[2])])
    eng.scatter(to_host, rs, [(0, 10, 100, 0)], imm[3])  # GPU memory -> the peer's host memory
    eng.barrier(data, imm[4])
    theirs = [IMM | (peer << 8) | k for k in range(5)]
    eng.wait_imms({i: 1 for i in theirs}, 20, "cuda pair")
    eng.wait_writes(20)
    assert eng.writes_pending == 0 and eng.imm_counts() == {}
    got = np.empty(nbytes, np.uint8)
    recv.read_into(0, got)
    want = ((np.arange(nbytes, dtype=np.int64) * (3 + peer)) % 251).astype(np.uint8)
    errors = []
    # Each write's bytes at its dst_offset, one range; the zero-length one writes nothing.
    if not (got[64:1064] == want[:1000]).all() or got[:64].any() or got[1064:big - 4096].any():
        errors.append("first write")
    if not (got[big - 4096: 2 * big - 4096] == want[4096: 4096 + big]).all():
        errors.append("large write")
    if ctypes.string_at(host.addr, 100) != want[10:110].tobytes():
        errors.append("GPU -> host write")
    # Host cost of a post on this carrier: zero-length writes (the immediate's stream writes and one event).
    n, t0 = 200, time.perf_counter()
    eng.post(data, rs, [(0, 0, 0, 0, IMM | 0xFF)] * n)
    per_write_us = (time.perf_counter() - t0) / n * 1e6
    comm.allgather("posted")
    eng.wait_imms({IMM | 0xFF: n}, 20, "zero-length burst")
    eng.wait_writes(20)
    comm.allgather("done")  # neither closes while the other may still write
    eng.close()
    for b in (send, recv, host):
        b.close()
    return errors, per_write_us


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nic", ["0", "20us,10GBps"])
def test_cuda_carrier_moves_bytes_and_immediates_between_processes(nic):
    from ..proxy._peers import run_peers

    results = run_peers(2, _cuda_pair, 4 << 20, nic, timeout_s=120)
    for errors, per_write_us in results:
        assert errors == [], results
    print(f"CUDA carrier, NIC {nic}: host time per zero-length write {[round(r[1], 2) for r in results]} µs")


def _cfg(in_dtype, private):
    from moe_a2a.config import A2AConfig

    kw = {"scale_block": 64} if in_dtype == torch.float8_e4m3fn else {}
    return A2AConfig(max_num_tokens=8, num_experts=8, experts_per_token=3, hidden_dim=256, in_dtype=in_dtype,
                     out_dtype=torch.bfloat16, max_private_tokens=private, **kw)


def _placement(a2a, rank):
    return a2a.placement, a2a.placement_reason, a2a.host_waits


@pytest.mark.timeout(600)
@pytest.mark.parametrize("in_dtype,private", [(torch.bfloat16, None), (torch.float8_e4m3fn, 1)],
                         ids=["bf16-private", "fp8-remainder"])
def test_emulated_nic_on_gpu_matches_reference(in_dtype, private):
    """2 ranks on 2 simulated nodes: GPU buffers ("nic" placement), every remote row through the proxies'
    streams; exact against the reference, with one write per peer (private region large enough) and
    several (private=1: the remainder path), random and skewed routing."""
    from moe_a2a import LocalCluster
    from moe_a2a.bench.demo import rank_roundtrip
    from moe_a2a.oracle import check_against_reference

    from .test_writes import _count_writes

    cfg = _cfg(in_dtype, private)
    with LocalCluster(cfg, world_size=2, node_size=1, transport="emulated", device="cuda", timeout_s=60) as cl:
        placements = cl.run(_placement)
        assert {p[:2] for p in placements} == {("nic", None)}, placements
        assert check_against_reference(cfg, cl.run(rank_roundtrip, cfg.max_num_tokens, 1, 3, "random")) == []
        assert check_against_reference(cfg, cl.run(rank_roundtrip, cfg.max_num_tokens, 2, 1, "skew")) == []
        counted = cl.run(_count_writes, 2)
    for rank, got in enumerate(counted):
        remote, P = got["remote"], got["private_rows"]
        overflow = sum(routes[d] > P for routes in got["routes"] for d in remote)
        assert got["dispatch"] == 2 * len(remote) + overflow and got["combine"] == 2 * len(remote), (rank, got)
        if private == 1:
            assert overflow, got  # several writes per peer did happen


@pytest.mark.timeout(600)
def test_kernel_waits_over_the_emulated_nic_match_the_reference():
    """gpu_wait="kernel": the kernels wait for the proxies' flags themselves, as ranks with a GPU each do
    by default (on one shared GPU they are time-sliced: slower, still exact)."""
    from moe_a2a import LocalCluster
    from moe_a2a.bench.demo import rank_roundtrip
    from moe_a2a.oracle import check_against_reference

    cfg = _cfg(torch.bfloat16, 1)
    with LocalCluster(cfg, world_size=2, node_size=1, transport="emulated", device="cuda", timeout_s=60,
                      gpu_wait="kernel") as cl:
        assert {p[2] for p in cl.run(_placement)} == {False}  # no host waits
        assert check_against_reference(cfg, cl.run(rank_roundtrip, cfg.max_num_tokens, 1, 3, "random")) == []


@pytest.mark.timeout(600)
def test_emulated_nic_settings_on_gpu_are_honoured_and_results_still_match(monkeypatch):
    """MOE_A2A_EMULATED_NIC=2ms: every call waits for at least the one-way latency of its writes."""
    from moe_a2a import LocalCluster
    from moe_a2a.bench.demo import rank_roundtrip
    from moe_a2a.oracle import check_against_reference

    monkeypatch.setenv("MOE_A2A_EMULATED_NIC", "2ms,25GBps")
    cfg = _cfg(torch.bfloat16, None)
    with LocalCluster(cfg, world_size=2, node_size=1, transport="emulated", device="cuda", timeout_s=60) as cl:
        res = cl.run(rank_roundtrip, cfg.max_num_tokens, 5, 3, "random")
    assert check_against_reference(cfg, res) == []
    for r in res:
        # A call waits for the peer's dispatch write (2 ms after this rank's send), then for its combine
        # write (posted once it had ours, 2 ms more): >= 4 ms, less the toy expert between the halves.
        calls = [sum(phase) for phase in zip(*r["times"].values())]
        assert min(calls) >= 3000, r["times"]


@pytest.mark.timeout(600)
def test_bad_input_on_one_rank_aborts_the_call_over_the_emulated_nic():
    from moe_a2a import LocalCluster
    from moe_a2a.oracle import check_against_reference

    from .test_abort import BAD_CALL, CFG, _calls

    world, bad_rank, n_calls = 2, 1, 3
    for kind in ("shape", "combine_weights_dtype"):
        with LocalCluster(CFG, world_size=world, node_size=1, transport="emulated", device="cuda",
                          timeout_s=30) as cl:
            results = cl.run(_calls, bad_rank, kind, n_calls)
        for r, calls in enumerate(results):
            bad = calls[BAD_CALL]
            if r == bad_rank:
                assert bad["error"] == "ValueError" and "aborted this call" in bad["message"], (kind, bad)
            else:
                assert bad["error"] == "CallAborted" and f"aborted by rank {bad_rank}" in bad["message"], (kind, bad)
        good = [i for i in range(n_calls) if i != BAD_CALL]
        assert all(results[r][i]["error"] is None for r in range(world) for i in good), (kind, results)
        assert check_against_reference(CFG, [{"calls": [c[i] for i in good]} for c in results]) == []


@pytest.mark.timeout(300)
def test_a_dead_proxy_over_the_emulated_nic_is_named():
    """Its rank says its proxy died; the peer times out naming it (writes into a dead proxy's buffers
    land in memory the living still map, so only the missing immediates tell)."""
    from moe_a2a import LocalCluster

    from .test_all_to_all import _kill_own_proxy_then_call

    timeout_s = 6.0
    cfg = _cfg(torch.bfloat16, None)
    with LocalCluster(cfg, world_size=2, node_size=1, transport="emulated", device="cuda", timeout_s=timeout_s) as cl:
        (_, t0, err0), (_, t1, err1) = cl.run(_kill_own_proxy_then_call, 0)
    assert err0 is not None and "proxy process exited" in err0, err0
    assert err1 is not None and "missing peers [0]" in err1 and t1 < timeout_s + 5, (t1, err1)
