"""Timestamps of every call, model halves and proxy steps, for `AllToAll.set_tracing` / `trace`.

Off by default and free when off. When on, each half is stamped at its start and end on the stream (GPU:
a one-program kernel reading %globaltimer, mapped to CLOCK_MONOTONIC by a calibration; CPU: the host
clock), and the proxy stamps each of its steps (`protocol.words.TRACE_EVENTS`).
"""
from __future__ import annotations

import time

import torch

from ..protocol.words import MODEL_TRACE_EVENTS, TRACE_EVENTS, Flag, flag_word
from ..triton_kernels import sync


class Tracer:
    def __init__(self, w) -> None:
        self.w, self.on, self.clock_offset_ns = w, False, None

    def set(self, on: bool) -> None:
        w = self.w
        self.on = bool(on)
        if self.on and w.device.type == "cuda" and self.clock_offset_ns is None:
            torch.cuda.synchronize(w.device)
            self.clock_offset_ns = sync.gpu_clock_offset_ns(w.model_trace, w.model_trace_host,
                                                            w.layout.clock_calibration_word)
        w.flags_host[flag_word(Flag.TRACE)] = int(on)

    def run(self, name: str, epoch: int, fn, *args) -> None:
        """`fn(*args)`, stamped as the half `name` when tracing."""
        if not self.on:
            fn(*args)
            return
        index = 4 * MODEL_TRACE_EVENTS.index(name)
        # dispatch_send advances the call's epoch itself: its start stamp names the coming one.
        self._stamp(index, 1 if name == "dispatch_send" else 0, epoch)
        fn(*args)
        self._stamp(index + 2, 0, epoch + (1 if name == "dispatch_send" else 0))

    def _stamp(self, index: int, ahead: int, epoch: int) -> None:
        w = self.w
        if w.device.type == "cuda":
            sync.stamp_time(w.model_trace, index, ahead, epoch=w.epoch_dev)
        else:
            sync.stamp_time(w.model_trace, index, epoch + ahead)

    def last(self, epoch: int, latest: bool, node_local: bool, busy) -> dict:
        """The last traced call (see `AllToAll.trace`); `busy()` says whether the proxy may still be
        finishing the call's last step."""
        w = self.w
        if w.device.type == "cuda":
            torch.cuda.synchronize(w.device)  # the end stamps are written by the stream
        # The proxy's last step (its combine writes completing) may finish after combine returns.
        deadline = time.monotonic() + w.timeout_s
        while busy() and time.monotonic() < deadline and \
                int(w.flags_np[flag_word(Flag.COMBINE_WRITES_DONE)]) < epoch:
            time.sleep(1e-4)
        stamps = w.model_trace_host[: w.layout.clock_calibration_word].reshape(-1, 2, 2).tolist()
        epoch = max(e0 for (e0, _), _ in stamps) if latest else epoch
        raw = w.segment.numpy(w.layout.trace_offset_bytes, 2 * len(TRACE_EVENTS), "int64").reshape(-1, 2)
        proxy = {name: int(t) for name, (e, t) in zip(TRACE_EVENTS, raw) if e == epoch}
        offset = self.clock_offset_ns or 0
        model = {name: (t0 + offset, t1 + offset) for name, ((e0, t0), (e1, t1)) in zip(MODEL_TRACE_EVENTS, stamps)
                 if e0 == e1 == epoch}
        return {"rank": w.rank, "epoch": epoch, "node_local": node_local, "model": model, "proxy": proxy}
