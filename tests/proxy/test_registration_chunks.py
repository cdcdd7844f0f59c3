"""Registrations in chunks (issue 30, point 4): a buffer over the provider's limit on one registration (EFA:
2^20 pages, 4 GiB at 4 KiB pages) is registered as overlapping chunks, and every write lies wholly in one
chunk on each side, posted with that chunk's desc / key / address, never split (its immediate would be
counted twice). On CPU over the real tcp provider (no FI_MR_VIRT_ADDR: addresses relative to the chunk)
and shm (virtual addresses), the limit forced small: 64 KiB chunks over 1 MiB regions.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from moe_a2a.proxy import fabric_chunks as engine_mod
from moe_a2a.proxy.engine import ACCESS_SOURCE, ACCESS_TARGET, RemoteRegion, TransferEngine
from moe_a2a.proxy.fabric_chunks import PAGE_SIZE, registration_chunks

from ._providers import PROVIDERS, provider_params
from ..conftest import interpreter_only

LIMIT = 64 << 10
NBYTES = 1 << 20
MAX_WRITE = 16 << 10


@pytest.fixture(params=provider_params(PROVIDERS))
def provider(request) -> str:
    return request.param


def _buffer(nbytes: int, lead: int = 0) -> tuple[np.ndarray, int]:
    """A zeroed uint8 view of `nbytes` starting `lead` bytes into a page, and its address."""
    raw = np.zeros(nbytes + 2 * PAGE_SIZE, np.uint8)
    at = (-raw.ctypes.data) % PAGE_SIZE + lead
    view = raw[at:at + nbytes]  # keeps raw alive (its base)
    return view, view.ctypes.data


def _settle(eng: TransferEngine, seconds: float = 0.05) -> None:
    """Progress for a while: an immediate that arrived twice would show up in the counts."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        eng.progress()


def _ends(r) -> list[int]:
    return [min(i * r.chunk_stride + r.chunk_bytes, r.nbytes) for i in range(r.chunks)]


@pytest.mark.parametrize("nbytes,limit,max_write,lead", [
    (NBYTES, LIMIT, MAX_WRITE, 0), (NBYTES, LIMIT, MAX_WRITE, 100), (NBYTES + 5, LIMIT, 1, 4095),
    (3 * LIMIT, LIMIT, LIMIT - PAGE_SIZE, 0), (LIMIT + 1, LIMIT, 0, 0), (NBYTES, LIMIT + 123, 5000, 7)])
def test_every_write_up_to_the_bound_lies_in_the_chunk_of_its_offset(nbytes, limit, max_write, lead):
    count, stride, chunk = registration_chunks(nbytes, limit, max_write, lead)
    assert count > 1 and stride % PAGE_SIZE == 0 and stride + max_write <= chunk
    assert lead + chunk <= limit // PAGE_SIZE * PAGE_SIZE  # whole pages within the limit, wherever it starts
    assert (count - 2) * stride + chunk < nbytes <= (count - 1) * stride + chunk  # no chunk more than needed
    ends = [min(i * stride + chunk, nbytes) for i in range(count)]
    edges = {0, nbytes} | {i * stride + d for i in range(count + 1) for d in (-1, 0, 1)} | \
        {e + d for e in ends for d in (-max_write - 1, -max_write, -max_write + 1, -1, 0)}
    for o in sorted(e for e in edges if 0 <= e <= nbytes):
        k = min(o // stride, count - 1)
        for length in {0, 1, max_write // 2, max_write}:
            if o + length <= nbytes:
                assert k * stride <= o and o + length <= ends[k], (o, length, k)


def test_chunk_counts_at_efa_sizes_and_refusals():
    page, efa = 4096, engine_mod.EFA_MAX_REGISTRATION_PAGES * 4096
    assert engine_mod.default_max_registration_bytes("efa", page) == efa == 4 << 30
    assert engine_mod.default_max_registration_bytes("tcp") is None
    seg = int(14.2 * 2**30)  # issue 30: the host-staged segment at 128 ranks x 512 tokens
    assert registration_chunks(seg, efa, 1 << 30, 0, page)[0] == 5  # overlap of EFA's 1 GiB write bound
    assert registration_chunks(seg, efa, 4 << 20, 0, page)[0] == 4  # overlap of a layout's largest write
    assert registration_chunks(efa, efa, 1 << 30, 0, page) == (1, 0, efa)  # at the limit: one registration
    assert registration_chunks(efa, efa, 1 << 30, 1, page)[0] == 2  # unless it starts into a page (one more page)
    assert registration_chunks(seg, None, 1 << 30) == (1, 0, seg)
    with pytest.raises(ValueError, match=rf"{NBYTES} B exceed one registration's limit \({LIMIT} B.*largest write "
                                         rf"\({LIMIT - PAGE_SIZE + 1} B\)"):
        registration_chunks(NBYTES, LIMIT, LIMIT - PAGE_SIZE + 1)


@pytest.mark.timeout(60)
def test_writes_at_every_chunk_boundary_arrive_byte_exact_with_one_immediate(provider):
    """Writes starting on a chunk's first byte, straddling the stride where chunk k's overlap with chunk k+1
    begins, ending on a chunk's last byte, lying wholly in an overlap, at the region's end, zero-length ones:
    from a source in chunks (starting 100 B into a page) into a destination in chunks, by scatter and by
    post_table. Every byte lands where it should and every immediate is counted exactly once."""
    rng = np.random.default_rng(30)
    with TransferEngine(provider, timeout_s=10.0, max_registration_bytes=LIMIT) as eng:
        assert eng.max_registration_bytes == LIMIT
        src_buf, src_addr = _buffer(NBYTES, lead=100)
        dst_buf, dst_addr = _buffer(NBYTES)
        src_buf[:] = rng.integers(0, 256, NBYTES, np.uint8)
        src = eng.register(src_addr, NBYTES, ACCESS_SOURCE, max_write_bytes=MAX_WRITE)
        dst = eng.register(dst_addr, NBYTES, ACCESS_TARGET, max_write_bytes=MAX_WRITE)
        desc = dst.descriptor()
        assert src.chunks > 10 and dst.chunks > 10 and desc.chunks == dst.chunks
        assert (desc.chunk_stride, desc.chunk_bytes) == (dst.chunk_stride, dst.chunk_bytes) == (48 << 10, LIMIT)
        assert desc.chunk_keys[0] == desc.keys and len(set(desc.chunk_keys)) == dst.chunks
        assert "chunk_keys" not in repr(desc) and str(desc.keys[0]) not in repr(desc)
        [me] = eng.connect([eng.address])
        grp = eng.peer_group([me], [desc])
        assert grp.chunked
        S, C, n = dst.chunk_stride, dst.chunk_bytes, dst.chunks
        rounds = [
            [(k * S, MAX_WRITE) for k in range(n)],                            # a chunk's first byte
            [((k + 1) * S - 1, MAX_WRITE) for k in range(n - 1)],              # straddling the stride: chunk k
            [(k * S + C - MAX_WRITE, MAX_WRITE) for k in range(n - 1)],        # ending on chunk k's last byte
            [(k * S + C - 1, 1) for k in range(n - 1)] + [(NBYTES - 1, 1)],   # the last byte of each chunk
            [((k + 1) * S + 100, 3000) for k in range(n - 1)],                 # wholly inside an overlap
            [(NBYTES - MAX_WRITE, MAX_WRITE), (0, 0), (S, 0), (NBYTES, 0)],    # the end; immediates alone
        ]
        assert (src.chunk_stride, src.chunk_bytes) == (44 << 10, LIMIT - 100)  # 100 B into its first page
        s_S, s_C = src.chunk_stride, src.chunk_bytes  # source offsets on its own chunks' edges
        s_edges = sorted({e for k in range(src.chunks + 1) for e in (k * s_S - 1, k * s_S, k * s_S + s_C - MAX_WRITE)
                          if 0 <= e})
        posted = 0
        for r, dsts in enumerate(rounds):
            dsts = [(do, length) for do, length in dsts if do + length <= NBYTES]
            targets = []
            for j, (do, length) in enumerate(dsts):
                so = min(s_edges[(7 * j + r) % len(s_edges)], NBYTES - length)
                targets.append((0, so, length, do))
            imms = [(r << 16) | j for j in range(len(targets))]
            if r % 2:
                table = np.array([(so, length, do, v) for (_, so, length, do), v in zip(targets, imms)], np.int64)
                words = memoryview(table).cast("B").cast("q")
                assert eng.post_table(grp, src, words, tuple((0, 4 * j) for j in range(len(targets)))) == len(targets)
            else:
                eng.scatter(grp, src, targets, imms)
            eng.wait_imms(dict.fromkeys(imms, 1), 10, f"round {r}")
            eng.wait_writes(10)
            want = np.zeros(NBYTES, np.uint8)
            for _, so, length, do in targets:
                want[do:do + length] = src_buf[so:so + length]
            bad = np.flatnonzero(dst_buf != want)
            assert bad.size == 0, f"round {r}: {bad.size} bytes differ, first at {bad[:4]}"
            dst_buf[:] = 0
            posted += len(targets)
        _settle(eng)
        assert eng.imm_counts() == {}  # nothing counted twice
        assert eng.writes_posted == eng.imms_received == posted
        # A barrier over a group in chunks: one zero-length write, one immediate.
        eng.barrier(grp, 0xB0)
        eng.wait_imms({0xB0: 1}, 10, "barrier")
        eng.wait_writes(10)


@pytest.mark.timeout(60)
def test_a_write_that_would_cross_chunks_is_refused_and_one_within_a_chunk_posts(provider):
    """The engine's own bound (tcp / shm: max_msg_size) is larger than the regions' (MAX_WRITE): a longer
    write is posted only where it fits one chunk; across two it is refused before anything is posted."""
    with TransferEngine(provider, timeout_s=10.0, max_registration_bytes=LIMIT) as eng:
        src_buf, src_addr = _buffer(NBYTES)
        dst_buf, dst_addr = _buffer(NBYTES)
        src_buf[:] = 7
        src = eng.register(src_addr, NBYTES, ACCESS_SOURCE, max_write_bytes=MAX_WRITE)
        dst = eng.register(dst_addr, NBYTES, ACCESS_TARGET, max_write_bytes=MAX_WRITE)
        [me] = eng.connect([eng.address])
        grp = eng.peer_group([me], [dst.descriptor()])
        S, C = dst.chunk_stride, dst.chunk_bytes
        longer = MAX_WRITE + 4096
        assert S + longer > C  # from the stride into the next chunk's end: crosses
        table = np.array([(0, longer, S - 1, 0x31)], np.int64)
        words = memoryview(table).cast("B").cast("q")
        for bad in ([(0, 0, 8, 0), (0, 0, longer, S - 1)], [(0, S - 1, longer, 0)]):  # destination; source
            with pytest.raises(ValueError, match="crosses from one registration chunk into the next"):
                eng.scatter(grp, src, bad, 0x30)
        with pytest.raises(ValueError, match="crosses from one registration chunk"):
            eng.post_table(grp, src, words, ((0, 0),))
        assert eng.writes_posted == 0
        eng.scatter(grp, src, [(0, 2 * S, longer, 3 * S)], 0x32)  # wholly in a chunk on both sides
        eng.wait_imms({0x32: 1}, 10, "a longer write within one chunk")
        eng.wait_writes(10)
        assert (dst_buf[3 * S:3 * S + longer] == 7).all() and dst_buf[:3 * S].sum() == 0


@pytest.mark.timeout(60)
def test_one_chunk_is_todays_registration_and_fast_path(provider, monkeypatch):
    """Under the limit nothing changes: one MR per domain, the descriptor as before, the group's fast path.
    A group whose peer region is one registration, used with a source in chunks and then with a source of
    one registration again, gets its templates' descs back."""
    with TransferEngine(provider, timeout_s=10.0, max_registration_bytes=LIMIT) as eng:
        one_buf, one_addr = _buffer(LIMIT)
        one_buf[:] = 1
        dst_buf, dst_addr = _buffer(LIMIT)
        big_buf, big_addr = _buffer(NBYTES)
        big_buf[:] = 2
        one = eng.register(one_addr, LIMIT, max_write_bytes=MAX_WRITE)  # exactly the limit, page-aligned
        dst = eng.register(dst_addr, LIMIT, ACCESS_TARGET)
        big = eng.register(big_addr, NBYTES, ACCESS_SOURCE, max_write_bytes=MAX_WRITE)
        assert (one.chunks, one.chunk_stride, len(one.reg._mrs)) == (1, 0, eng.num_domains) and big.chunks > 1
        desc = dst.descriptor()
        assert desc == RemoteRegion(eng.provider_name, LIMIT, desc.base, dst.keys) and desc.chunks == 1
        [me] = eng.connect([eng.address])
        grp = eng.peer_group([me], [desc])
        assert not grp.chunked
        eng.scatter(grp, big, [(0, NBYTES - 100, 100, 0)], 0x41)  # from the last source chunk
        eng.wait_imms({0x41: 1}, 10, "from a source in chunks")

        def refuse(*a, **k):
            raise AssertionError("the chunked path was taken for regions of one registration")

        monkeypatch.setattr(eng.carrier, "_post_table_chunked", refuse)
        monkeypatch.setattr(eng.carrier, "_scatter_chunked", refuse)
        eng.scatter(grp, one, [(0, 0, 100, 100)], 0x42)
        table = np.array([(0, 100, 200, 0x43)], np.int64)
        assert eng.post_table(grp, one, memoryview(table).cast("B").cast("q"), ((0, 0),)) == 1
        eng.wait_imms({0x42: 1, 0x43: 1}, 10, "one registration")
        eng.wait_writes(10)
        assert (dst_buf[:100] == 2).all() and (dst_buf[100:300] == 1).all() and dst_buf[300:].sum() == 0
        # One byte over the limit: two chunks.
        assert eng.register(big_addr, LIMIT + 1, ACCESS_SOURCE, max_write_bytes=MAX_WRITE).chunks == 2


def test_a_limit_below_the_largest_write_is_refused(monkeypatch):
    with TransferEngine("tcp", max_registration_bytes=LIMIT) as eng:
        buf, addr = _buffer(NBYTES)
        with pytest.raises(ValueError, match=rf"{NBYTES} B exceed one registration's limit \({LIMIT} B"):
            eng.register(addr, NBYTES, max_write_bytes=LIMIT)
        with pytest.raises(ValueError, match="largest write"):
            eng.register(addr, NBYTES)  # tcp's own bound on a write (max_msg_size) is far over 64 KiB
        assert eng.register(addr, LIMIT, max_write_bytes=LIMIT).chunks == 1  # fits: no overlap needed
        [me] = eng.connect([eng.address])
        bad = RemoteRegion(eng.provider_name, NBYTES, 0, (1,), 4096, 8192, (0, 0), ((1,), (2,)))  # misses the end
        with pytest.raises(ValueError, match="do not describe it"):
            eng.peer_group([me], [bad])
    monkeypatch.setenv(engine_mod.MAX_REGISTRATION_ENV, str(LIMIT))
    with TransferEngine("tcp") as eng:
        assert eng.max_registration_bytes == LIMIT
    with pytest.raises(ValueError, match="two pages"):
        TransferEngine("tcp", max_registration_bytes=100)
    monkeypatch.setenv(engine_mod.MAX_REGISTRATION_ENV, "lots")
    with pytest.raises(ValueError, match="MOE_A2A_MAX_REGISTRATION_BYTES='lots'"):
        TransferEngine("tcp")


def _roundtrip_and_registrations(a2a, rank: int) -> dict:
    from moe_a2a.bench.demo import rank_roundtrip

    return {"result": rank_roundtrip(a2a, rank, a2a.cfg.max_num_tokens, 11, 2),
            "registrations": [f["registrations"] for f in a2a.fabric_info]}


@interpreter_only("its ranks run on the CPU (--device cpu / device='cpu')")
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("buffers", ["host", "memfd"])
def test_all_to_all_over_registrations_in_chunks_matches_the_reference(buffers, monkeypatch):
    """Two nodes over tcp, every registration of the proxies forced into chunks through the environment
    (16 KiB; the layout's largest write is 4128 B): the host-staged segment, or the send / recv buffers of
    their own (memfd: the CPU stand-in of GPU buffers). Two calls match the reference exactly."""
    import torch

    from moe_a2a import LocalCluster
    from moe_a2a.config import A2AConfig
    from moe_a2a.oracle import check_against_reference
    from moe_a2a.proxy.worker import largest_write_bytes

    cfg = A2AConfig(max_num_tokens=16, num_experts=8, experts_per_token=2, hidden_dim=64, in_dtype=torch.bfloat16)
    assert largest_write_bytes(cfg.layout(2, 1)) + PAGE_SIZE <= 16 << 10
    monkeypatch.setenv(engine_mod.MAX_REGISTRATION_ENV, str(16 << 10))
    with LocalCluster(cfg, world_size=2, node_size=1, transport="tcp", device="cpu", timeout_s=60.0,
                      buffers=buffers) as cl:
        out = cl.run(_roundtrip_and_registrations)
    assert check_against_reference(cfg, [o["result"] for o in out]) == []
    for o in out:
        [regs] = o["registrations"]
        assert [what for what, _, _ in regs] == (["segment"] if buffers == "host" else ["send", "recv"])
        assert all(chunks == registration_chunks(n, 16 << 10, largest_write_bytes(cfg.layout(2, 1)))[0] > 1
                   for _, n, chunks in regs), regs
