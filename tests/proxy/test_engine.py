"""TransferEngine over real libfabric (tcp;ofi_rxm and shm) between real processes.

Multi-process bodies live in ``_engine_workers.py`` (spawned children import only that and the engine);
``_peers.run_peers`` spawns them and relays the address/descriptor exchange.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from moe_a2a.proxy import libfabric as lf
from moe_a2a.proxy.engine import EngineAddress, RemoteRegion, TransferEngine

from . import _engine_workers as w
from ._peers import Died, run_peers
from ._providers import PROVIDERS, provider_params


@pytest.fixture(params=provider_params(PROVIDERS))
def provider(request) -> str:
    """Each provider in turn, for the tests that take it (the others name theirs)."""
    return request.param


@pytest.fixture
def loop_engine(provider):
    """One engine that writes into itself (it is its own peer): exercises the whole path in-process."""
    eng = TransferEngine(provider, timeout_s=10.0)
    yield eng
    eng.close()


def _self_group(eng, nbytes=1 << 16):
    src_buf = ctypes.create_string_buffer(bytes(range(256)) * (nbytes // 256), nbytes)
    dst_buf = ctypes.create_string_buffer(nbytes)
    src = eng.register(ctypes.addressof(src_buf), nbytes)
    dst = eng.register(ctypes.addressof(dst_buf), nbytes)
    [me] = eng.connect([eng.address])
    grp = eng.peer_group([me], [dst.descriptor()])
    return src_buf, dst_buf, src, dst, grp


@pytest.mark.timeout(30)
def test_self_write_lands_with_immediate(loop_engine):
    eng = loop_engine
    src_buf, dst_buf, src, dst, grp = _self_group(eng)
    # mr_mode decides the remote address: virtual address (shm) or offset into the MR (tcp).
    desc = dst.descriptor()
    assert desc.base == (dst.addr if eng.info.virt_addr else 0)
    # Second target has length 0: it must still deliver its immediate. Targets as an array.
    eng.scatter(grp, src, np.array([(0, 5, 1000, 77), (0, 0, 0, 0)]), [0xABCD0001, 0xABCD0002])
    eng.wait_imms({0xABCD0001: 1, 0xABCD0002: 1}, 10, "self write")
    eng.wait_writes(10)
    assert dst_buf.raw[77:1077] == src_buf.raw[5:1005]
    assert dst_buf.raw[:77] == bytes(77) and dst_buf.raw[1077:2000] == bytes(923)
    assert eng.imm_counts() == {} and eng.writes_pending == 0
    assert (eng.writes_posted, eng.writes_completed, eng.imms_received) == (2, 2, 2)
    # Barrier: one zero-length write per peer; counters by exact 32-bit value, take_imm consumes.
    eng.barrier(grp, 0xFFFFFFFF)
    eng.barrier(grp, 0xFFFFFFFF)
    eng.wait_imms({0xFFFFFFFF: 1}, 10, "barrier")
    eng.wait_imms({0xFFFFFFFF: 1}, 10, "barrier 2")
    with pytest.raises(ValueError, match="requested"):
        eng.take_imm(0xFFFFFFFF, 1)
    eng.wait_writes(10)


@pytest.mark.timeout(30)
def test_a_write_over_the_size_bound_is_refused_before_posting(loop_engine):
    """One write carries at most `max_write_bytes` (the provider's max_msg_size; 1 GiB on EFA, which splits
    a larger write and raises its immediate more than once): scatter and post_table refuse more."""
    eng = loop_engine
    src_buf, dst_buf, src, dst, grp = _self_group(eng)
    assert 0 < eng.max_write_bytes <= int(eng.info.max_msg_size)
    eng.max_write_bytes = 64  # forced small: the bound, not the buffers, refuses
    posted = eng.writes_posted
    with pytest.raises(ValueError, match="max_write_bytes"):
        eng.scatter(grp, src, [(0, 0, 64, 0), (0, 0, 65, 100)], 1)
    table = np.array([(0, 65, 0, 0x21)], np.int64)
    with pytest.raises(ValueError, match="max_write_bytes"):
        eng.post_table(grp, src, memoryview(table).cast("B").cast("q"), ((0, 0),))
    assert eng.writes_posted == posted
    eng.scatter(grp, src, [(0, 0, 64, 0)], 0x22)
    eng.wait_imms({0x22: 1}, 10, "a write at the bound")
    eng.wait_writes(10)


@pytest.mark.timeout(30)
def test_post_table_posts_what_the_rows_say(loop_engine):
    """A write table as the kernels write it: rows (src, length, dst, imm) with bases, the
    remainder table's empty rows skipped, an immediate override; a row out of bounds posts nothing."""
    eng = loop_engine
    src_buf, dst_buf, src, dst, grp = _self_group(eng)
    table = np.zeros((3, 4), np.int64)
    table[0] = (10, 100, 0, 0x11)      # a private row: its count row and rows, one range
    table[1] = (0, 0, 0, 0x12)         # length 0: the immediate alone (or nothing with skip_empty)
    table[2] = (300, 50, 2000, 0x13)
    words = memoryview(table).cast("B").cast("q")
    slots = ((0, 0),)
    assert eng.post_table(grp, src, words, slots, src_base=1, dst_base=8) == 1
    assert eng.post_table(grp, src, words, slots, src_base=1, dst_base=8) == 1  # prepared: same
    eng.wait_imms({0x11: 2}, 10, "private rows")
    assert dst_buf.raw[8:108] == src_buf.raw[11:111]
    assert eng.post_table(grp, src, words, ((0, 4), (0, 8)), skip_empty=True) == 1
    eng.wait_imms({0x13: 1}, 10, "remainder row")
    assert dst_buf.raw[2000:2050] == src_buf.raw[300:350]
    assert eng.post_table(grp, src, words, ((0, 4),), imm=0x99) == 1  # an aborted call's combine: one imm
    eng.wait_imms({0x99: 1}, 10, "overridden immediate")
    posted = eng.writes_posted
    table[2] = (0, 64, (1 << 16) - 10, 0x14)  # past the end of the peer's region
    with pytest.raises(ValueError, match="out of bounds"):
        eng.post_table(grp, src, words, ((0, 8),))
    table[2] = (-1, 8, 0, 0x14)
    with pytest.raises(ValueError, match="out of bounds or negative"):
        eng.post_table(grp, src, words, ((0, 8),))
    with pytest.raises(ValueError, match="peer index 3"):
        eng.post_table(grp, src, words, ((3, 8),))
    assert eng.writes_posted == posted
    eng.wait_writes(10)


@pytest.mark.timeout(30)
def test_bad_descriptors_raise_value_error_before_posting(loop_engine):
    eng = loop_engine
    src_buf, dst_buf, src, dst, grp = _self_group(eng, 4096)
    bad_targets = {
        "dst past end": [(0, 0, 16, 4090)],
        "src past end": [(0, 4090, 16, 0)],
        "negative offset": [(0, -1, 1, 0)],
        "negative length": [(0, 0, -1, 0)],
        "unknown peer index": [(1, 0, 1, 0)],
        "negative peer index": [(-1, 0, 1, 0)],
    }
    for why, targets in bad_targets.items():
        # The good first target must not be posted either: validation precedes posting. Targets as
        # tuples and as an int64 [n, 4] array (the proxy's form) are refused alike.
        for form in (list, lambda t: np.array(t, dtype=np.int64)):
            with pytest.raises(ValueError, match="scatter target"):
                eng.scatter(grp, src, form([(0, 0, 8, 0)] + targets), 1)
            assert eng.writes_posted == 0, why
    with pytest.raises(ValueError, match=r"integer \[n, 4\] array"):
        eng.scatter(grp, src, np.zeros((2, 3), np.int64), 1)
    with pytest.raises(ValueError, match="32-bit"):
        eng.scatter(grp, src, [(0, 0, 8, 0)], 1 << 32)
    with pytest.raises(ValueError, match="imms for"):
        eng.scatter(grp, src, [(0, 0, 8, 0)], [1, 2])
    with pytest.raises(ValueError, match="LocalRegion"):
        eng.scatter(grp, dst.descriptor(), [(0, 0, 8, 0)], 1)
    [me] = eng.connect([eng.address])
    with pytest.raises(ValueError, match="RemoteRegion"):
        eng.peer_group([me], [dst])  # a LocalRegion where a descriptor is expected
    with pytest.raises(ValueError, match="keys"):
        eng.peer_group([me], [RemoteRegion(eng.provider_name, 4096, 0, (1, 2))])
    with pytest.raises(ValueError, match="provider"):
        eng.connect([EngineAddress("other", (b"x",))])
    with TransferEngine(eng.provider) as other:
        [stranger] = other.connect([other.address])
        with pytest.raises(ValueError, match="not a peer of this engine"):
            eng.peer_group([stranger], [dst.descriptor()])
    assert eng.writes_posted == 0


@pytest.mark.timeout(30)
def test_host_engine_refuses_gpu_registration_clearly(loop_engine):
    buf = ctypes.create_string_buffer(4096)
    with pytest.raises(lf.HmemUnsupported, match="FI_HMEM"):
        loop_engine.register(ctypes.addressof(buf), 4096, cuda_device=0)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [1, 2])
def test_random_writes_verify_bytes(provider, seed):
    # Sizes 0, 1, odd and up to 1 MiB/K, unaligned src/dst offsets, 1-6 writes per batch.
    _, verified = run_peers(2, w.random_writes, provider, seed, 25)
    assert verified > 0


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("size,num_domains", [
    pytest.param(2, 1, id="1peer"),
    pytest.param(4, 2, id="3peers-2domains"),  # peers sharded over 2 domains: both must be used
    pytest.param(8, 1, id="7peers"),
])
def test_scatter_all_to_all_with_barrier(provider, size, num_domains):
    results = run_peers(size, w.all_to_all, provider, 20, num_domains, timeout_s=60)
    for r in results:
        assert r["leftover_imms"] == {} and r["pending"] == 0
        # 20 iterations x (size-1) peers x (one data write + one barrier write).
        assert r["posted"] == r["completed"] == r["received"] == 20 * (size - 1) * 2
        assert r["domains"] == list(range(num_domains))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_scatter_over_named_domains_on_distinct_interfaces():
    """domains=[...] opens one fabric + domain per name (EFA: one per NIC; here tcp's two interfaces: shm
    has a single domain), and a group's peers are sharded over them: every write and immediate still arrives."""
    names = lf.list_domains("tcp")
    if len(names) < 2:
        pytest.skip(f"tcp offers one domain here ({names}); this needs two interfaces")
    names = names[:2]
    results = run_peers(4, w.all_to_all, "tcp", 10, 1, 256, {"domains": names}, timeout_s=60)
    for r in results:
        assert r["domain_names"] == names and r["domains"] == [0, 1]
        assert r["posted"] == r["completed"] == r["received"] == 10 * 3 * 2 and r["leftover_imms"] == {}
    with pytest.raises(lf.FabricError, match="has no domain 'no-such-nic'"):
        TransferEngine("tcp", domains=["no-such-nic"])
    with pytest.raises(ValueError, match="domains must be"):
        TransferEngine("tcp", domains="eth0")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_thousand_iterations_no_drift(provider):
    [a, b] = run_peers(2, w.all_to_all, provider, 1000, 1, 64)
    for r in (a, b):
        assert r["leftover_imms"] == {} and r["pending"] == 0
        assert r["posted"] == r["completed"] == r["received"] == 2000


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_back_pressure_small_queue(provider):
    # A tx queue of 8, at most 64 writes in flight, and a receiver that does not poll for 0.3 s: posting
    # must be throttled (provider -FI_EAGAIN or waiting for a context slot), and every write still lands.
    sender, receiver = run_peers(2, w.flood, provider, 2048, 64, dict(tx_size=8, cq_size=256, max_inflight=64))
    assert sender["throttled"] > 0, sender
    assert sender["posted"] == sender["completed"] == receiver["received"] == 2048
    assert receiver["data_ok"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_killed_peer_gives_timeout_naming_it(provider):
    timeout_s = 1.0
    root, _, dead = run_peers(3, w.killed_peer, provider, timeout_s)
    assert isinstance(dead, Died)
    assert "barrier" in root["wait"] and "rank 2: 0/1" in root["wait"] and "rank 1" not in root["wait"]
    assert root["wait_s"] < timeout_s + 1.0
    # Writing to the dead rank fails within the engine timeout and names the peer.
    assert root["dead_peer"] in root["write"], root["write"]
    assert root["write_s"] < 2 * timeout_s + 1.0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bootstrap_exchange_over_gloo(tmp_path):
    """The bootstrap is provider-independent: run once."""
    results = run_peers(2, w.exchange_over_gloo, str(tmp_path / "init"), timeout_s=80)
    assert results[0] == results[1] and len(results[0]) == 2
