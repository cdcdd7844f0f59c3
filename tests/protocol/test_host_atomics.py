"""proxy.host_atomics: release stores / acquire loads of flag words, on both paths (plain x86-64 and
libatomic, forced on x86-64), within one process, between two real processes, and under `Flags`."""
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from moe_a2a.config import Layout
from moe_a2a.protocol.words import Flag, flag_word
from moe_a2a.protocol import host_atomics
from moe_a2a.protocol.memory import SharedSegment, unique_name
from moe_a2a.protocol.segment import Flags, read_error, write_error

BACKENDS = ["libatomic"] + (["plain"] if host_atomics.PLAIN_IS_ORDERED else [])
VALUES = [0, 1, -1, 7, -(2**31), 2**31, 2**32 + 5, 2**62 + 3, 2**63 - 1, -(2**63), -(2**63) + 1]


@pytest.fixture(params=BACKENDS)
def backend(request):
    before = host_atomics.backend
    assert host_atomics.set_backend(request.param) == request.param
    yield request.param
    host_atomics.set_backend(before)


def _segment(nbytes: int = 4096) -> SharedSegment:
    return SharedSegment(unique_name("moe_a2a-test"), nbytes, create=True)


def _round_trip(words: np.ndarray) -> None:
    base = words.ctypes.data
    for i, v in enumerate(VALUES):
        host_atomics.store_release(base + 8 * i, v)
    assert [host_atomics.load_acquire(base + 8 * i) for i in range(len(VALUES))] == VALUES
    assert words[: len(VALUES)].tolist() == VALUES         # the same bytes as a plain int64 view
    words[len(VALUES)] = -12345                              # and the other way round
    assert host_atomics.load_acquire(base + 8 * len(VALUES)) == -12345
    assert words[len(VALUES) + 1:].tolist() == [0] * (len(words) - len(VALUES) - 1)  # nothing else written


@pytest.mark.timeout(60)
def test_round_trip_numpy_array(backend):
    _round_trip(np.zeros(32, np.int64))


@pytest.mark.timeout(60)
def test_round_trip_shared_segment(backend):
    seg = _segment()
    other = SharedSegment(seg.name)
    try:
        _round_trip(seg.numpy(512, 32, np.int64))
        assert other.numpy(512, len(VALUES), np.int64).tolist() == VALUES  # seen through another mapping
        host_atomics.store_release(other.addr + 1024, 2**63 - 2)
        assert host_atomics.load_acquire(seg.addr + 1024) == 2**63 - 2
    finally:
        other.close()
        seg.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_default_backend_and_forcing_it():
    env = dict(os.environ)
    env.pop(host_atomics.FORCE_ENV, None)
    code = "from moe_a2a.protocol import host_atomics as h; print(h.backend)"
    default = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert default.stdout.strip() == ("plain" if host_atomics.PLAIN_IS_ORDERED else "libatomic"), default.stderr
    env[host_atomics.FORCE_ENV] = "libatomic"
    forced = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert forced.stdout.strip() == "libatomic", forced.stderr
    if not host_atomics.PLAIN_IS_ORDERED:
        with pytest.raises(ValueError, match="not acquire/release"):
            host_atomics.set_backend("plain")


@pytest.mark.timeout(60)
def test_missing_libatomic_is_a_clear_error(monkeypatch):
    before = host_atomics.backend
    monkeypatch.setattr(host_atomics, "_lib", None)
    monkeypatch.setattr(host_atomics, "_LIBRARY_NAMES", ("libno-such-atomic.so.9", "no-such-atomic"))
    with pytest.raises(RuntimeError, match="install the libatomic1 package"):
        host_atomics.set_backend("libatomic")
    assert host_atomics.backend == before  # the working path is still selected


# ---- message passing between two processes ---------------------------------------------------------
ITERATIONS = 3000
PAYLOAD_WORDS = 64  # 512 B: eight cache lines written before each flag
FLAG, ACK, PAYLOAD = 0, 64, 128  # byte offsets in the segment (flag and ack on lines of their own)


def _wait(addr: int, value: int, deadline: float) -> None:
    spins = 0
    while host_atomics.load_acquire(addr) != value:
        spins += 1
        if spins % 256 == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"word at {addr:#x} never reached {value}")
            os.sched_yield()  # two spinning processes on a 2-core CI machine


def _writer(name: str, backend: str, timeout_s: float) -> None:
    host_atomics.set_backend(backend)
    seg = SharedSegment(name)
    try:
        payload, deadline = seg.numpy(PAYLOAD, PAYLOAD_WORDS, np.int64), time.monotonic() + timeout_s
        for i in range(1, ITERATIONS + 1):
            payload[:] = i * 1000 + np.arange(PAYLOAD_WORDS)          # plain stores
            host_atomics.store_release(seg.addr + FLAG, i)             # publish them
            _wait(seg.addr + ACK, i, deadline)                         # the reader is done with i
    finally:
        seg.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_message_passing_between_processes(backend):
    seg = _segment()
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_writer, args=(seg.name, backend, 40.0), daemon=True)
    child.start()
    try:
        payload, deadline = seg.numpy(PAYLOAD, PAYLOAD_WORDS, np.int64), time.monotonic() + 40.0
        expected = np.arange(PAYLOAD_WORDS)
        for i in range(1, ITERATIONS + 1):
            _wait(seg.addr + FLAG, i, deadline)
            got = payload - i * 1000
            assert (got == expected).all(), f"iteration {i}: payload not yet visible after the flag: {got}"
            host_atomics.store_release(seg.addr + ACK, i)
        child.join(20)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        seg.close()


# ---- Flags -----------------------------------------------------------------------------------------
def _layout() -> Layout:
    # Built directly: A2AConfig.layout needs torch, and Flags only needs the offsets.
    return Layout(world_size=2, node_size=1, num_experts=4, max_num_tokens=4, experts_per_token=2,
                  expert_padding=1, private_rows=8, dispatch_stride_bytes=64, combine_stride_bytes=64)


@pytest.mark.timeout(60)
def test_flags_go_through_host_atomics(backend, monkeypatch):
    lay = _layout()
    seg = _segment(lay.segment_bytes(True))
    try:
        flags = Flags(seg, lay)
        base = seg.addr + lay.flags_offset_bytes
        calls = []
        store, load = host_atomics.store_release, host_atomics.load_acquire
        monkeypatch.setattr(host_atomics, "store_release", lambda a, v: (calls.append(("store", a, v)), store(a, v))[1])
        monkeypatch.setattr(host_atomics, "load_acquire", lambda a: (calls.append(("load", a)), load(a))[1])
        flags[Flag.COMBINE_RECV_READY] = 2**40 + 1
        assert flags[Flag.COMBINE_RECV_READY] == 2**40 + 1
        flags[Flag.HEARTBEAT] = -3
        assert flags[int(Flag.HEARTBEAT)] == -3  # a plain int names the same flag
        a_recv, a_hb = (base + 8 * flag_word(f) for f in (Flag.COMBINE_RECV_READY, Flag.HEARTBEAT))
        assert calls == [("store", a_recv, 2**40 + 1), ("load", a_recv), ("store", a_hb, -3), ("load", a_hb)]
        words = seg.numpy(lay.flags_offset_bytes, flag_word(Flag.NUM_FLAGS), np.int64)
        assert words[flag_word(Flag.COMBINE_RECV_READY)] == 2**40 + 1 and words[flag_word(Flag.HEARTBEAT)] == -3
        assert np.count_nonzero(words) == 2  # at each flag's own word, nothing else
        with pytest.raises(KeyError):
            flags[Flag.NUM_FLAGS] = 1  # not a flag: never a store outside the flags area
        del words

        calls.clear()
        write_error(seg, lay, 2, "proxy failed: peer 1 missing")
        assert calls == [("store", base + 8 * flag_word(Flag.ERROR), 2)]  # one release store, the flag
        assert read_error(seg, lay) == "proxy failed: peer 1 missing"
        assert calls[1:] == [("load", base + 8 * flag_word(Flag.ERROR))]  # acquire before the message
    finally:
        seg.close()
