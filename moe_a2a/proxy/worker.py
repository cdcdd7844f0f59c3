"""The proxy process: one per rank (or k, `ProxySpec.shards`), it drives the NIC for that rank's GPU.

Why a process and not a thread: a busy-polling Python thread in the model's process makes every
Triton launch wait for the GIL (5 ms per launch measured on the GPU host, docs/design.md, Measured facts).

The model process and the proxy talk only through flags in the rank's shared segment (epoch
numbers, never reset); the proxy knows buffers, offsets, peers and immediates, never tokens. Where each
write goes the kernels plan (`triton_kernels/write_plan.py`: the write tables in the segment, whose rows
equal `protocol.plan`'s): the proxy reads a table and posts it, nothing more per call.

The proxy carries only what crosses nodes: same-node peers synchronise in the kernels through
mapped memory (triton_kernels/node_sync.py), and without remote peers the proxy only idles. One call
(epoch e) of dispatch + combine, as seen by the proxy of rank r (docs/protocol.md):

    SEND_READY           -> post the PRIVATE table: one write to every remote peer, my count row then
                            my first min(n, P) routes (one range of my send buffer's private staging
                            region), into my private slot there (imm DISPATCH, or DISPATCH_MORE when a
                            remainder follows)
    a private write from every remote peer, the node peers' dispatch_ready (their rows are in my
    sync area)           -> raise COUNT_ROWS_READY (the plan kernel copies the remote count rows out of
                            the private slots' headers, checks them and plans the rest)
    REMAINDER_PLANNED    -> (only when REMAINDER_WRITES > 0) post the REMAINDER table (imm DISPATCH_REMAINDER)
    a remainder from every peer whose private said DISPATCH_MORE -> raise DISPATCH_RECV_READY
    my writes completed  -> raise DISPATCH_WRITES_DONE (the kernels may refill the send buffer)
    COMBINE_SEND_READY   -> post the COMBINE table: each remote source its rows (imm COMBINE)
    all COMBINE imms     -> raise COMBINE_RECV_READY
    my writes completed  -> raise COMBINE_WRITES_DONE

No barrier: dispatch and combine use separate regions, and every peer's next write to us follows,
in causal order, something we sent it after we finished reading what it overwrites.

Several proxies per rank (`AllToAll(proxies=k)`, docs/protocol.md, "Proxy shards"): proxy j carries
only its share of the remote peers, `Layout.proxy_shard` (it posts to them and counts their immediates), so k Python
processes post in parallel; under the relay, whose rail writes are few, each proxy posts its piece of every one
(`Layout.wire_pieces`: NIC j to NIC j). Shard 0, the primary, alone raises the proxy -> GPU flags, each once every
shard has reached that step (`ShardWord`s in the segment); with k = 1 there is nothing to wait for.

Started with `python -m moe_a2a.proxy.worker FD` by `runtime.proxy_handle.ProxyHandle`; this module must not
import torch (the proxy would take seconds to start and hundreds of MB for nothing).
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import NamedTuple

import numpy as np

from ..protocol.segment import Flags, ShardWords, write_error
from ..protocol.words import (ERROR_FAILED, ERROR_TIMEOUT, TRACE_EVENTS, Flag, Imm, ShardWord,
                              WriteTable, decode_imm, encode_abort, encode_imm)
from ..protocol.board import post_failure
from ..protocol.memory import SHAREABLE_BUFFERS, SharedSegment, cuda_primary_context, recv_fds, remove_process_shm_files
from ..protocol.proxy_spec import ProxySpec
from . import libfabric as lf
from .carriers import make_engine, register_gpu_buffers
from .engine import ACCESS_SOURCE, ACCESS_SOURCE_AND_TARGET, ACCESS_TARGET, PeerTimeout



# CQ errors that mean the peer itself is gone (its process died; tcp says so at once, shm never does).
_PEER_GONE = frozenset({"FI_ENOTCONN", "FI_ECONNRESET", "FI_ECONNREFUSED", "FI_ECONNABORTED", "FI_EPIPE",
                        "FI_EHOSTUNREACH", "FI_ENETUNREACH"})


class _Stop(Exception):
    """The owner asked the proxy to exit, or died."""


# Shrink mode: a post retries -FI_EAGAIN for this fraction of the proxy's timeout, then masks the peer.
SHRINK_POST_FRACTION = 0.25


class _EpochImms(NamedTuple):
    """The immediates one call counts (`Proxy._epoch_imms`): what arrives keyed by exact value."""

    private: frozenset   # DISPATCH of every remote peer, once (a DISPATCH_MORE counts for it)
    private_more: dict   # DISPATCH -> DISPATCH_MORE of the same peer
    remainder_of: dict   # DISPATCH -> DISPATCH_REMAINDER of the same peer (awaited after a DISPATCH_MORE)
    combine: frozenset   # COMBINE of every remote peer, once (a COMBINE_ABORTED counts for it)
    combine_aborted: dict  # COMBINE -> COMBINE_ABORTED of the same peer
    combine_aborted_imm: int  # ours, when this rank aborts the call at its combine


def largest_write_bytes(lay) -> int:
    """The most bytes one write of this layout carries: a private write (the count row and the private
    rows) or every route to one peer (dispatch or combine rows)."""
    return max(lay.routing_row_bytes + lay.private_rows * lay.dispatch_stride_bytes,
               max(lay.send_rows * lay.dispatch_stride_bytes, lay.combine_rows * lay.combine_stride_bytes))


class Proxy:
    """The state machine of one rank's proxy (see the module docstring)."""

    def __init__(self, spec: ProxySpec, conn: Connection, sock) -> None:
        self.spec, self.lay, self.rank = spec, spec.layout, spec.rank
        lay, r = self.lay, self.rank
        self.seg = SharedSegment(spec.segment)
        self.flags = Flags(self.seg, lay)
        self.shard, self.shards = spec.shard, spec.shards
        self.primary = spec.shard == 0
        self.shard_words = ShardWords(self.seg, lay)
        own = spec.fd_buffers
        on_gpu = own is not None and own[0] == "cuda"
        if on_gpu:  # libfabric's CUDA set-up runs on the current context: ours, not a new one on GPU 0
            cuda_primary_context(own[1])
        self.engine = make_engine(spec, on_gpu)  # the TransferEngine, over libfabric or the emulated NIC
        if spec.shrink:  # a post blocked on a stopped peer must not hold the live ones past their timeouts
            self.engine.post_timeout_s = SHRINK_POST_FRACTION * spec.timeout_s
            self.engine.peer_errors = {}  # a write that fails naming its peer masks that peer (`_take_peer_errors`)
        # Least access (docs/threat-model.md), never readable remotely. Host-staged, the segment holds the
        # send and recv buffers: the source of our writes and written by peers. With buffers of their own
        # nothing moves through the segment (count rows travel in the private writes): not registered.
        # A registration over the provider's limit (EFA: 2^20 pages, which the staged segment passes at large
        # world sizes and token counts: `moe-a2a doctor`) is made of chunks that overlap by this layout's
        # largest write (or the engine's bound on one write, if smaller): no write ever spans two.
        largest = largest_write_bytes(lay)
        self.region = None
        if own is None:
            self.region = self.engine.register(self.seg.addr, self.seg.nbytes, ACCESS_SOURCE_AND_TARGET,
                                               max_write_bytes=largest)
        self._mapped: list = []
        if own is not None:
            kind, ordinal, send_size, recv_size = own
            fds = recv_fds(sock, 2, spec.timeout_s)
            for fd, size in zip(fds, (send_size, recv_size)):
                self._mapped.append(SHAREABLE_BUFFERS[kind](size, ordinal, fd=fd))
            # The send buffer is only a local source of our writes (no remote access at all); peers
            # write tokens into the recv buffer. GPU memory: by DMA-BUF fd where there is one.
            accesses = (ACCESS_SOURCE, ACCESS_TARGET)
            self.send_region, self.recv_region = (
                register_gpu_buffers(self.engine, self._mapped, accesses, ordinal, largest) if on_gpu else
                (self.engine.register(m.addr, m.size, access, max_write_bytes=largest)
                 for m, access in zip(self._mapped, accesses)))
        # What was registered, and in how many registrations (a chunk each; 1 unless over the provider's
        # limit): reported with "ready" among the engine's facts (`AllToAll.fabric_info`).
        self.registrations = tuple((what, r.nbytes, getattr(r, "chunks", 1)) for what, r in (
            (("segment", self.region),) if own is None else (("send", self.send_region), ("recv", self.recv_region))))
        # Bootstrap: the owner gathers every rank's (address, segment region, segment name, recv
        # buffer region or None) for us.
        conn.send((self.engine.address, self.region.descriptor() if own is None else None,
                   self.recv_region.descriptor() if own is not None else None))
        # node_local: every peer shares memory with us and the kernels synchronise through it, so no
        # call needs the proxy (it only keeps the heartbeat and waits to be stopped).
        table, self.node_local = conn.recv()
        self.peers = [p for p in range(lay.world_size) if p != r]
        # Our share of the remote peers: we post to them and count their immediates (all of them with
        # one proxy). `group` still holds every peer: a peer's position is its rank, less one past ours.
        # With the relay (docs/protocol.md, 3.8) only the remote peers of our rail, and with several proxies
        # all of them: we post and count piece `shard` of each write (`Layout.wire_pieces`).
        self.remote = lay.shard_peers(r, self.shard, self.shards)
        piece = self.shard if lay.wire_pieces > 1 else 0
        self.node_peers = [p for p in lay.node_peers(r) if p != r]
        # The node peers' segments, mapped now (they are unlinked once every process has mapped them): when
        # our model process dies, the primary writes its death into their ERROR words (`report_owner_death`).
        # Not in shrink mode, where a peer that stopped is masked by the timeouts, never an error.
        self._peer_segments: list[tuple[int, SharedSegment]] = []
        if self.primary and not spec.shrink:
            for p in self.node_peers:
                try:
                    self._peer_segments.append((p, SharedSegment(table[p][2])))
                except OSError:  # that peer already gone: its own proxy reports it
                    pass
        self._owner_death_reported = False
        # With the relay a node peer's kernels read what landed at us (and ours what landed at them): the
        # primaries of the node raise COUNT_ROWS_READY and DISPATCH_RECV_READY once every one has its rows.
        self._node_words: list[tuple[int, ShardWords]] = []
        self._relay_segments: list[SharedSegment] = []  # kept mapped while we read their words
        if self.primary and lay.relay:
            for p in self.node_peers:
                self._relay_segments.append(SharedSegment(table[p][2]))
                self._node_words.append((p, ShardWords(self._relay_segments[-1], lay)))
        # Same-node peers' epochs in our sync area: their count rows are in our routing area once
        # their dispatch_ready word reaches the epoch.
        self.node_ready = self.seg.numpy(lay.segment_sync_offset_bytes + lay.dispatch_ready_offset_bytes,
                                         lay.world_size, np.int64)
        self.send_base, self.recv_base = lay.send_offset_bytes, lay.recv_offset_bytes
        self._rank_of_peer: dict[int, int] = {}  # id(engine peer) -> rank, to name a lost connection
        if self.peers:
            handles = self.engine.connect([table[p][0] for p in self.peers])
            self._rank_of_peer = {id(h): p for h, p in reversed(list(zip(handles, self.peers)))}
            # Tokens go from our send buffer to the peers' recv buffers: in the segments when
            # host-staged, else buffers of their own on both ends (every rank agreed on one placement).
            if own is not None:
                self.data_group = self.engine.peer_group(handles, [table[p][3] for p in self.peers])
                self.data_src, self.send_base, self.recv_base = self.send_region, 0, 0
            else:
                self.data_group = self.engine.peer_group(handles, [table[p][1] for p in self.peers])
                self.data_src = self.region
            self._check_write_bounds()
        # The write tables the kernels fill (protocol.words.WriteTable), as int64 words: the proxy reads a
        # row's four words and posts it; `_slots[table]` = (group position, first word of the row) per
        # remote peer of ours, in posting order (computed once: nothing but reading in the hot loop).
        self._table_words = memoryview(self.seg.numpy(lay.write_table_offset_bytes, lay.write_table_bytes // 8,
                                                      np.int64)).cast("B").cast("q")
        self._all_slots = {t: tuple((p - (p > r), lay.write_table_row_word(t, p, piece)) for p in self.remote)
                           for t in (WriteTable.PRIVATE, WriteTable.REMAINDER, WriteTable.COMBINE)}
        self._slots = self._all_slots
        # Shrink mode (docs/protocol.md, section 6, shrink mode): peers masked (word p nonzero) get no write and are not
        # awaited. The model writes the words it decided; this proxy those of peers it timed out on.
        self.peer_mask = self.seg.numpy(lay.peer_mask_offset_bytes, lay.world_size, np.int64)
        self.masked: frozenset[int] = frozenset()
        self.trace = self.seg.numpy(lay.trace_offset_bytes, 2 * len(TRACE_EVENTS), np.int64).reshape(-1, 2)
        self._tracing, self._epoch = False, 0
        self._in_call = False
        self.flags[Flag.PROXY_READY] = 1
        self._last_beat = 0.0

    def mark(self, event: int) -> None:
        """Timestamp a TRACE_EVENTS entry (only when the model asked for tracing: ~0.5 µs each)."""
        if self._tracing:
            self.trace[event] = (self._epoch, time.monotonic_ns())

    # ---- waiting ------------------------------------------------------------------------------
    def _idle(self, since: float) -> None:
        """Progress the CQ (software providers land data only when the target polls) and back off
        to short sleeps after `spin_s`, so many ranks can share a 2-core CI machine. A proxy that has a
        core of its own never sleeps inside a call (between ROUTE_READY and its last flag): a sleep is
        >= 60-100 µs on Linux, more than a whole decode dispatch; between calls it sleeps only after
        `between_calls_spin_s` without one (an idle server)."""
        self.engine.progress()
        if self.engine.peer_errors:  # shrink mode: a write failed naming its peer
            self._take_peer_errors()
        now = time.monotonic()
        if now - self._last_beat > 0.01:
            self._last_beat = now
            if self.primary:  # one writer of the word (a read-modify-write)
                self.flags[Flag.HEARTBEAT] = self.flags[Flag.HEARTBEAT] + 1
            if self.flags[Flag.SHUTDOWN] or os.getppid() != self.spec.parent_pid:
                raise _Stop()
        if self.spec.idle_yield:
            if now - since > self.spec.spin_s:
                time.sleep(min(1e-3, (now - since) / 10))
        elif not self._in_call and now - since > self.spec.between_calls_spin_s:
            time.sleep(min(1e-3, (now - since) / 10))

    def wait_local(self, flag: Flag, epoch: int) -> None:
        """Wait for this rank's model process: no deadline (the model may be busy elsewhere)."""
        start = time.monotonic()
        while self.flags[flag] < epoch:
            self._idle(start)

    def wait_peers(self, epoch: int, what: str, keys: frozenset[int], node_rows: bool = False,
                   alternates: dict[int, int] | None = None) -> list[int]:
        """Wait until each immediate of `keys` (exact values, one each) has arrived and, with `node_rows`, the
        same-node peers' count rows of this epoch (their dispatch_ready words in our sync area); then consume
        them. `alternates` maps a key to another immediate that counts for it (DISPATCH_MORE for DISPATCH,
        COMBINE_ABORTED for COMBINE); returns the keys for which the alternate arrived.

        The hot loop of every phase: the check is set arithmetic on the engine's live counter (C speed,
        0.14 µs a peer against 0.7 for a lookup per key), and only what is still missing is looked at."""
        counter = self.engine.imm_counter
        if self.masked:  # peers masked earlier in this call
            keys = frozenset(k for k in keys if decode_imm(k)[1] not in self.masked)
        arrived = counter.keys()
        missing = set(keys) - arrived
        if alternates and missing:
            back = {a: k for k, a in alternates.items()}
            missing -= {back[a] for a in arrived & back.keys()}
        slow = [p for p in self.node_peers if self.node_ready[p] < epoch and p not in self.masked] if node_rows else []
        if missing or slow:
            start = time.monotonic()
            back = {a: k for k, a in alternates.items()} if alternates else {}
            seen = self.masked
            while True:
                self._idle(start)
                if self.masked is not seen:  # shrink mode: a peer masked meanwhile (its write failed) is not awaited
                    seen = self.masked
                    keys = frozenset(k for k in keys if decode_imm(k)[1] not in seen)
                    missing = {k for k in missing if decode_imm(k)[1] not in seen}
                    slow = [p for p in slow if p not in seen]
                if missing:
                    missing -= arrived
                    if back and missing:
                        missing -= {back[a] for a in arrived & back.keys()}
                if slow:
                    slow = [p for p in slow if self.node_ready[p] < epoch]
                if not missing and not slow:
                    break
                if time.monotonic() - start > self.spec.timeout_s:
                    miss = sorted({decode_imm(i)[1] for i in missing} | set(slow))
                    if not self.spec.shrink:
                        raise TimeoutError(f"rank {self.rank}: {what} (epoch {epoch}) timed out after "
                                           f"{self.spec.timeout_s:g}s; missing peers {miss}")
                    self._mask_peers(miss, f"{what}: nothing from them for {self.spec.timeout_s:g}s (epoch {epoch})")
                    keys = frozenset(k for k in keys if decode_imm(k)[1] not in self.masked)
                    break
        took_alternates = []
        pop = counter.pop
        for k in keys:
            n = pop(k, 0)
            if n:
                if n > 1:  # the same value again (epochs wrap after 65 536 calls): leave the rest counted
                    counter[k] = n - 1
                continue
            a = alternates[k]
            n = pop(a)
            if n > 1:
                counter[a] = n - 1
            took_alternates.append(k)
        return took_alternates

    # ---- posting ------------------------------------------------------------------------------
    def _check_write_bounds(self) -> None:
        """Refuse at start-up a layout whose largest write (a private one, or every route to one peer) is
        more than one write of this provider may carry (`TransferEngine.max_write_bytes`)."""
        lay, bound = self.lay, getattr(self.engine, "max_write_bytes", None)
        largest = largest_write_bytes(lay)
        if bound is not None and largest > bound:
            raise ValueError(f"rank {self.rank}: one write of this layout may carry {largest} B, more than "
                             f"{self.engine.provider_name!r} allows in one write ({bound} B): lower "
                             f"max_num_tokens or experts_per_token")

    def _post_table(self, table: WriteTable, imm: int | None = None) -> int:
        """Post our remote peers' rows of one write table (planned by the kernels); the number posted."""
        if self.engine.peer_errors:  # shrink mode: peers whose writes failed since are not posted to
            self._take_peer_errors()
        slots, posted = self._slots[table], 0
        while True:
            try:
                return posted + self.engine.post_table(self.data_group, self.data_src, self._table_words, slots,
                                                       self.send_base, self.recv_base, imm=imm,
                                                       skip_empty=table == WriteTable.REMAINDER)
            except PeerTimeout as exc:
                if not self.spec.shrink:
                    raise
                # Shrink mode: those peers are masked. libfabric posted every other row (`exc.posted`); the
                # emulated NIC stopped at the first: the rows after it are posted now (those before it were).
                self._mask_peers([q + (q >= self.rank) for q in exc.positions], f"posting to it failed: {exc}")
                if exc.posted is not None:
                    return posted + exc.posted
                at = next(i for i, sl in enumerate(slots) if sl[0] == exc.position)
                slots, posted = slots[at + 1:], posted + at

    def _reached(self, word: ShardWord, epoch: int, what: str) -> None:
        """Publish our step `word` for `epoch`; the primary (and, for ROWS_LANDED, every shard) then
        waits until every other shard has published it too. Nothing to do with one proxy."""
        if self.shards == 1:
            return
        self.shard_words.set(self.shard, word, epoch)
        if not self.primary and word != ShardWord.ROWS_LANDED:
            return
        start = time.monotonic()
        late = [j for j in range(self.shards) if j != self.shard]
        while True:
            late = [j for j in late if self.shard_words.get(j, word) < epoch]
            if not late:
                return
            if self.flags[Flag.ERROR]:  # another shard (or the model's watch on a dead one) reported it
                raise _Stop()
            if time.monotonic() - start > self.spec.timeout_s:
                raise TimeoutError(f"rank {self.rank}: proxy {self.shard}: {what} (epoch {epoch}) timed out after "
                                   f"{self.spec.timeout_s:g}s waiting for this rank's proxies {late} (of "
                                   f"{self.shards})")
            self._idle(start)

    def _node_reached(self, word: ShardWord, epoch: int, what: str) -> None:
        """The relay, primary only: publish our (every shard's) step `word` for `epoch` in our shard-0 line,
        then wait until every node peer's primary has published it too."""
        if not self._node_words:
            return
        self.shard_words.set(0, word, epoch)
        start, late = time.monotonic(), self._node_words
        while True:
            late = [(p, words) for p, words in late if words.get(0, word) < epoch]
            if not late:
                return
            if self.flags[Flag.ERROR]:
                raise _Stop()
            if time.monotonic() - start > self.spec.timeout_s:
                raise TimeoutError(f"rank {self.rank}: {what} (epoch {epoch}) timed out after {self.spec.timeout_s:g}s "
                                   f"waiting for the node's relays {[p for p, _ in late]}")
            self._idle(start)

    def _step_done(self, word: ShardWord, flag: Flag, epoch: int, what: str, stamp: int, node: bool = False) -> None:
        """This shard finished a step of `epoch`: once every shard has (`_reached`), and with `node` every
        node peer's primary (`_node_reached`, the relay), stamp the trace event `stamp` and, on the primary,
        raise the kernels' `flag`. Stamp first: the model reads the trace as soon as it sees the flag."""
        self._reached(word, epoch, what)
        if node and self.primary:
            self._node_reached(word, epoch, what)
        self.mark(stamp)
        if self.primary:
            self.flags[flag] = epoch

    def _count_posted(self, flag: Flag, word: ShardWord, n: int) -> None:
        """Add `n` writes to our cumulative count: the flag for the primary (as with one proxy), our
        shard word for the others (`AllToAll.writes_posted` sums them)."""
        if self.primary:
            self.flags[flag] = self.flags[flag] + n
        else:
            self.shard_words.set(self.shard, word, self.shard_words.get(self.shard, word) + n)

    # ---- one call -------------------------------------------------------------------------------
    def run_epoch(self, e: int) -> None:
        F, mark = Flag, self.mark
        # What depends only on the epoch is ready before the model's routing is: the immediates to count.
        # Where each write goes the kernels planned (the write tables): the proxy reads and posts.
        imms = self._epoch_imms(e)
        self._in_call = False  # between calls the model may compute for long: sleeping is fine
        self.wait_local(F.ROUTE_READY, e)
        self._in_call = True
        if self.spec.shrink and self._read_mask():  # the model wrote this call's mask before its route kernel
            imms = self._epoch_imms(e)
        self._tracing, self._epoch = self.primary and bool(self.flags[F.TRACE]), e  # one trace area: the primary's
        posted = self.engine.writes_posted
        mark(0)  # route_ready_seen
        mark(1)  # private_planned: by the private-plan kernel, before the pack
        self.wait_local(F.SEND_READY, e)
        mark(2)  # send_ready_seen
        # One write to every remote peer: our count row, then our first min(n, P) routes for it, one range
        # of the send buffer (the kernels put both there). A row of -1 (this rank aborted) travels the same way.
        self._post_table(WriteTable.PRIVATE)
        mark(3)  # private_posted
        more = self.wait_peers(e, "dispatch: count rows and private rows", imms.private, node_rows=True,
                               alternates=imms.private_more)
        # The plan kernel needs every row (it copies the remote ones out of the private slots' headers):
        # once the other shards' sources have landed too.
        self._reached(ShardWord.ROWS_LANDED, e, "dispatch: count rows")
        if self.primary:
            self._node_reached(ShardWord.ROWS_LANDED, e, "dispatch: count rows")
            self.flags[F.COUNT_ROWS_READY] = e
        mark(4)  # count_rows_received
        if self.flags[F.REMAINDER_WRITES]:
            self.wait_local(F.REMAINDER_PLANNED, e)
            self._post_table(WriteTable.REMAINDER)
        mark(5)  # remainder_posted
        self._count_posted(F.DISPATCH_WRITES_POSTED, ShardWord.DISPATCH_POSTED, self.engine.writes_posted - posted)
        if more:  # the peers whose private write said a remainder follows
            self.wait_peers(e, "dispatch: tokens", frozenset(imms.remainder_of[i] for i in more))
        self._step_done(ShardWord.DISPATCH_RECV, F.DISPATCH_RECV_READY, e, "dispatch: tokens", 6,  # dispatch_received
                        node=True)
        self.engine.wait_writes()  # our reads of the send buffer are over: the kernels may refill it
        self._step_done(ShardWord.DISPATCH_WRITES_DONE, F.DISPATCH_WRITES_DONE, e, "dispatch: writes done",
                        7)  # dispatch_writes_done
        self.wait_local(F.COMBINE_SEND_READY, e)
        mark(8)  # combine_send_seen
        posted = self.engine.writes_posted
        # The plan kernel wrote the combine table in the dispatch recv half, long before (stream order);
        # this rank aborts the call at its combine: its peers learn it from the immediates' kind.
        self.wait_local(F.REMAINDER_PLANNED, e)
        self._post_table(WriteTable.COMBINE, imm=imms.combine_aborted_imm if self.flags[F.CALL_ABORTED] >= e else None)
        self._count_posted(F.COMBINE_WRITES_POSTED, ShardWord.COMBINE_POSTED, self.engine.writes_posted - posted)
        mark(9)  # combine_posted
        aborted = self.wait_peers(e, "combine: expert outputs", imms.combine, alternates=imms.combine_aborted)
        if aborted:  # before COMBINE_RECV_READY: the model reads it once the flag is up
            self.flags[F.ABORTED] = encode_abort(e, decode_imm(aborted[0])[1])
        self._step_done(ShardWord.COMBINE_RECV, F.COMBINE_RECV_READY, e, "combine: expert outputs",
                        10)  # combine_received
        self.engine.wait_writes()
        self._step_done(ShardWord.COMBINE_WRITES_DONE, F.COMBINE_WRITES_DONE, e, "combine: writes done",
                        11)  # combine_writes_done

    def _read_mask(self) -> bool:
        """Shrink mode: take the masked peers from the segment's words; True when they changed (the
        write-table slots and the immediates to count are then rebuilt without them)."""
        masked = frozenset(p for p in self.peers if self.peer_mask[p])
        if masked == self.masked:
            return False
        self.masked = masked
        self._slots = {t: tuple(sl for p, sl in zip(self.remote, slots) if p not in masked)
                       for t, slots in self._all_slots.items()}
        return True

    def _mask_peers(self, peers, why: str) -> None:
        """Shrink mode: give up on `peers` (a wait on them timed out): say so in the segment's words, which
        the model reads after this call's flags, and stop posting to them and waiting for them."""
        for p in peers:
            self.peer_mask[p] = 1
        self._read_mask()
        print(f"moe_a2a proxy of rank {self.rank}: masked rank(s) {sorted(peers)}: {why}", file=sys.stderr, flush=True)

    def _take_peer_errors(self) -> None:
        """Shrink mode: mask the peers whose writes failed (the engine's `peer_errors`: an error completion
        naming our write to them, a refused post). efa reports a dead peer so after its timeout, where tcp and
        shm keep answering -FI_EAGAIN (masked by `post_timeout_s`)."""
        errors = self.engine.peer_errors
        taken = list(errors.items())
        errors.clear()
        failed = {}
        for peer, err in taken:
            rank = self._rank_of_peer.get(id(peer))
            if rank is not None and rank not in self.masked:
                failed.setdefault(rank, err)
        if failed:
            self._mask_peers(sorted(failed), "its writes failed: " + "; ".join(f"rank {r}: {e}" for r, e in
                                                                                sorted(failed.items())))

    def _epoch_imms(self, e: int) -> "_EpochImms":
        """The immediates of call `e` this proxy counts, keyed by exact value (built between calls)."""
        r, remote = self.rank, [p for p in self.remote if p not in self.masked]
        return _EpochImms(
            private=frozenset(encode_imm(Imm.DISPATCH, p, e) for p in remote),
            private_more={encode_imm(Imm.DISPATCH, p, e): encode_imm(Imm.DISPATCH_MORE, p, e) for p in remote},
            remainder_of={encode_imm(Imm.DISPATCH, p, e): encode_imm(Imm.DISPATCH_REMAINDER, p, e) for p in remote},
            combine=frozenset(encode_imm(Imm.COMBINE, p, e) for p in remote),
            combine_aborted={encode_imm(Imm.COMBINE, p, e): encode_imm(Imm.COMBINE_ABORTED, p, e) for p in remote},
            combine_aborted_imm=encode_imm(Imm.COMBINE_ABORTED, r, e))

    def run(self) -> None:
        if self.node_local:
            while True:
                self._idle(0.0)
        epoch = 1
        while True:
            try:
                self.run_epoch(epoch)
            except PeerTimeout as exc:  # a post to a dead peer: name its rank, as the waits do
                rank = self.peers[exc.position]
                raise TimeoutError(f"rank {self.rank}: posting to rank {rank} (epoch {epoch}) timed out: "
                                   f"{exc}; missing peers [{rank}]") from exc
            except lf.FabricError as exc:  # tcp reports a dead peer as a broken connection: name its rank too
                rank = self._rank_of_peer.get(id(exc.peer)) if exc.peer is not None else None
                if rank is None or exc.errno_name not in _PEER_GONE:
                    raise
                raise TimeoutError(f"rank {self.rank}: the connection to rank {rank} was lost (epoch {epoch}): "
                                   f"{exc}; missing peers [{rank}]") from exc
            epoch += 1

    def report_owner_death(self, conn: Connection) -> None:
        """Our model process died (the kernel's parent-death signal, or its pid gone from our ppid) without
        asking us to stop: tell the peers before we exit, since it cannot, and they would otherwise wait for
        it until their own timeout. The node peers at once (the ERROR word of their segments: their host
        waits, and proxy-involving kernel waits, stop at their next poll), every peer through the failure
        board (their proxy watches read it every 0.25 s), if the model told us where it is. Once, primary
        only; nothing when we were asked to stop (SHUTDOWN)."""
        if self._owner_death_reported or not self.primary or self.flags[Flag.SHUTDOWN]:
            return
        self._owner_death_reported = True
        r, lay = self.rank, self.lay
        why = (f"its model process (pid {self.spec.parent_pid}) died (killed or crashed; its proxy saw it and "
               f"said so before exiting)")
        for p, seg in self._peer_segments:
            try:
                peer = Flags(seg, lay)
                if not peer[Flag.ERROR] and not peer[Flag.SHUTDOWN]:
                    write_error(seg, lay, ERROR_FAILED, f"rank {p}: a peer failed for good (rank {r}: {why}): every "
                                                        f"call with it would time out; missing peers [{r}]")
            except (OSError, ValueError):  # unmapped meanwhile
                pass
        board = None
        try:  # the model sends where the board is after start-up (`ProxyHandle.tell_board`); still buffered
            while conn.poll(0):
                msg = conn.recv()
                if isinstance(msg, tuple) and len(msg) == 3 and msg[0] == "board":
                    board = msg[1:]
        except (EOFError, OSError):
            pass
        if board is not None:
            post_failure(board[0], board[1], r, why)

    def close(self) -> None:
        self.engine.close()
        for mem in self._mapped:
            mem.close()
        for _, seg in self._peer_segments:
            seg.close()
        for seg in self._relay_segments:
            seg.close()


# Set once the proxy runs: what to do first when the owner died (`Proxy.report_owner_death`), and its pid.
_on_owner_death = None
_owner_pid: int | None = None
_PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 5


def _die_with_parent() -> None:
    """Ask the kernel to signal us when the owner dies (Linux), on top of the ppid check: the handler tells
    the peers when the owner is gone (`Proxy.report_owner_death`), removes the provider's regions this
    process made in /dev/shm (`{pid}:*`), since an owner killed outright cannot remove them for us, and
    exits; SIGTERM does the same (without telling anyone while the owner lives). The parent-death signal is
    a real-time one: libfabric's shm provider handles SIGTERM itself (its regions unlinked, then the process
    exits, seen under strace), so a parent-death SIGTERM ended the proxy before our handler could say
    anything."""
    def on_term(signum, frame) -> None:
        if signum == _PARENT_DEATH_SIGNAL:
            # The signal follows the thread that started us: a killed owner's threads end one by one, and we
            # are reparented to the last of them first. Wait for the owner's end; if it does not come, a thread
            # of a live owner ended: keep running (the loop's ppid check still watches, every 10 ms).
            deadline = time.monotonic() + 0.2
            while os.getppid() == _owner_pid and time.monotonic() < deadline:
                time.sleep(0.001)
            if os.getppid() == _owner_pid:
                return
        # Our regions' names first: telling the peers may wait on a store that is going away (a closing
        # cluster), and whoever looks at /dev/shm after the owner's end must not find them.
        remove_process_shm_files(os.getpid(), segments=False)
        try:
            if _on_owner_death is not None and os.getppid() != _owner_pid:  # else a SIGTERM for us alone
                _on_owner_death()
        except BaseException:  # noqa: BLE001 - exiting whatever happens
            pass
        os._exit(1)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(_PARENT_DEATH_SIGNAL, on_term)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, _PARENT_DEATH_SIGNAL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def clear_stale_regions() -> list[str]:
    """Remove libfabric shm regions named with this process's pid. Called before this process opens any
    endpoint: libfabric's shm regions are named by pid, so any `{our pid}:*` is a dead process's that had
    our (recycled) pid and could not clean up, and it would make our endpoint's enable fail with
    -FI_EBUSY."""
    return remove_process_shm_files(os.getpid(), segments=False)


def main(fd: int) -> None:
    _die_with_parent()
    clear_stale_regions()
    conn = Connection(fd)
    sock = socket.socket(fileno=os.dup(fd))  # the same socket, for file descriptors (SCM_RIGHTS)
    spec: ProxySpec = conn.recv()
    if os.getppid() != spec.parent_pid:
        return
    import gc
    import logging

    from . import topology

    proxy = None
    global _on_owner_death, _owner_pid
    try:
        # Pinned before the engine starts, so the threads libfabric starts inherit the CPUs.
        cpus, reason = topology.choose_proxy_cpus(spec.gpu_ordinal, spec.rank, spec.shard, spec.shards,
                                                  spec.cpu_override, spec.gpu_uuid)
        try:
            cpus = topology.pin_current_process(cpus)
        except OSError as exc:  # the kernel refused (a cpuset changed since the model checked): run unpinned
            cpus, reason = sorted(os.sched_getaffinity(0)), f"not pinned: sched_setaffinity({cpus}): {exc}"
        logging.getLogger("moe_a2a.proxy").info("rank %d, proxy %d of %d: %s", spec.rank, spec.shard,
                                                spec.shards, reason)
        proxy = Proxy(spec, conn, sock)
        _owner_pid, _on_owner_death = spec.parent_pid, lambda: proxy.report_owner_death(conn)
        # The loop allocates little and makes no cycles: a collection there would stall a call for ms.
        gc.collect()
        gc.freeze()
        gc.disable()
        fabric = getattr(proxy.engine, "fabric_info", None)
        if fabric is not None:
            fabric = dict(fabric, registrations=proxy.registrations)
        conn.send(("ready", {"cpus": cpus, "reason": reason, "fabric": fabric}))
        proxy.run()
    except _Stop:
        if proxy is not None and os.getppid() != spec.parent_pid:  # the owner died (no parent-death signal)
            proxy.report_owner_death(conn)
    except BaseException as exc:  # report everything: the model process turns it into its error
        code = ERROR_TIMEOUT if isinstance(exc, TimeoutError) else ERROR_FAILED
        who = f"proxy of rank {spec.rank}" + (f" (proxy {spec.shard} of {spec.shards})" if spec.shards > 1 else "")
        msg = str(exc) if isinstance(exc, TimeoutError) else f"{who} failed:\n{traceback.format_exc()}"
        try:
            seg = proxy.seg if proxy else SharedSegment(spec.segment)
            # The first error of the rank's proxies stays (another shard may have reported first).
            if not Flags(seg, spec.layout)[Flag.ERROR]:
                write_error(seg, spec.layout, code, msg)
        finally:
            try:
                conn.send(("error", msg))
            except OSError:
                pass
    finally:
        if proxy is not None:
            proxy.close()



if __name__ == "__main__":
    main(int(sys.argv[1]))
