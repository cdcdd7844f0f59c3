"""What a rank's kernels and proxies report through the shared segment, turned into exceptions, and the
host's own waits (CPU; ranks sharing a GPU). The words and their codecs are `protocol.words`.

`Status` reads; `AllToAll` decides when (at the start of a call, at the end of a combine, in `check()`).
"""
from __future__ import annotations

import os
import threading
import time
import weakref

from ..protocol import host_atomics
from ..protocol.board import board_ops
from ..protocol.segment import read_error, write_error
from ..protocol.words import (ABORT_EPOCH_SHIFT, ERROR_FAILED, ERROR_TIMEOUT, HALF_FLAGS, Flag, decode_abort,
                              decode_bad_bound_m, decode_bad_index, decode_capacity, decode_wait_status, flag_word)

# How often a rank looks at its own proxy processes: a dead proxy is reported within this (and a kernel
# waiting for one of its flags stops at once, through the ERROR flag). A sleeping thread costs the
# model's launches nothing measurable; a busy-polling one would hold the GIL.
PROXY_WATCH_S = 0.25

# The proxy's waits give up at this fraction of timeout_s (`runtime.wiring` gives it 0.8 x timeout_s), so that
# its message, naming the remote peers it missed, reaches the model before the model's own waits end.
PROXY_TIMEOUT_FRACTION = 0.8


def proxy_timeout_message(msg: str, timeout_s: float) -> str:
    """A proxy's timeout message, with the timeout in force stated: its "timed out after 8s" becomes "timed
    out after 8 s (0.8 x timeout_s=10 s, so the model hears it first)" (said after it when the proxy's
    words differ)."""
    proxy_s = PROXY_TIMEOUT_FRACTION * timeout_s
    why = f"{PROXY_TIMEOUT_FRACTION:g} x timeout_s={timeout_s:g} s, so the model hears it first"
    said = f"timed out after {proxy_s:g}s"
    if said in msg:
        return msg.replace(said, f"timed out after {proxy_s:g} s ({why})", 1)
    return f"{msg} (the proxy's waits end after {proxy_s:g} s: {why})"


# The words of what kernels record that leaves the instance usable (read after every combine).
_CAPACITY, _BAD_BOUND_M, _BAD_INDEX, _ABORTED = (flag_word(f) for f in (Flag.CAPACITY_EXCEEDED, Flag.BAD_BOUND_M,
                                                                         Flag.BAD_INDEX, Flag.ABORTED))


class CallAborted(RuntimeError):
    """A call was aborted on every rank because one rank's input was rejected (that rank raised a
    ValueError). The outputs of that call are void; the instance stays usable and the next call
    proceeds normally on every rank."""


class CapacityExceeded(RuntimeError):
    """An expert of this rank received more rows than `A2AConfig.expert_capacity` in one dispatch: the
    rows past it were not written, and the call was aborted on every rank (its peers raise `CallAborted`
    naming this rank). The instance stays usable; the next call proceeds normally."""


class Status:
    """The host's side of one rank's status words (`w`: the rank's `Wiring`)."""

    def __init__(self, w, cfg) -> None:
        self.w, self.cfg = w, cfg
        self.abort_seen = 0  # the last epoch whose abort this rank has reported (or made)
        self._next_proxy_poll = 0.0
        self.forger = None  # shrink mode (`runtime.shrink`): late node peers are masked, not waited for
        self._call_end = None  # GPU: the event `await_call_end` records after a combine's last kernel

    def enable_shrink(self, mask) -> None:
        """Shrink mode: a host wait that times out on node peers masks them (`mask`, a `RankMask`) and
        goes on; masked peers' words are forged in this rank's sync area before every host wait."""
        from .shrink import Forger

        self.forger = Forger(mask, self.w)

    # ---- fatal: the proxy, a failed kernel wait, capacity -------------------------------------------
    def raise_fatal(self, epoch: int, force: bool = False) -> None:
        """Raise what makes the instance unusable: the proxy's error, a failed GPU wait, a dead proxy. Without `force`, a cheap look first (one numpy gather)."""
        w, flags = self.w, self.w.flags_np
        if not force and not flags[w.alarm_words].any():
            # Nothing raised: only a dead proxy is left to find, and it matters only when calls use it
            # (polled at most every 20 ms: waitpid is a system call).
            if not w.with_proxy or not w.proxies or time.monotonic() < self._next_proxy_poll:
                return
            self._next_proxy_poll = time.monotonic() + 0.02
            dead = self.dead_proxy()
            if dead is not None:
                raise RuntimeError(f"rank {w.rank}: {dead}")
            return
        code = int(flags[flag_word(Flag.ERROR)])
        if code:  # the proxy's message names the remote peers it missed
            msg = read_error(w.segment, w.layout)
            if code == ERROR_TIMEOUT:
                raise TimeoutError(proxy_timeout_message(msg, w.timeout_s))
            raise RuntimeError(msg)
        bad = int(flags[flag_word(Flag.BAD_COUNTS)])
        if bad:
            raise RuntimeError(f"rank {w.rank}: the count row of rank {bad - 1} is corrupt (negative entries, or more "
                               f"than max_num_tokens * experts_per_token = {w.layout.max_routes} routes): nothing was "
                               f"derived from it, and this instance must be rebuilt")
        for _, _, _, status, what in HALF_FLAGS.values():
            failed = decode_wait_status(flags[flag_word(status)], w.node.node_first)
            if failed:
                raise TimeoutError(f"rank {w.rank}: {what}: the GPU wait timed out after timeout_s="
                                   f"{w.timeout_s:g} s; "
                                   f"missing peers {failed[0]}" + (" and the proxy (remote peers)" if failed[1] else ""))
        dead = self.dead_proxy()
        if dead is not None:
            raise RuntimeError(f"rank {w.rank}: {dead}")

    def dead_proxy(self) -> str | None:
        """What to say about the first of this rank's proxy processes that has exited, or None."""
        proxies = self.w.proxies
        for j, h in enumerate(proxies):
            if h.proc.poll() is not None:
                which = f" (proxy {j} of {len(proxies)}, pid {h.proc.pid})" if len(proxies) > 1 else ""
                return f"proxy process exited with code {h.proc.returncode}{which}"
        return None

    def capacity_exceeded(self) -> str | None:
        """What to say of an expert that received more rows than its capacity (the word is cleared:
        said once), or None."""
        w = self.w
        over = decode_capacity(w.flags_np[flag_word(Flag.CAPACITY_EXCEEDED)], w.layout.num_local_experts)
        if not over:
            return None
        w.flags_np[flag_word(Flag.CAPACITY_EXCEEDED)] = 0
        return (f"rank {w.rank}: local expert {over[0]} (expert {w.rank * w.layout.num_local_experts + over[0]}) "
                f"received {over[1]} rows in one dispatch, more than expert_capacity={w.layout.expert_capacity}: "
                f"the rows past it were not written; raise expert_capacity (at most world_size * max_num_tokens "
                f"* experts_per_token rows can arrive)")

    # ---- not fatal: aborted calls, bad indices dropped on the device ---------------------------------
    def await_call_end(self, epoch: int) -> None:
        """GPU, eager: wait until this rank's stream has run the combine's last kernel (an event, polled for
        at most timeout_s: the kernels' own waits end by then), so what they recorded of this call (a peer's
        abort, an expert over capacity, a bad bound_m) is read by the end of this call's `combine` and never
        reaches a later call. Nothing to do on a CPU (kernels have run) or in a CUDA graph capture
        (replays say it through `check()`)."""
        import torch

        if self._call_end is None:
            self._call_end = torch.cuda.Event()
        ev = self._call_end
        ev.record()
        if ev.query():
            return
        deadline, spins = time.monotonic() + self.w.timeout_s, 0
        while not ev.query():
            if self.w.flags_np[flag_word(Flag.ERROR)]:  # the proxy failed: its message says why
                self.raise_fatal(epoch, force=True)
            if time.monotonic() > deadline:
                self.raise_fatal(epoch, force=True)  # a kernel wait that timed out names its missing peers
                raise TimeoutError(f"rank {self.w.rank}: combine receive: its kernels (epoch {epoch}) did not "
                                   f"finish within timeout_s={self.w.timeout_s:g} s")
            spins += 1
            if spins > 1000:
                time.sleep(1e-5)  # a long wait (peers behind): give the cores to them and the proxy

    def raise_recorded(self, epoch: int) -> None:
        """Raise, once each, what kernels recorded that leaves the instance usable: this rank's expert over
        capacity and a bad `bound_m` (the call was aborted on every rank), a peer's abort (CallAborted)
        and an out-of-range index dropped on the GPU (ValueError)."""
        flags = self.w.flags_np
        # The common case, nothing recorded, in four reads (an abort already reported stays in its word).
        if not (flags[_CAPACITY] or flags[_BAD_BOUND_M] or flags[_BAD_INDEX]) \
                and flags[_ABORTED] >> ABORT_EPOCH_SHIFT <= self.abort_seen:
            return
        over = self.capacity_exceeded()
        if over:
            self.abort_seen = max(self.abort_seen, epoch)
            raise CapacityExceeded(f"{over} (epoch <= {epoch}; the call was aborted on every rank, the next "
                                   f"proceeds normally)")
        bound = decode_bad_bound_m(flags[flag_word(Flag.BAD_BOUND_M)])
        if bound is not None:
            flags[flag_word(Flag.BAD_BOUND_M)] = 0
            self.abort_seen = max(self.abort_seen, epoch)
            raise ValueError(f"bound_m: expected a token count in [0, T] on the device, got {bound} (checked on "
                             f"the GPU: rank {self.w.rank} aborted this call, epoch <= {epoch}, on every rank; the "
                             f"next proceeds normally)")
        aborted = decode_abort(flags[flag_word(Flag.ABORTED)])
        if aborted and aborted[0] > self.abort_seen:
            self.abort_seen = aborted[0]
            raise CallAborted(self.aborted_message(aborted[0], [aborted[1]]))
        bad = decode_bad_index(flags[flag_word(Flag.BAD_INDEX)], self.cfg.experts_per_token)
        if bad:
            flags[flag_word(Flag.BAD_INDEX)] = 0
            raise ValueError(f"indices[{bad[0]}, {bad[1]}] of an earlier dispatch (epoch <= {epoch}): expected "
                             f"-1 (not routed) or a value in [0, {self.cfg.num_experts}) (checked on the GPU "
                             f"without a host sync; that route was not sent; the instance stays usable)")

    def aborted_sources(self, epoch: int) -> list[int]:
        """Host waits: the sources whose count row of this call is -1 (others than this rank). With remote
        peers their rows are copied in by the plan kernel: on a GPU, wait for its REMAINDER_PLANNED first."""
        w = self.w
        if w.ready_words is None:
            return []
        if w.with_proxy and w.device.type == "cuda":
            self.host_wait("dispatch_planned", epoch)
        col = w.counts_np[:, 0]
        return [s for s in range(w.layout.world_size) if s != w.rank and col[s] < 0]

    def aborted_message(self, epoch: int, sources: list[int]) -> str:
        lay = self.w.layout
        relayed = getattr(lay, "relay", False) and any(not lay.same_node(s, self.w.rank) for s in sources)
        return (f"rank {self.w.rank}: call {epoch} was aborted by rank {', '.join(map(str, sources))}"
                + (" (or, at its combine, by a rank of its node: a relay passes on its node's aborts)" if relayed else "")
                + ": its input was rejected or one of its experts overflowed expert_capacity (its own error there "
                  "says which); every output of that call is void; the next call proceeds normally")

    # ---- host waits -------------------------------------------------------------------------------
    def host_wait(self, half: str, epoch: int) -> None:
        """Host waits only (CPU, ranks sharing a GPU): poll what the half's kernel would wait for."""
        w = self.w
        if w.ready_words is None:
            return
        flag, delta, _, _, what = HALF_FLAGS[half]
        words = w.ready_words[half.split("_")[0]] if half.endswith(("recv", "relay")) else None
        first, n = w.node.node_first, w.node.node_size
        if self.forger is not None:
            self.forger.apply()
        deadline = time.monotonic() + w.timeout_s
        spins, proxy_extended = 0, False
        while True:
            missing = [p for p in range(first, first + n) if int(words[p]) < epoch] if words is not None else []
            proxy_late = w.with_proxy and int(w.flags_np[flag_word(flag)]) < epoch + delta
            if not missing and not proxy_late:
                if self.forger is not None and w.with_proxy:  # the peers the proxy gave up on in this call
                    self.forger.apply()
                # Re-read what passed with acquire loads: the data the kernel reads next is ordered after
                # them (plain loads are enough on x86, not on Arm).
                if words is not None:
                    at = words.ctypes.data
                    for p in range(first, first + n):
                        host_atomics.load_acquire(at + 8 * p)
                if w.with_proxy:
                    host_atomics.load_acquire(w.flags_np.ctypes.data + 8 * flag_word(flag))
                return
            if w.flags_np[flag_word(Flag.ERROR)]:
                self.raise_fatal(epoch, force=True)
            if time.monotonic() > deadline:
                if self.forger is not None and missing:  # shrink: give up on them, not on the call
                    self.forger.mask.mask(missing, f"{what}: nothing from them for {w.timeout_s:g}s (epoch {epoch})")
                    self.forger.apply()
                    deadline = time.monotonic() + w.timeout_s  # the proxy's own flag, if late, gets its time
                    continue
                if self.forger is not None and proxy_late and not proxy_extended:
                    # Shrink: the proxy masks the remote peers it waits for at 0.8 x timeout and then raises
                    # its flag; a loaded host may see that late: its flag gets one more timeout.
                    proxy_extended, deadline = True, time.monotonic() + w.timeout_s
                    continue
                self.raise_fatal(epoch, force=True)
                raise TimeoutError(f"rank {w.rank}: {what}: timed out after timeout_s={w.timeout_s:g} s "
                                   f"(epoch {epoch}); "
                                   f"missing peers {missing}" + (" and the proxy (remote peers)" if proxy_late else ""))
            spins += 1
            time.sleep(0 if spins < 100 else 1e-4)  # yield: the peers and the proxy need the cores (2 on CI)


class FailureBoard:
    """Where a rank that failed for good says so to every peer: keys under one prefix of the process group's
    own rendezvous store (`torch.distributed`'s default store, below its `PrefixStore`s; no port of our own).
    Posted by the rank's proxy watch when its proxy died, and by its proxy (`post_failure`, no torch) when
    its model process died. Without it a peer learns only from its own timeout, since the dead rank can no
    longer send anything (and shm or EFA never report a vanished peer). One counter, one key per failed rank;
    every rank's proxy watch reads the counter every `PROXY_WATCH_S`. Store errors (the store's host gone,
    the group renewed) end the watching, never the calls: the timeouts remain.

    `address`: the store as a proxy reaches it without torch (`board_ops`), or None (not a FileStore or
    TCPStore, or the writer's probe did not read back through torch's own client)."""

    def __init__(self, store, prefix: str, rank: int, world_size: int, address: tuple | None = None) -> None:
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.address = address
        self.seen = 0

    @classmethod
    def open(cls, group, rank: int, world_size: int) -> "FailureBoard | None":
        """Collective (every rank of `group`, once, at construction): agree on a prefix for this instance.
        None when the group has no store we can reach (then peers learn from their timeouts)."""
        import uuid

        import torch.distributed as dist

        from . import bootstrap

        prefix = "moe_a2a/failures/" + bootstrap.exchange(group, uuid.uuid4().hex)[0] + "/"
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return None
        while isinstance(store, dist.PrefixStore):  # our prefix is unique: the store below serves as well
            store = store.underlying_store
        address = None
        try:
            if isinstance(store, dist.FileStore):
                address = ("file", store.path)
            elif isinstance(store, dist.TCPStore):
                address = ("tcp", store.host, store.port)
            if address is not None:  # the torch-free writer must write what torch's client reads
                probe = f"{prefix}probe/{rank}"
                if board_ops(address, [(probe, None, 1)]) != [1] or store.add(probe, 0) != 1:
                    address = None
        except Exception:  # noqa: BLE001 - another wire format, a store that refuses: no proxy posts
            address = None
        return cls(store, prefix, rank, world_size, address)

    def post(self, reason: str) -> None:
        """This rank has failed for good (its proxy died): tell every peer, with the reason."""
        try:
            self.store.set(f"{self.prefix}rank/{self.rank}", reason)
            self.store.add(f"{self.prefix}count", 1)
        except Exception:  # the store is gone: the peers' timeouts remain
            pass

    def failed_peers(self) -> list[tuple[int, str]] | None:
        """The peers that posted since the last look, with their reasons; None once the store is gone."""
        try:
            count = self.store.add(f"{self.prefix}count", 0)
            if count <= self.seen:
                return []
            self.seen = count
            keys = [f"{self.prefix}rank/{r}" for r in range(self.world_size) if r != self.rank]
            return [(int(k.rsplit("/", 1)[1]), self.store.get(k).decode(errors="replace"))
                    for k in keys if self.store.check([k])]
        except Exception:
            return None


def watch_proxies(a2a, board: FailureBoard | None = None) -> None:
    """Start a daemon thread that raises the ERROR flag, with the reason, when one of the rank's proxy
    processes dies (so a kernel waiting for one of its flags stops at once) and tells the peers through
    `board`; or when a peer says on `board` that it failed for good (its proxy or its model process died:
    every later wait on it would time out). The proxies learn where `board` is, to post their model
    process's death there (`ProxyHandle.tell_board`)."""
    if board is not None and board.address is not None:
        for h in a2a._w.proxies:
            h.tell_board(board.address, board.prefix)
    threading.Thread(target=_watch, args=(weakref.ref(a2a), board), daemon=True,
                     name=f"moe_a2a-proxy-watch-{a2a.rank}").start()


def _watch(ref, board: FailureBoard | None) -> None:
    while True:
        time.sleep(PROXY_WATCH_S)
        a2a = ref()
        if a2a is None:
            return
        with a2a._watch_lock:  # close() takes it before unmapping the segment
            w = a2a._w
            if a2a._closed or not w.proxies or w.flags_np[flag_word(Flag.SHUTDOWN)]:
                return
            dead = a2a._status.dead_proxy()
            if dead is not None:
                if not w.flags_np[flag_word(Flag.ERROR)]:
                    write_error(w.segment, w.layout, ERROR_FAILED, f"rank {a2a.rank}: its {dead}")
                if board is not None:
                    board.post(f"its {dead}")
                return
            failed = board.failed_peers() if board is not None else None
            if failed is None:
                board = None  # the store is gone: keep watching our own proxies only
            elif failed:
                if not w.flags_np[flag_word(Flag.ERROR)]:
                    why = "; ".join(f"rank {r}: {reason}" for r, reason in failed)
                    write_error(w.segment, w.layout, ERROR_FAILED,
                                f"rank {a2a.rank}: a peer failed for good ({why}): every call with it would "
                                f"time out; missing peers {sorted(r for r, _ in failed)}")
                return
        del a2a
