"""Every write a proxy posts is one local iovec, at most one write's bound, from sources registered with the
access they need (issue 30: EFA writes in hardware only a single iovec, splits writes over 1 GiB).

Two real `Proxy` objects (ranks 0 and 1 of a two-node world) run one call in threads of this process
over a real provider, the model's part played here: the write tables, the send buffer as the kernels leave
it (the count row at the head of each private staging slot) and the flags. Every endpoint's `writemsg`
is wrapped before the proxies build their groups, so every `fi_msg_rma` posted is decoded as it goes.
"""
from __future__ import annotations

import ctypes
import os
import socket
import threading
from multiprocessing import Pipe
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_a2a.config import A2AConfig
from moe_a2a.protocol import plan
from moe_a2a.protocol.segment import Flags
from moe_a2a.protocol.words import Flag, Imm, WriteTable, encode_imm
from moe_a2a.proxy import engine as engine_mod
from moe_a2a.proxy import fabric
from moe_a2a.proxy import libfabric as lf
from moe_a2a.proxy import worker
from moe_a2a.protocol.memory import MemfdBuffer, SharedSegment, send_fds, unique_name
from moe_a2a.protocol.proxy_spec import ProxySpec

from ._providers import PROVIDERS, provider_params

W = 2


def _decode(msg_addr: int) -> dict:
    """The fi_msg_rma at `msg_addr`: its iovecs and rma iovecs, as the provider will read them."""
    msg = lf.fi_msg_rma.from_address(msg_addr)
    iov = (ctypes.c_uint64 * (2 * msg.iov_count)).from_address(msg.msg_iov) if msg.iov_count else []
    rma = (ctypes.c_uint64 * (3 * msg.rma_iov_count)).from_address(msg.rma_iov) if msg.rma_iov_count else []
    return {"iov_count": msg.iov_count, "iov_lens": list(iov[1::2]), "rma_iov_count": msg.rma_iov_count,
            "rma_lens": list(rma[1::3]), "imm": msg.data}


class _Recorded:
    """make_engine, with every endpoint's writemsg wrapped to decode each message before posting it, and
    every registration's access kept."""

    def __init__(self, monkeypatch):
        self.writes: list[dict] = []
        self.registered: list[tuple[int, int, int]] = []  # (addr, nbytes, access)
        self.engines = []
        real_make = worker.make_engine
        lock = threading.Lock()

        def make(spec, on_gpu):
            eng = real_make(spec, on_gpu)
            for ep in eng._eps:
                real = ep.writemsg

                def writemsg(ep_ptr, msg_addr, flags, real=real):
                    w = _decode(msg_addr)
                    w["rc"] = rc = real(ep_ptr, msg_addr, flags)  # -FI_EAGAIN: retried, posted again
                    with lock:
                        self.writes.append(w)
                    return rc

                ep.writemsg = writemsg
            register = eng.register

            def recorded_register(addr, nbytes, access=engine_mod.ACCESS_SOURCE_AND_TARGET, **kw):
                self.registered.append((addr, nbytes, access))
                return register(addr, nbytes, access, **kw)

            eng.register = recorded_register
            self.engines.append(eng)
            return eng

        monkeypatch.setattr(worker, "make_engine", make)


def _counts(lay, rng) -> np.ndarray:
    """Rank 0 sends every route to rank 1's first expert (its private slot fills, a remainder follows);
    rank 1 routes at random."""
    T, K, E = lay.max_num_tokens, lay.experts_per_token, lay.num_experts
    counts = np.zeros((W, E), np.int64)
    counts[0, lay.num_local_experts] = T * K
    experts = rng.integers(-1, E, T * K)
    counts[1] = np.bincount(experts[experts >= 0], minlength=E)
    return counts


def _tables(counts, rank, lay, epoch) -> tuple[np.ndarray, int]:
    routes = plan.route_matrix(counts, lay)
    out = np.zeros((int(WriteTable.NUM_TABLES), W, 4), np.int64)
    for peer, src, n, dst in plan.private_writes(counts[rank], rank, lay).tolist():
        kind = Imm.DISPATCH_MORE if routes[rank, peer] > lay.private_rows else Imm.DISPATCH
        out[WriteTable.PRIVATE, peer] = (src, n, dst, encode_imm(kind, rank, epoch))
    rem = plan.remainder_writes(routes, rank, lay)
    for peer, src, n, dst in rem.tolist():
        out[WriteTable.REMAINDER, peer] = (src, n, dst, encode_imm(Imm.DISPATCH_REMAINDER, rank, epoch))
    for peer, src, n, dst in plan.combine_writes(routes, rank, lay).tolist():
        out[WriteTable.COMBINE, peer] = (src, n, dst, encode_imm(Imm.COMBINE, rank, epoch))
    return out, len(rem)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("own_buffers", [False, True], ids=["host-staged", "own-buffers"])
@pytest.mark.parametrize("provider", provider_params(PROVIDERS))
def test_every_write_of_a_call_is_one_iovec_within_the_bound_and_lands(provider, own_buffers, monkeypatch):
    cfg = A2AConfig(max_num_tokens=6, num_experts=4, experts_per_token=3, hidden_dim=40, in_dtype=torch.float32,
                    max_private_tokens=4)
    lay = cfg.layout(W, 1)
    rec = _Recorded(monkeypatch)
    rng = np.random.default_rng(7)
    counts = _counts(lay, rng)
    segs = [SharedSegment(unique_name(), lay.segment_bytes(not own_buffers), create=True) for _ in range(W)]
    bufs = [[MemfdBuffer(n) for n in (lay.send_bytes, lay.recv_bytes)] for _ in range(W)] if own_buffers else None
    proxies: list = [None] * W
    errors: list = []
    conns = [Pipe() for _ in range(W)]
    socks = [socket.socketpair() for _ in range(W)]

    def build(r):
        try:
            spec = ProxySpec(lay, r, segs[r].name, not own_buffers, provider, 20.0, parent_pid=os.getppid(),
                             idle_yield=True, local_only=True,
                             fd_buffers=("host", 0, lay.send_bytes, lay.recv_bytes) if own_buffers else None)
            proxies[r] = worker.Proxy(spec, conns[r][1], socks[r][1])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            conns[r][1].send(("error", repr(exc)))

    threads = [threading.Thread(target=build, args=(r,)) for r in range(W)]
    try:
        for t in threads:
            t.start()
        if own_buffers:
            for r in range(W):
                send_fds(socks[r][0], [os.dup(b.fd) for b in bufs[r]])
        hello = [conns[r][0].recv() for r in range(W)]
        assert not errors, errors
        table = [(h[0], h[1], segs[r].name, h[2]) for r, h in enumerate(hello)]
        for r in range(W):
            conns[r][0].send((table, False))
        for t in threads:
            t.join(30)
        assert not errors and all(proxies), errors

        # Sources registered with exactly the access they need; nothing readable remotely.
        # (Each proxy maps the buffers itself: compared by size and access.) Host-staged, the segment is the
        # source and the target of the writes; with buffers of their own the send buffer is only a local
        # source, the recv buffer only written by peers, and the segment not registered at all.
        expected = [(s.nbytes, lf.FI_WRITE | lf.FI_REMOTE_WRITE) for s in segs] if not own_buffers else \
            [(b.size, a) for pair in bufs for b, a in zip(pair, (lf.FI_WRITE, lf.FI_REMOTE_WRITE))]
        assert sorted((n, acc) for _, n, acc in rec.registered) == sorted(expected)
        assert all(not acc & (lf.FI_REMOTE_READ | lf.FI_READ) for _, _, acc in rec.registered)

        # The model's part of call 1: tables, send buffers as the kernels leave them, flags.
        epoch, sends, recvs = 1, [], []
        for r in range(W):
            if own_buffers:
                send = np.frombuffer((ctypes.c_uint8 * lay.send_bytes).from_address(bufs[r][0].addr), np.uint8)
                recv = np.frombuffer((ctypes.c_uint8 * lay.recv_bytes).from_address(bufs[r][1].addr), np.uint8)
            else:
                send, recv = segs[r].numpy(lay.send_offset_bytes, lay.send_bytes), \
                    segs[r].numpy(lay.recv_offset_bytes, lay.recv_bytes)
            send[:] = rng.integers(0, 256, lay.send_bytes, dtype=np.uint8)
            tab, n_rem = _tables(counts, r, lay, epoch)
            for peer, src, n, dst in plan.private_writes(counts[r], r, lay).tolist():  # the plan kernel's headers
                send[src:src + lay.routing_row_bytes] = counts[r].astype(np.int32).view(np.uint8)
            segs[r].numpy(lay.write_table_offset_bytes, tab.size, np.int64)[:] = tab.reshape(-1)
            flags = Flags(segs[r], lay)
            flags[Flag.REMAINDER_WRITES] = n_rem
            for f in (Flag.ROUTE_READY, Flag.SEND_READY, Flag.REMAINDER_PLANNED, Flag.COMBINE_SEND_READY):
                flags[f] = epoch
            sends.append(send.copy())
            recvs.append(recv)

        runs = [threading.Thread(target=lambda r=r: _run(proxies[r], epoch, errors)) for r in range(W)]
        for t in runs:
            t.start()
        for t in runs:
            t.join(60)
        assert not errors, errors
        assert all(Flags(s, lay)[Flag.COMBINE_WRITES_DONE] == epoch for s in segs)

        # Every posted write: one iovec, one rma iovec of the same length, within the bound.
        bound = min(min(e.max_write_bytes for e in rec.engines), fabric.EFA_MAX_WRITE_BYTES)
        posted = sum(e.writes_posted for e in rec.engines)
        assert posted == sum(w["rc"] == 0 for w in rec.writes) >= 2 * 2 + 1  # private, combine; a remainder
        for w in rec.writes:
            assert w["iov_count"] == 1 and w["rma_iov_count"] == 1, w
            assert w["iov_lens"] == w["rma_lens"] and w["iov_lens"][0] <= bound, w
        # ... and it landed: the count row, then the rows, in one range of the receiver's private slot.
        for r in range(W):
            for peer, src, n, dst in plan.private_writes(counts[r], r, lay).tolist():
                assert n > lay.routing_row_bytes
                assert recvs[peer][dst:dst + lay.routing_row_bytes].view(np.int32).tolist() == counts[r].tolist()
                assert np.array_equal(recvs[peer][dst:dst + n], sends[r][src:src + n])
        kinds = {encode_imm(k, r, epoch) for k in (Imm.DISPATCH, Imm.DISPATCH_MORE) for r in range(W)}
        private = [w for w in rec.writes if w["rc"] == 0 and w["imm"] in kinds]
        assert len(private) == W  # one private write each way, count row included
    finally:
        for p in proxies:
            if p is not None:
                p.close()
        for s in segs:
            s.close()
            s.unlink()
        for pair in bufs or []:
            for b in pair:
                b.close()
        for a, b in socks:
            a.close()
            b.close()


def _run(proxy, epoch, errors) -> None:
    try:
        proxy.run_epoch(epoch)
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(exc)


def test_a_layout_whose_largest_write_exceeds_the_bound_is_refused_at_start_up():
    """A write the provider would split (EFA: over 1 GiB) is refused before any call, not posted."""
    lay = A2AConfig(max_num_tokens=64, num_experts=4, experts_per_token=2, hidden_dim=64,
                    in_dtype=torch.float32).layout(2, 1)
    # A private write (count row and P = T*K rows here) or every route to one peer (remainder, combine).
    largest = max(lay.routing_row_bytes + lay.private_rows * lay.dispatch_stride_bytes,
                  lay.max_routes * max(lay.dispatch_stride_bytes, lay.combine_stride_bytes))
    assert largest == lay.routing_row_bytes + lay.max_routes * lay.dispatch_stride_bytes
    proxy = SimpleNamespace(lay=lay, rank=0, engine=SimpleNamespace(max_write_bytes=largest, provider_name="efa"))
    worker.Proxy._check_write_bounds(proxy)
    proxy.engine.max_write_bytes = largest - 1
    with pytest.raises(ValueError, match="more than 'efa' allows in one write"):
        worker.Proxy._check_write_bounds(proxy)
