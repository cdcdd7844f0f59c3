"""Issue 44 on the CPU: what a p5 / p5en would do to the libfabric carrier, injected into the ctypes layer.

- item 1: a refused ``FI_OPT_CUDA_API_PERMITTED`` with GPU buffers asked for is ``HmemUnsupported`` (the model
  process then stages or refuses, tests/runtime/test_fabric_refusals.py); efa below 1.20 is refused up front.
- item 2: GPU memory by DMA-BUF fd, chunk i at offset ``i * stride`` into it, checked call by call against
  the address path's arguments (a fake ``fi_mr_regattr``); the driver's fd taken and closed.
- item 5: a CQ error entry naming a peer (efa's dead peer) raises, or in shrink mode is recorded and the call
  goes on; one peer's ``-FI_EAGAIN`` sets its writes aside while the others' are posted (real shm engines,
  a fake ``fi_writemsg`` in front of one peer), at most ``POSTS_PER_PASS`` retries between two progress passes.
"""
from __future__ import annotations

import ctypes
import errno
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from moe_a2a.proxy import carriers
from moe_a2a.proxy import fabric as fabric_mod
from moe_a2a.proxy import libfabric as lf
from moe_a2a.proxy.engine import ACCESS_SOURCE, ACCESS_TARGET, PeerTimeout, TransferEngine
from moe_a2a.proxy.fabric import POSTS_PER_PASS, FabricCarrier
from moe_a2a.proxy.fabric_chunks import PAGE_SIZE

from .test_libfabric_versions import _fake_endpoint

pytestmark = pytest.mark.timeout(60)


# ---- item 1: FI_OPT_CUDA_API_PERMITTED refused with GPU buffers -----------------------------------------
@pytest.mark.parametrize("rc", [-lf.FI_EOPNOTSUPP, -lf.FI_EINVAL, -lf.FI_ENOPROTOOPT, None])
def test_a_refused_cuda_api_option_means_no_gpu_buffers(rc):
    ep, calls, keep = _fake_endpoint(rc)
    assert ep.forbid_cuda_api().startswith(("needed", "no CUDA", "not an option"))  # host buffers: tolerated
    with pytest.raises(lf.HmemUnsupported, match=r"FI_OPT_CUDA_API_PERMITTED.*no GPU buffers with the NIC"):
        ep.forbid_cuda_api(hmem=True)
    ep, calls, keep2 = _fake_endpoint(0)
    assert ep.forbid_cuda_api(hmem=True) == "false"
    del keep, keep2


def test_an_engine_asking_for_gpu_buffers_is_refused_when_the_option_is(monkeypatch):
    """The whole carrier: shm (no FI_HMEM asked, so it opens here) with every endpoint's fi_setopt answering
    -FI_EOPNOTSUPP, as efa without peer-to-peer does: host buffers open, GPU buffers are HmemUnsupported
    before anything is registered, and everything opened is closed again."""
    real_getinfo = lf.getinfo
    monkeypatch.setattr(lf, "getinfo", lambda provider, **kw: real_getinfo(provider, **dict(kw, hmem=False)))
    monkeypatch.setattr(lf.Endpoint, "setopt", lambda self, name, value, level=0: -lf.FI_EOPNOTSUPP)
    with TransferEngine("shm", timeout_s=5.0) as eng:
        assert eng.fabric_info["cuda_api_permitted"] == "needed by the provider for GPU memory (-FI_EOPNOTSUPP)"
    closed = []
    real_close = lf.Endpoint.close
    monkeypatch.setattr(lf.Endpoint, "close", lambda self: (closed.append(self.ptr), real_close(self))[1])
    with pytest.raises(lf.HmemUnsupported, match="FI_OPT_CUDA_API_PERMITTED"):
        TransferEngine("shm", timeout_s=5.0, hmem=True)
    assert len(closed) == 1


def test_efa_with_gpu_buffers_needs_1_20_or_the_sync_memops_variable():
    v = lf.FI_VERSION
    assert "needs libfabric >= 1.20 (found 1.19" in lf.efa_gpu_refusal(v(1, 19), {})
    assert "FI_EFA_SET_CUDA_SYNC_MEMOPS=0" in lf.efa_gpu_refusal(v(1, 18), {"FI_EFA_SET_CUDA_SYNC_MEMOPS": "1"})
    assert lf.efa_gpu_refusal(v(1, 19), {"FI_EFA_SET_CUDA_SYNC_MEMOPS": "0"}) is None
    assert lf.efa_gpu_refusal(v(1, 20), {}) is None and lf.efa_gpu_refusal(v(2, 1), {}) is None


# ---- item 2: DMA-BUF registration, chunked by offset as the address path is by address ---------------------
_MR_REGATTR_PY = lf._MR_REGATTR


def _fake_domain(api: str = "1.22"):
    """A Domain whose fi_mr_regattr records (the fi_mr_attr as the library reads it, the flags) and returns a
    fake MR; (domain, calls, keep-alive)."""
    major, minor = map(int, api.split("."))
    api_v = lf.FI_VERSION(major, minor)
    calls, mrs = [], []
    attr_type = lf.mirrored_structs(api_v)["fi_mr_attr"]

    def regattr(dom, attr_ptr, flags, out):
        a = attr_type.from_address(attr_ptr)
        if flags & lf.FI_MR_DMABUF:
            d = lf.fi_mr_dmabuf.from_address(a.mr_iov)
            where = ("dmabuf", d.fd, d.offset, d.len, d.base_addr)
        else:
            iov = lf.iovec.from_address(a.mr_iov)
            where = ("address", iov.iov_base, iov.iov_len)
        calls.append((where, flags, a.iov_count, a.access, a.iface, a.device.cuda, a.requested_key))
        mr = lf.fid_mr(key=0x1000 + len(mrs))
        mrs.append(mr)
        out[0] = ctypes.addressof(mr)
        return 0

    fn = _MR_REGATTR_PY(regattr)
    dom = lf.Domain.__new__(lf.Domain)
    dom.ptr, dom._mr_regattr = 1, fn
    dom.info = SimpleNamespace(caps=lf.FI_HMEM, api_version=api_v, prov_name="efa", prov_key=True)
    return dom, calls, (fn, mrs)


def _carrier(dom, limit: int | None, max_write: int):
    c = FabricCarrier.__new__(FabricCarrier)
    c._domains, c.info, c.max_registration_bytes = [dom], dom.info, limit
    c.engine, c._used_keys = SimpleNamespace(max_write_bytes=max_write), set()
    return c


def test_mr_regattr_cuda_by_dmabuf_and_by_address():
    dom, calls, keep = _fake_domain()
    dom.mr_regattr_cuda(0x7F0000010000, 8192, ACCESS_TARGET, 0, 3)
    dom.mr_regattr_cuda(0x7F0000010000, 8192, ACCESS_TARGET, 0, 3, dmabuf_fd=11, dmabuf_offset=4096,
                        dmabuf_base=0x7F000000F000)
    (a, fa, *rest_a), (d, fd, *rest_d) = calls
    assert a == ("address", 0x7F0000010000, 8192) and fa == 0
    # the provider's remote address is base_addr + offset (efa: ibv_reg_dmabuf_mr's iova): addr again
    assert d == ("dmabuf", 11, 4096, 8192, 0x7F000000F000) and fd == lf.FI_MR_DMABUF
    assert rest_a == rest_d == [1, ACCESS_TARGET, lf.FI_HMEM_CUDA, 3, 0]
    with pytest.raises(ValueError, match="is not addr"):
        dom.mr_regattr_cuda(0x7F0000010000, 8192, ACCESS_TARGET, 0, 3, dmabuf_fd=11, dmabuf_offset=1, dmabuf_base=0)
    old, calls_old, keep_old = _fake_domain("1.19")
    with pytest.raises(lf.HmemUnsupported, match="needs libfabric API >= 1.20"):
        old.mr_regattr_cuda(0x7F0000010000, 8192, ACCESS_TARGET, 0, 3, dmabuf_fd=11)
    assert calls_old == []
    del keep, keep_old


def test_dmabuf_registrations_in_chunks_match_the_address_path_chunk_by_chunk():
    """A 1 MiB GPU buffer over a 64 KiB limit: the DMA-BUF path registers chunk i as offset i * stride into the
    fd (base_addr the buffer's start), exactly the bytes the address path registers at addr + i * stride."""
    addr, nbytes, limit, max_write = 0x7F0000000000, 1 << 20, 64 << 10, 16 << 10
    got = {}
    for how in ("address", "dmabuf"):
        dom, calls, keep = _fake_domain()
        region = _carrier(dom, limit, max_write).register(addr, nbytes, ACCESS_TARGET, cuda_device=2,
                                                           dmabuf_fd=7 if how == "dmabuf" else None)
        got[how] = (calls, region.chunks, region.chunk_stride, region.chunk_bytes)
        del keep
    (a_calls, n, stride, chunk), (d_calls, *same) = got["address"], got["dmabuf"]
    assert same == [n, stride, chunk] and n > 10 and len(a_calls) == len(d_calls) == n
    for i, (a, d) in enumerate(zip(a_calls, d_calls)):
        (_, a_at, a_len), (_, fd, offset, d_len, base) = a[0], d[0]
        assert (fd, base, offset) == (7, addr, i * stride) and base + offset == a_at == addr + i * stride
        assert d_len == a_len == min(chunk, nbytes - i * stride)
        assert a[1] == 0 and d[1] == lf.FI_MR_DMABUF and a[2:6] == d[2:6] == (1, ACCESS_TARGET, lf.FI_HMEM_CUDA, 2)
    # below API 1.20 the fd is ignored: the address path, not a refusal
    dom, calls, keep = _fake_domain("1.19")
    _carrier(dom, None, max_write).register(addr, nbytes, ACCESS_TARGET, cuda_device=2, dmabuf_fd=7)
    assert [c[0][0] for c in calls] == ["address"]
    del keep


class _FakeDriver:
    """What `carriers.dmabuf_fd` calls of cuda.bindings.driver."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_NOT_SUPPORTED = 801

    class CUmemRangeHandleType:
        CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1

    def __init__(self, rc: int):
        self.rc, self.calls, self.fds = rc, [], []

    def cuMemGetHandleForAddressRange(self, addr, nbytes, kind, flags):
        self.calls.append((addr, nbytes, kind, flags))
        r, w = os.pipe()
        os.close(w)
        self.fds.append(r)
        return self.rc, r


def test_the_proxy_registers_its_gpu_buffers_by_dmabuf_fd_where_the_driver_gives_one():
    bufs = [SimpleNamespace(addr=0x7F0000000000, size=2 << 20), SimpleNamespace(addr=0x7F0000400000, size=4 << 20)]
    registered = []
    engine = SimpleNamespace(info=SimpleNamespace(api_version=lf.FI_VERSION(1, 22)),
                             register=lambda *a, **k: registered.append((a, k)) or len(registered))
    drv = _FakeDriver(0)
    assert carriers.register_gpu_buffers(engine, bufs, (ACCESS_SOURCE, ACCESS_TARGET), 5, 4096, drv) == [1, 2]
    assert drv.calls == [(b.addr, b.size, 1, 0) for b in bufs]
    assert [(a, k["dmabuf_fd"], k["cuda_device"], k["max_write_bytes"]) for a, k in registered] == [
        ((b.addr, b.size, acc), fd, 5, 4096) for b, acc, fd in zip(bufs, (ACCESS_SOURCE, ACCESS_TARGET), drv.fds)]
    for fd in drv.fds:  # closed once registered (the registration holds the DMA-BUF)
        with pytest.raises(OSError):
            os.fstat(fd)
    registered.clear()
    drv = _FakeDriver(_FakeDriver.CUresult.CUDA_ERROR_NOT_SUPPORTED)  # no DMA-BUF here: by address
    carriers.register_gpu_buffers(engine, bufs, (ACCESS_SOURCE, ACCESS_TARGET), 5, 4096, drv)
    assert [k["dmabuf_fd"] for _, k in registered] == [None, None]
    registered.clear()
    engine.info.api_version = lf.FI_VERSION(1, 19)  # no FI_MR_DMABUF: the driver is not even asked
    drv = _FakeDriver(0)
    carriers.register_gpu_buffers(engine, bufs, (ACCESS_SOURCE, ACCESS_TARGET), 5, 4096, drv)
    assert drv.calls == [] and [k["dmabuf_fd"] for _, k in registered] == [None, None]
    assert carriers.dmabuf_fd(1, 2, object())[0] is None  # a driver without the call: None, said why


# ---- item 4: what a peer must share ----------------------------------------------------------------------
def test_an_efa_address_carries_the_library_version_and_device_generation(monkeypatch):
    dev = lf.fi_device_attr(device_id=b"0xefa2")
    nic = lf.fid_nic(device_attr=ctypes.pointer(dev))
    assert lf.nic_device_id(ctypes.addressof(nic)) == "0xefa2" and lf.nic_device_id(None) is None
    c = FabricCarrier.__new__(FabricCarrier)
    c.provider_name, c._infos = "efa", [SimpleNamespace(device_id="0xefa2"), SimpleNamespace(device_id="0xefa2")]
    monkeypatch.setattr(lf, "runtime_version", lambda: (2, 1))
    assert c._fabric_label() == "libfabric 2.1, EFA device 0xefa2"
    c.provider_name = "shm"
    assert c._fabric_label() == ""


# ---- item 5: error completions and one busy peer ---------------------------------------------------------
def _engines(n: int):
    return [TransferEngine("shm", timeout_s=10.0) for _ in range(n)]


def test_a_cq_error_naming_a_peer_raises_or_masks_in_shrink_mode():
    a, b = _engines(2)
    try:
        [pb] = a.connect([b.address])
        carrier = a.carrier
        entry = carrier._cq_calls[0][2].err_entry_type()
        fake_cq = SimpleNamespace(readerr=lambda: (entry, "Connection aborted; provider: remote unreachable"))
        reads = []

        def read(cq, buf, n):
            reads.append(n)
            return -lf.FI_EAVAIL if len(reads) == 1 else -lf.FI_EAGAIN

        carrier._cq_calls = ((read, 0, fake_cq),)
        for shrink in (False, True):
            reads.clear()
            ctx = carrier._free_ctx.pop()  # a write in flight to b, failing after the SRD timeout
            carrier._ctx_peer[ctx] = pb
            entry.op_context, entry.err, entry.flags, entry.data = ctx, errno.ECONNABORTED, lf.FI_WRITE, 0x77
            a.peer_errors = {} if shrink else None
            if not shrink:
                with pytest.raises(lf.FabricError, match=r"FI_ECONNABORTED.*\[peer peer#0") as e:
                    a.progress()
                assert e.value.peer is pb
            else:
                assert a.progress() == 1  # the call goes on
                [(peer, err)] = a.peer_errors.items()
                assert peer is pb and err.errno_name == "FI_ECONNABORTED" and "imm 0x77" in str(err)
            assert a.writes_pending == 0  # its context is free again either way
        entry.op_context = 0  # an error that names no write of ours (a remote write's) raises, shrink or not
        reads.clear()
        with pytest.raises(lf.FabricError):
            a.progress()
    finally:
        for e in (a, b):
            e.close()


class _Busy:
    """A fake fi_writemsg in front of one peer: -FI_EAGAIN for its first `n` calls (None: always), then the real
    one; every call logged as (peer name, rc) in the shared `log`."""

    def __init__(self, real, name: str, log: list, n: int | None):
        self.real, self.name, self.log, self.left = real, name, log, n

    def __call__(self, ep, msg, flags):
        if self.left is None or self.left > 0:
            self.left = None if self.left is None else self.left - 1
            self.log.append((self.name, -lf.FI_EAGAIN))
            return -lf.FI_EAGAIN
        rc = self.real(ep, msg, flags)
        self.log.append((self.name, rc))
        return rc


def _group_with_busy_peer(a, targets, busy_calls, log):
    """a's group over `targets` (engines), their recv buffers, and a fake writemsg before target 0."""
    bufs = [np.zeros(1 << 16, np.uint8) for _ in targets]
    regions = [t.register(buf.ctypes.data, buf.nbytes, ACCESS_TARGET) for t, buf in zip(targets, bufs)]
    grp = a.peer_group(a.connect([t.address for t in targets]), [r.descriptor() for r in regions])
    info = list(grp.post_info)
    for i, row in enumerate(info):
        info[i] = (_Busy(row[0], f"peer{i}", log, busy_calls if i == 0 else 0),) + row[1:]
    grp.post_info = tuple(info)
    return grp, bufs


def _progress_until(engines, want: dict, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while any(e.imm_count(i) < n for e, wanted in want.items() for i, n in wanted.items()):
        assert time.monotonic() < end, {id(e): e.imm_counts() for e in engines}
        for e in engines:
            e.progress()


def test_one_busy_peer_does_not_hold_up_the_others_and_nothing_is_lost():
    """Peer 0 answers -FI_EAGAIN to its first 300 posts: its 40 rows are set aside while peers 1 and 2 get theirs
    at once, then retried in passes of at most POSTS_PER_PASS posts with a progress between. Every byte lands
    once, every immediate is counted once; per peer the rows keep their order (immediates are counted by value,
    so no order across peers is promised: docs/transport.md)."""
    a, *targets = _engines(4)
    log, passes = [], []
    try:
        src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[:1 << 16].copy()
        s = a.register(src.ctypes.data, src.nbytes, ACCESS_SOURCE)
        grp, bufs = _group_with_busy_peer(a, targets, 300, log)
        real_idle = a._idle_progress
        # the targets progress meanwhile, as separate processes would (shm lands data when the target polls)
        a._idle_progress = lambda: (passes.append(len(log)), [t.progress() for t in targets], real_idle())[2]
        rows = [(p, 512 * j, 512, 512 * j, (p << 8) | j) for p in range(3) for j in range(40 if p == 0 else 2)]
        table = np.array([r[1:] for r in rows], np.int64)
        slots = tuple((r[0], 4 * i) for i, r in enumerate(rows))
        assert a.post_table(grp, s, memoryview(table).cast("B").cast("q"), slots) == len(rows) == a.writes_posted
        first_busy_ok = next(i for i, (n, rc) in enumerate(log) if n == "peer0" and rc == 0)
        others = [i for i, (n, rc) in enumerate(log) if n != "peer0" and rc == 0]  # shm may refuse them at first too
        assert len(others) == 4 and max(others) < first_busy_ok
        assert a.eagain_retries >= 300 - 40  # its refusals after the first pass (and the others' if any)
        retry_posts = np.diff([p for p in passes if p >= passes[0]] + [len(log)])
        assert retry_posts.max() <= POSTS_PER_PASS, retry_posts
        _progress_until([a, *targets], {t: {(p << 8) | j: 1 for (p, *_, j) in [(p, j) for p in [k] for j in
                                                                                range(40 if k == 0 else 2)]}
                                        for k, t in enumerate(targets)})
        a.wait_writes(10)
        for k, (t, buf) in enumerate(zip(targets, bufs)):
            n = 40 if k == 0 else 2
            assert np.array_equal(buf[:512 * n], src[:512 * n]) and not buf[512 * n:].any()
            for j in range(n):
                t.take_imm((k << 8) | j, 1)
            assert t.imm_counts() == {}
    finally:
        for e in (a, *targets):
            e.close()


def test_a_peer_busy_past_the_post_timeout_is_named_and_the_others_are_posted():
    a, *targets = _engines(3)
    log = []
    try:
        src = np.ones(4096, np.uint8)
        s = a.register(src.ctypes.data, src.nbytes, ACCESS_SOURCE)
        grp, bufs = _group_with_busy_peer(a, targets, None, log)
        a.post_timeout_s = 0.2
        real_idle = a._idle_progress
        a._idle_progress = lambda: ([t.progress() for t in targets], real_idle())[1]
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout, match=r"returned -FI_EAGAIN for 0.2s.*every other write") as e:
            a.scatter(grp, s, [(0, 0, 64, 0), (1, 0, 64, 0), (0, 64, 64, 64)], [0xA0, 0xA1, 0xA2])
        assert time.monotonic() - t0 < 5
        assert (e.value.position, e.value.positions, e.value.posted) == (0, (0,), 1) and a.writes_posted == 1
        _progress_until([a, *targets], {targets[1]: {0xA1: 1}})
        assert targets[0].imm_counts() == {} and a.carrier._deferred == [] and a.carrier._lost == 0
        a.wait_writes(10)
    finally:
        for e in (a, *targets):
            e.close()


def test_a_refused_post_in_shrink_mode_is_recorded_against_its_peer():
    a, *targets = _engines(3)
    try:
        src = np.ones(4096, np.uint8)
        s = a.register(src.ctypes.data, src.nbytes, ACCESS_SOURCE)
        grp, bufs = _group_with_busy_peer(a, targets, 0, [])
        real_idle = a._idle_progress
        a._idle_progress = lambda: ([t.progress() for t in targets], real_idle())[1]
        info = list(grp.post_info)
        info[0] = ((lambda ep, msg, flags: -errno.EHOSTUNREACH),) + info[0][1:]
        grp.post_info = tuple(info)
        with pytest.raises(lf.FabricError, match="FI_EHOSTUNREACH"):
            a.scatter(grp, s, [(0, 0, 64, 0), (1, 0, 64, 0)], 0xB0)
        busy = list(grp.post_info)  # a row set aside, then a fatal error: nothing of that call is kept
        busy[1] = (_Busy(busy[1][0], "peer1", [], 1),) + busy[1][1:]
        grp.post_info = tuple(busy)
        with pytest.raises(lf.FabricError, match="FI_EHOSTUNREACH"):
            a.scatter(grp, s, [(1, 0, 64, 0), (0, 0, 64, 0)], 0xB2)
        assert a.carrier._deferred == [] and a.carrier._lost == 0
        a.wait_writes(10)
        a.peer_errors = {}
        a.scatter(grp, s, [(0, 0, 64, 0), (1, 0, 64, 0)], 0xB1)
        assert list(a.peer_errors) == [grp.peers[0]] and a.writes_posted == 1  # the raise stopped the first call
        _progress_until([a, *targets], {targets[1]: {0xB1: 1}})
        a.wait_writes(10)
    finally:
        for e in (a, *targets):
            e.close()
