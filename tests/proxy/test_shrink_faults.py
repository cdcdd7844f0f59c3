"""Issue 44, item 5, at the proxy's loop (in-process: a `Proxy` around a stub engine, no process started).

In shrink mode a write that fails naming its peer (efa's error completion after the SRD timeout, a refused
post) masks that peer's rank and the call goes on: the waits stop awaiting it, the next tables skip it; a
`PeerTimeout` from libfabric (every other row posted) masks every peer it names without re-posting anything.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from moe_a2a.protocol.words import Imm, WriteTable, encode_imm
from moe_a2a.proxy import libfabric as lf
from moe_a2a.proxy.engine import EngineAddress, Peer, PeerTimeout
from moe_a2a.proxy.worker import Proxy

pytestmark = pytest.mark.timeout(30)
W, RANK, EPOCH = 4, 0, 3


class _Engine:
    """What `Proxy` calls of its engine: a live immediate counter, `peer_errors`, `progress` (which runs
    `on_progress` once, as a CQ read that finds an error entry would), `post_table` (scripted)."""

    def __init__(self):
        self.imm_counter, self.peer_errors, self.on_progress, self.posts = {}, {}, None, []
        self.post_results = []

    def progress(self):
        if self.on_progress is not None:
            fn, self.on_progress = self.on_progress, None
            fn()
        return 0

    def post_table(self, grp, src, words, slots, src_base, dst_base, imm=None, skip_empty=False):
        self.posts.append(tuple(slots))
        result = self.post_results.pop(0) if self.post_results else len(slots)
        if isinstance(result, Exception):
            raise result
        return result


def _proxy(shrink: bool = True) -> Proxy:
    p = Proxy.__new__(Proxy)
    p.engine, p.rank, p.primary, p.masked = _Engine(), RANK, False, frozenset()
    p.spec = SimpleNamespace(shrink=shrink, timeout_s=5.0, idle_yield=False, spin_s=0.0)
    p._last_beat, p._in_call = time.monotonic() + 3600, True  # no heartbeat, no sleeping in `_idle`
    p.peers = [q for q in range(W) if q != RANK]
    p.remote, p.node_peers = list(p.peers), []
    p._handles = [Peer(i, EngineAddress("efa", (bytes([q]),)), None) for i, q in enumerate(p.peers)]
    p._rank_of_peer = {id(h): q for h, q in zip(p._handles, p.peers)}
    p._all_slots = {t: tuple((q - 1, 4 * q) for q in p.remote) for t in WriteTable}
    p._slots = p._all_slots
    p.peer_mask = np.zeros(W, np.int64)
    p.data_group = p.data_src = p._table_words = None
    p.send_base = p.recv_base = 0
    return p


def test_an_error_completion_naming_a_peer_masks_it_and_the_wait_goes_on(capsys):
    p = _proxy()
    keys = frozenset(encode_imm(Imm.DISPATCH, q, EPOCH) for q in p.peers)
    for q in (1, 3):  # ranks 1 and 3 deliver; rank 2's write to it fails, its immediate never comes
        p.engine.imm_counter[encode_imm(Imm.DISPATCH, q, EPOCH)] = 1
    err = lf.FabricError("fi_cq_read", -111, "connection aborted", peer=p._handles[1])
    p.engine.on_progress = lambda: p.engine.peer_errors.update({p._handles[1]: err})
    t0 = time.monotonic()
    assert p.wait_peers(EPOCH, "dispatch: count rows", keys) == []
    assert time.monotonic() - t0 < 1  # not the 5 s timeout: the masked peer is not awaited
    assert p.masked == {2} and list(p.peer_mask) == [0, 0, 1, 0] and p.engine.peer_errors == {}
    assert p.engine.imm_counter == {}  # the others' immediates consumed
    assert p._slots[WriteTable.COMBINE] == ((0, 4), (2, 12))  # the next tables skip rank 2
    assert "masked rank(s) [2]: its writes failed: rank 2: fi_cq_read failed" in capsys.readouterr().err
    # a later error naming the same peer, or a peer not of ours, changes nothing
    p.engine.peer_errors.update({p._handles[1]: err, Peer(9, EngineAddress("efa", (b"?",)), None): err})
    p._take_peer_errors()
    assert p.masked == {2} and p.engine.peer_errors == {}


def test_errors_recorded_before_a_table_mask_before_it_is_posted():
    p = _proxy()
    p.engine.peer_errors[p._handles[2]] = lf.FabricError("fi_writemsg", -113, peer=p._handles[2])
    assert p._post_table(WriteTable.PRIVATE) == 2
    assert p.engine.posts == [((0, 4), (1, 8))] and p.masked == {3}


def test_a_peer_timeout_from_libfabric_masks_every_peer_it_names_and_reposts_nothing():
    p = _proxy()
    p.engine.post_results = [PeerTimeout("busy", position=0, positions=(0, 2), posted=1)]
    assert p._post_table(WriteTable.COMBINE) == 1
    assert p.masked == {1, 3} and len(p.engine.posts) == 1
    # the emulated NIC's (rows after the first failing one not tried): those are posted now, as before
    p = _proxy()
    p.engine.post_results = [PeerTimeout("ring full", position=1), 1]
    assert p._post_table(WriteTable.COMBINE) == 2
    assert p.masked == {2} and p.engine.posts == [((0, 4), (1, 8), (2, 12)), ((2, 12),)]


def test_without_shrink_mode_nothing_is_masked():
    p = _proxy(shrink=False)
    p.engine.peer_errors = None  # the engine raises instead (`FabricCarrier._cq_error`)
    p.engine.post_results = [PeerTimeout("busy", position=0, positions=(0,), posted=2)]
    with pytest.raises(PeerTimeout):
        p._post_table(WriteTable.PRIVATE)
    assert p.masked == frozenset()
