"""The emulated NIC (`transport="emulated"`, proxy/emulated.py) on CPU: its host carrier between real
processes, the NIC-settings parser and what the settings do, and end to end through LocalCluster against
the reference. Its CUDA carrier is tests/test_emulated_gpu.py."""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import pytest

from moe_a2a.proxy.emulated import emulated_engine
from moe_a2a.proxy.nic_settings import NIC_ENV, NicSettings, nic_settings_from_env, parse_nic_settings
from moe_a2a.proxy.engine import ACCESS_SOURCE, ACCESS_SOURCE_AND_TARGET, ACCESS_TARGET
from moe_a2a.protocol.memory import MemfdBuffer, process_shm_files

from . import _emulated_workers as w
from ._peers import Died, run_peers

from ..conftest import TEST_DEVICE


# ---- NIC settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,latency,bandwidth", [
    (None, 0.0, None), ("", 0.0, None), ("0", 0.0, None), ("off", 0.0, None),
    ("12us,25GBps", 12e-6, 25e9), ("25GB/s, 12 us", 12e-6, 25e9), ("1.5ms", 1.5e-3, None),
    ("100Gbps", 0.0, 12.5e9), ("500ns,800MBps", 500e-9, 800e6), ("2e-3s", 2e-3, None),
])
def test_nic_settings_are_parsed(text, latency, bandwidth):
    nic = parse_nic_settings(text)
    assert nic.latency_s == pytest.approx(latency)
    assert nic.bandwidth_Bps == (None if bandwidth is None else pytest.approx(bandwidth))
    assert parse_nic_settings(str(nic)) == nic  # the canonical text reads back
    assert nic.full_speed == (latency == 0 and bandwidth is None)


@pytest.mark.parametrize("text", ["fast", "12", "12 parsecs", "12us,13us", "0GBps", "0.1Bps", "1GBps,2GBps",
                                  "12us;25GBps"])
def test_bad_nic_settings_are_refused_naming_the_variable(text):
    with pytest.raises(ValueError, match=NIC_ENV):
        parse_nic_settings(text)
    with pytest.raises(ValueError, match=NIC_ENV):
        nic_settings_from_env({NIC_ENV: text})


def test_nic_settings_are_read_when_the_all_to_all_is_built_and_refused_before_anything_starts(monkeypatch):
    import torch

    from moe_a2a import AllToAll
    from moe_a2a.config import A2AConfig

    assert nic_settings_from_env({}) == NicSettings()
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8, in_dtype=torch.float32)
    monkeypatch.setenv(NIC_ENV, "12 furlongs")
    with pytest.raises(ValueError, match=NIC_ENV):
        AllToAll(cfg, transport="emulated")  # no process group needed: refused first


# ---- the engine, in one process -----------------------------------------------------------------
@pytest.fixture
def pair_in_process():
    """Two engines of this process, a connected to b: a's memfd source, b's memfd target."""
    a, b = emulated_engine(max_senders=4, timeout_s=5), emulated_engine(max_senders=4, timeout_s=5)
    src, dst = MemfdBuffer(1 << 20), MemfdBuffer(1 << 20)
    ctypes.memmove(src.addr, bytes(range(256)) * 4096, 1 << 20)
    rs, rd = a.register(src.addr, src.size, ACCESS_SOURCE), b.register(dst.addr, dst.size, ACCESS_TARGET)
    [pb] = a.connect([b.address])
    grp = a.peer_group([pb], [rd.descriptor()])
    yield a, b, rs, grp, dst
    for x in (a, b, src, dst):
        x.close()


def test_out_of_region_writes_are_refused_before_anything_is_posted(pair_in_process):
    a, b, rs, grp, dst = pair_in_process
    n = rs.nbytes
    bad = [[(0, n - 10, 11, 0, 1)], [(0, 0, 10, dst.size - 9, 1)], [(1, 0, 1, 0, 1)], [(0, -1, 1, 0, 1)],
           [(0, 0, 0, 0, 1 << 32)], [(0, 0, 1, 0)]]
    for writes in [[(0, 0, 4, 0, 1)] + bw for bw in bad]:  # a good write first: nothing of the call is posted
        with pytest.raises(ValueError):
            a.post(grp, rs, writes)
    with pytest.raises(ValueError, match="destination range"):
        a.post(grp, rs, [(0, 0, 21, dst.size - 20, 1)])
    with pytest.raises(ValueError, match=r"\[n, 5\]"):
        a.post(grp, rs, np.zeros((1, 4), np.int64))
    with pytest.raises(ValueError, match="2 imms for 1 targets"):
        a.scatter(grp, rs, [(0, 0, 1, 0)], [1, 2])
    time.sleep(0.01)
    assert a.writes_posted == 0 and b.progress() == 0 and b.imm_counts() == {}
    assert not any(ctypes.string_at(dst.addr, 64))


def test_post_table_and_arrays_post_what_the_rows_say(pair_in_process):
    a, b, rs, grp, dst = pair_in_process
    # write-table rows (src, length, dst, imm) as int64 words; the second is empty (skipped), the third's
    # imm is replaced by the call's
    words = np.array([100, 10, 0, 5, 0, 0, 64, 6, 200, 4, 128, 7], np.int64)
    assert a.post_table(grp, rs, memoryview(words), [(0, 0), (0, 4), (0, 8)], src_base=1, dst_base=2,
                        skip_empty=True) == 2
    a.post(grp, rs, np.array([[0, 0, 0, 0, 9]]))
    b.wait_imms({5: 1, 7: 1, 9: 1}, 5, "table")
    assert ctypes.string_at(dst.addr + 2, 10) == bytes(range(101, 111))
    assert ctypes.string_at(dst.addr + 130, 4) == bytes(range(201, 205))
    assert a.post_table(grp, rs, memoryview(words), [(0, 4)], imm=11) == 1  # length 0: the imm only
    b.wait_imms({11: 1}, 5, "imm only")
    assert b.imm_counts() == {} and b.imms_received == 4


def test_target_regions_must_be_shareable_files_and_engines_leave_nothing_in_dev_shm():
    anon = ctypes.create_string_buffer(4096)
    with emulated_engine(max_senders=2) as eng:
        eng.register(ctypes.addressof(anon), 4096, ACCESS_SOURCE)  # a source needs no file
        with pytest.raises(ValueError, match="not a shared file mapping"):
            eng.register(ctypes.addressof(anon), 4096, ACCESS_TARGET)
        with pytest.raises(ValueError, match="without FI_REMOTE_WRITE"):
            eng.register(ctypes.addressof(anon), 4096, ACCESS_SOURCE).descriptor()
        with pytest.raises(ValueError, match="CUDA carrier"):
            eng.register(ctypes.addressof(anon), 4096, ACCESS_SOURCE, cuda_device=0)
        assert process_shm_files(os.getpid()) == []  # the inbox is a memfd: nothing to remove if killed


# The latency (LAT) is long beside a loaded 2-core machine's scheduling delays (tens of ms): the bounds
# below leave LAT of room for them, and none is looser than what it refutes.
LAT = 0.25


@pytest.mark.timeout(60)
def test_latency_is_honoured_and_latencies_of_writes_overlap(pair_in_process):
    a, b, rs, grp, dst = pair_in_process
    c = emulated_engine(nic=parse_nic_settings(f"{LAT * 1e3:g}ms"), timeout_s=5)
    try:
        [pb] = c.connect([b.address])
        g = c.peer_group([pb], grp.regions)
        src = c.register(rs.addr, rs.nbytes, ACCESS_SOURCE)
        t0 = time.monotonic()
        c.post(g, src, [(0, 0, 1000, 0, 21), (0, 0, 1000, 0, 22)])
        assert c.writes_pending == 2
        time.sleep(0.01)
        b.progress()
        early = time.monotonic() - t0
        assert early >= LAT or b.imm_counts() == {}  # the bytes are there, the immediates not yet countable
        b.wait_imms({21: 1, 22: 1}, 5, "latency")
        arrived = time.monotonic() - t0
        c.wait_writes(5)
        # Both after LAT (never sooner: a lower bound does not flake), and not one after the other: in series
        # the second would arrive at 2 LAT or later, so anything below refutes it, whatever the load.
        assert LAT <= arrived < 2 * LAT, arrived
        assert c.writes_pending == 0 and time.monotonic() - t0 >= LAT
    finally:
        c.close()


@pytest.mark.timeout(60)
def test_bandwidth_cap_serialises_the_writes_of_one_nic(pair_in_process):
    a, b, rs, grp, dst = pair_in_process
    c = emulated_engine(nic=parse_nic_settings("10MBps"), timeout_s=5)  # 1 MiB: 105 ms each
    try:
        [pb] = c.connect([b.address])
        g = c.peer_group([pb], grp.regions)
        src = c.register(rs.addr, rs.nbytes, ACCESS_SOURCE)
        t0 = time.monotonic()
        c.post(g, src, [(0, 0, 1 << 20, 0, 31)])
        c.post(g, src, [(0, 0, 1 << 20, 0, 32)])
        b.wait_imms({31: 1}, 5, "first")
        first = time.monotonic() - t0
        b.wait_imms({32: 1}, 5, "second")
        second = time.monotonic() - t0
        assert first >= 0.104 and second >= 0.209, (first, second)  # one NIC: the second waits for the first
        # A write that occupies the NIC for 105 ms is still in flight 5 ms after its post (100 ms of room for
        # the scheduler between the post and the wait's deadline).
        with pytest.raises(TimeoutError, match="wait_writes: 1 writes still in flight"):
            c.post(g, src, [(0, 0, 1 << 20, 0, 33)])
            c.wait_writes(0.005)
    finally:
        c.close()


# ---- the engine between processes ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_writes_with_headers_zero_length_and_exact_immediates_between_processes():
    for errors, (posted, completed, received, pending) in run_peers(2, w.pair, "0", timeout_s=60):
        assert errors == []
        assert (posted, completed, received, pending) == (5, 5, 5, 0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_dead_peer_ends_posting_and_waits_with_errors_naming_it():
    out, died = run_peers(2, w.dead_peer, timeout_s=60)
    assert isinstance(died, Died), died
    name, position, msg, took = out["post"]
    assert name == "PeerTimeout" and position == 0 and "not consumed within 1s" in msg and took < 5, out
    assert "dead peer: timed out after 0.5s waiting for immediates: rank 1: 0/1" in out["wait"], out


# ---- end to end: LocalCluster over the emulated NIC --------------------------------------------------
def _cfg(world: int, private):
    import torch

    from moe_a2a.config import A2AConfig

    return A2AConfig(max_num_tokens=4, num_experts=2 * world, experts_per_token=2, hidden_dim=16,
                     in_dtype=torch.bfloat16, out_dtype=torch.bfloat16, max_private_tokens=private)


def _placement(a2a, rank):
    return a2a.placement, a2a.transport, str(a2a.emulated_nic)


def _calls_and_writes(a2a, rank: int, iters: int):
    """`rank_roundtrip`'s calls, with the writes this rank's proxy posted and the routes that asked for them."""
    import torch

    from moe_a2a.bench.demo import rank_roundtrip

    before = a2a.writes_posted()
    res = rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 11, iters)
    after = a2a.writes_posted()
    L, W = a2a.layout.num_local_experts, a2a.world_size
    routes = [torch.bincount(c["indices"][c["indices"] >= 0].long() // L, minlength=W).tolist() for c in res["calls"]]
    return {"calls": res["calls"], "dispatch": after["dispatch"] - before["dispatch"],
            "combine": after["combine"] - before["combine"], "routes": routes,
            "remote": a2a.layout.remote_peers(rank), "private_rows": a2a.layout.private_rows}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,node,buffers,nic,private", [
    # every peer remote, host-staged segments, with NIC settings on
    (2, 1, "auto", "200us,1GBps", None),
    # two nodes of two, memfd buffers shared by FD (the GPU path's shape), one private row: remainders
    (4, 2, "memfd", "0", 1),
], ids=["W2-N1-host-nic", "W4-N2-memfd-remainder"])
def test_dispatch_and_combine_over_the_emulated_nic_match_the_reference(monkeypatch, world, node, buffers, nic,
                                                                        private):
    from moe_a2a import LocalCluster
    from moe_a2a.oracle import check_against_reference

    monkeypatch.setenv(NIC_ENV, nic)  # read by each rank's AllToAll
    cfg, iters = _cfg(world, private), 2
    if TEST_DEVICE != "cpu":  # memfd is the CPU's stand-in for GPU memory; a GPU's "auto" is GPU memory itself
        buffers = "auto"
    with LocalCluster(cfg, world_size=world, node_size=node, transport="emulated", device=TEST_DEVICE,
                      timeout_s=60, buffers=buffers) as cl:
        placement = "host" if buffers == "auto" and TEST_DEVICE == "cpu" else "nic"
        assert set(cl.run(_placement)) == {(placement, "emulated", str(parse_nic_settings(nic)))}
        results = cl.run(_calls_and_writes, iters)
    assert check_against_reference(cfg, results) == []
    for rank, got in enumerate(results):  # the protocol's writes: one per remote peer and phase, + remainders
        remote, P = got["remote"], got["private_rows"]
        overflow = sum(routes[d] > P for routes in got["routes"] for d in remote)
        assert got["dispatch"] == iters * len(remote) + overflow, (rank, got)
        assert got["combine"] == iters * len(remote), (rank, got)
    if private == 1:
        assert any(sum(r[d] > 1 for r in g["routes"] for d in g["remote"]) for g in results)  # it did overflow
