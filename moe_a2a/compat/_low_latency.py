"""DeepEP's low-latency mode for the facade: `low_latency_dispatch` / `low_latency_combine` and what serves
them, driven by `compat/deep_ep.py`'s `Buffer` (as `compat/_normal.py` serves the normal mode). The sets of
instances, their build and `warm_up` are `compat/_low_latency_sets.py`'s; the slots `compat/_slots.py`'s.

How it is built (docs/compat.md has the table of what matches DeepEP and what differs; `_slots.py` has the
slots, their call's state machine, and the instances' sizes):
- **one set of receive buffers for bf16 and fp8 calls.** The received rows are bf16 rows of H elements
  (2H bytes) plus one 4-byte "scale" column. A bf16 call sends `x` as is. An fp8 call has the dispatch's
  pack kernel quantise `x` (`AllToAll.dispatch(quantize=quant.Fp8Quantize(...))`, `quantize_fp8`'s math
  with DeepEP's `round_scale` / `use_ue8m0` options) straight into each row it sends: fp8 payload in bytes
  [0, H), its scales (fp32, or UE8M0 codes packed four per int32) from byte `round_up(H, 4)` (no separate
  quantisation pass). Those rows travel through an fp8 instance per slot, made at the first fp8 call,
  whose rows carry just these bytes (`A2AConfig.payload_bytes`, about H + H/32): the pack, the wire and
  the unpack stride over half a bf16 row. Its receive half writes the same receive buffers as the bf16
  instance, so `use_fp8` may change from call to call and the extra memory is the fp8 instances' send
  and receive rows, not a second set of outputs. The fp8 `recv_x` of an fp8 call is a view of the received
  rows (`[L, C, H]`, row stride 2H bytes); its scales are in DeepEP's layout (`[L, C, S]`, column-major per
  expert, TMA-aligned: the receive's unpack writes them there, `AllToAll.dispatch(out_quantized_scale=)`).
  (Shrink mode sends fp8 calls in bf16 rows: its instances are all made at construction, when no fp8 call
  has been seen.)
- **calls of other sizes within the Buffer's bounds.** Fewer top-k are padded to what the instances take;
  other (num_max_dispatch_tokens_per_rank, num_experts, hidden) get a set of instances of their own, built
  collectively at their first call (within `num_rdma_bytes`). `warm_up` builds a set's buffers before
  CUDA-graph capture.
- **handle[0] without a copy.** The scale column of every row carries its source token index (int32 bits;
  `AllToAll` moves scales bit-exactly), so the received scale column *is* DeepEP's `src_info`.
  handle[1] (`layout_range`) is written by the receive's unpack, from the count matrix it reads anyway.
- **two calls in flight.** Two slots of `AllToAll` instances used alternately (two micro-batches, two handles
  alive); a call's receive buffers are reused two calls later. A dispatch whose handle is never combined
  (DeepEP's test dispatches twice in a row) is finished by a combine of nothing before its instance is
  reused; a handle combined twice (DeepEP's test does, with and without `zero_copy`) is dispatched
  again first (the same `x`, quantised again for fp8, and routes, so `recv_x` is rewritten with the same
  bytes; `x` must be unchanged for that). In shrink mode that dispatch receives into scratch buffers
  instead (a third set of receive rows, made at the first repeated combine), since a rank masked after
  the handle's dispatch is missing from it: its layout differs from the handle's, and the combine's
  expert outputs, laid out as the handle says, are moved to it (`LowLatencyMode._dispatch_again`).
- **other wires** (`Buffer(wire=)`, docs/compat.md "Over other wires"): the instances' rows are the wire's
  (`_slots.config`). Where the combine is reduced at the experts' rank (`Slot.reduce`) the weights travel with the
  dispatch: the caller's (`Buffer(dispatch_weights=True)`, `topk_weights=`), or zeros, and then each combine finishes
  the call with a combine of nothing and dispatches it again with its weights (`_weights_to_experts`).
- every tensor is created with an explicit device and dtype: nothing depends on torch's defaults.
- input rejected by any call aborts that call on every rank (the peers raise
  `moe_a2a.all_to_all.CallAborted` naming the rank) and the next call works, a bad `handle` to a combine
  included; the first call (which builds the buffers, sized from its arguments) is collective itself: the
  ranks exchange their verdicts, sizes and `use_fp8` first, so if one rank rejects its input, or the
  ranks' sizes or `use_fp8` differ, every rank raises and nothing is built. The first fp8 call of a set
  built by a bf16 call (it builds the fp8 instances) agrees on `use_fp8` too, with host and kernel waits
  (`LowLatencyMode._first_fp8_call`: a rank whose call is bf16 takes part in no collective, so the fp8
  ranks make the call on the bf16 instance with marker rows and abort it at its combine, and every rank
  whose combine of it ends aborted, having received marker rows, then says its `use_fp8`).
- `close()` (or DeepEP's `destroy()`) releases everything; any later call raises ValueError.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..all_to_all import CallAborted, CapacityExceeded, check_combine_recv
from ..fingerprint import all_gather
from ._api import _NO_EVENT, EventOverlap
from ._low_latency_sets import LowLatencySets
from ._slots import COMBINE_SENT as _COMBINE_SENT
from ._slots import COMBINED as _COMBINED
from ._slots import DISPATCH_SENT as _DISPATCH_SENT
from ._slots import DISPATCHED as _DISPATCHED
from ._slots import FREE as _FREE
from ._slots import Slot as _Slot
from ._slots import fits as _fits
from ._slots import fp8_quantize as _fp8_quantize
from ._slots import pad_routes as _pad_routes
from ._slots import set_key as _set_key

_Tensor = torch.Tensor
_FP8_TAG = "moe_a2a.compat first fp8 call"  # the agreement's rows (_agree): another collective's are not
# The source index (scale column) of the first fp8 call's marker rows (`LowLatencyMode._markers`): negative,
# never a token's; the bits of float32 -1.5 (a normal number: moved as it is).
_MARKER = int(torch.tensor(-1.5, dtype=torch.float32).view(torch.int32))
_BF16 = torch.bfloat16
_tuple_new = tuple.__new__  # a NamedTuple's fields without its __new__'s Python frame


def _weights_key(w) -> tuple | None:
    """What a dispatch's `topk_weights` must share with the last accepted call's to take its plan (None: not a
    tensor, never a plan's)."""
    return (w.shape, w.stride(), w.dtype, w.device) if type(w) is _Tensor else None


class Handle(NamedTuple):
    """What `low_latency_dispatch` returns for its combine; indexes as DeepEP's handle.

    Fields (0-4 as DeepEP's):
        src_info: `[L, C]` int32: row i of local expert l is token `src_info[l, i]` of its source rank's
            `x` (rows i < recv_count[l]; later rows are stale).
        layout_range: `[L, W]` int64: `(begin << 32) | count` per (local expert l, source rank s): expert l's
            rows from rank s are rows [begin, begin + count) of its segment (rows are ordered by source
            rank, then token, then top-k slot, so each source's rows are contiguous).
        num_max_dispatch_tokens_per_rank, hidden, num_experts: the call's sizes.
        slot, call: which of the two slots, and the Buffer's call number (a stale handle is refused).
        num_tokens: T of this rank's `x`.

    `src_info` and `layout_range` are views of the slot's buffers, valid (like `recv_x`) until the
    dispatch two calls later.
    """

    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    slot: int
    call: int
    num_tokens: int

    def __repr__(self) -> str:
        return (f"Handle(slot={self.slot}, call={self.call}, num_tokens={self.num_tokens}, "
                f"src_info={list(self.src_info.shape)}, layout_range={list(self.layout_range.shape)})")


def _moved_rows(old: torch.Tensor, new: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Between two layouts of one call's received rows (`layout_range` `[L, W]`: `(begin << 32) | count`
    per local expert and source, expert l's rows from row `l * capacity`): `(src, dst)`, the rows of `old`
    and where `new` has them. A source's rows keep their order (token, then k); a source with fewer rows in
    `new` (a masked one: none) keeps its first ones."""
    L, W = old.shape
    low = (1 << 32) - 1
    ob, oc, nb, nc = (old >> 32).cpu(), (old & low).cpu(), (new >> 32).cpu(), (new & low).cpu()
    n = torch.minimum(oc, nc).flatten()
    cpu = torch.device("cpu")  # explicit: callers (DeepEP's tests) may set another default device
    base = torch.arange(L, dtype=torch.int64, device=cpu)[:, None] * capacity
    seg = torch.repeat_interleave(torch.arange(L * W, device=cpu), n)
    offset = torch.arange(int(n.sum()), dtype=torch.int64, device=cpu) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    src, dst = (base + ob).flatten()[seg] + offset, (base + nb).flatten()[seg] + offset
    return src.to(old.device), dst.to(old.device)


def _move_rows(rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """A new `rows`-shaped tensor whose rows `dst` are `rows[src]`, the others zero (never read)."""
    moved = torch.zeros_like(rows)
    moved[dst] = rows[src]
    return moved


class LowLatencyMode(LowLatencySets):
    """The low-latency calls of one `Buffer`: each call on one of the two alternating slots of its set of
    sizes (building the set at its first call), the receive hooks, a slot's retirement, a handle combined
    again, and shrink mode's mask. `Buffer` checks that it is open and delegates here."""

    # ---- dispatch ---------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                 num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None,
                 dispatch_wait_recv_cost_stats: torch.Tensor | None, use_fp8: bool, round_scale: bool,
                 use_ue8m0: bool, async_finish: bool, return_recv_hook: bool, kwargs: dict,
                 topk_weights: torch.Tensor | None = None):
        """`Buffer.low_latency_dispatch` (its docstring says what it takes and returns)."""
        # The steady state: a call whose arguments `_dispatch_plan` would derive the same plan from as the
        # last call it accepted (the same x and topk_idx shapes, strides and dtype, the same sizes and
        # options; no keywords, no statistics) takes that plan: it was checked then and is what the full
        # path would derive again. Anything else (and every rejected call) takes the full path.
        steady = self._steady
        if steady is not None and type(x) is _Tensor and type(topk_idx) is _Tensor \
                and cumulative_local_expert_recv_stats is None and dispatch_wait_recv_cost_stats is None \
                and not kwargs and use_fp8 is steady[1] and round_scale is steady[2] and use_ue8m0 is steady[3] \
                and type(num_max_dispatch_tokens_per_rank) is int and type(num_experts) is int \
                and steady[0] == (x.shape, x.stride(), x.dtype, topk_idx.shape, num_max_dispatch_tokens_per_rank,
                                  num_experts) \
                and (topk_weights is None if steady[5] is None else _weights_key(topk_weights) == steady[5]):
            error, (key, indices, built, pad, use_fp8, ue8m0, quantize, T, H) = None, steady[4]
            self._last_key = key
        else:
            error, key, indices, built, pad, use_fp8, ue8m0, quantize, T, H = self._dispatch_plan(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, kwargs, topk_weights)
        index = self._next
        self._next = index ^ 1
        self._calls = call = self._calls + 1  # every rank counts every call, aborted ones included
        index = indices[index]  # this set's slot of the alternation
        slot = self._slots[index]
        state = slot.state
        if state != _FREE and state != _COMBINED:
            self._retire(slot)  # the slot's previous call, left unfinished (a combined one is over)
        if use_fp8 and not slot.fp8_outputs:  # the first fp8 call of these sizes: fp8 instances, scale outputs
            if self._agrees_on_fp8(slot):
                self._first_fp8_call(slot, indices, call, error)  # raises unless every rank is here with good input
            else:  # every rank is taken to be in this call with use_fp8 (DeepEP's rule)
                self._build_fp8(indices)
        instances = slot.instances
        slot.a2a = a2a = instances.get(use_fp8) or instances[False]  # no fp8 instance: bf16 rows
        if error is not None:
            # The peers are in this call already: it is aborted on every rank (they raise CallAborted)
            # and the next one works, as with bad input to AllToAll.dispatch.
            a2a.abort(str(error))
        if pad:  # fewer routes per token than the instances take: padded with -1
            topk_idx = _pad_routes(topk_idx, built[2], -1)
        slot.call, slot.T, slot.payload, slot.quantize, slot.ue8m0 = call, T, x, quantize, ue8m0
        slot.stats, slot.combine_args = cumulative_local_expert_recv_stats, None
        try:
            if slot.reduce:  # the weights travel with the rows: the caller's, or zeros until the combine's
                slot.given_weights = topk_weights
                slot.weights = self._scratch_buffers(slot)["w"][:T] if topk_weights is None else \
                    _pad_routes(topk_weights, built[2], 0.0) if pad else topk_weights
            a2a.dispatch(slot.num, slot.ex, slot.exs, x, self._token_ids[T], topk_idx,
                         do_recv=not return_recv_hook, quantize=quantize, out_source_ranges=slot.layout_range,
                         out_quantized_scale=None if return_recv_hook else slot.quantized_scales(),
                         weights=slot.weights)  # (None unless slot.reduce)
        except BaseException:
            slot.free()
            raise
        if return_recv_hook:
            slot.state = _DISPATCH_SENT
            hook = self._hook(slot, call, _Slot.receive_dispatch)
        else:
            slot.received()
            hook = None
        # Handle(src_info, layout_range, num_max, hidden, num_experts, slot, call, num_tokens)
        handle = _tuple_new(Handle, (slot.src_info, slot.layout_range, built[0], H, built[1], index, call, T))
        return slot.recv_x[use_fp8, ue8m0], slot.num, handle, self._event(slot) if async_finish else _NO_EVENT, hook

    def _dispatch_plan(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                       cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                       use_ue8m0, kwargs: dict, topk_weights=None) -> tuple:
        """A dispatch's checks of its own arguments, and the set of instances that serves it (built here at
        the first call of its sizes, collectively): `(error or None, the set's key, its slots' indices, the
        sizes they were built for, whether topk_idx is padded, use_fp8, use_ue8m0, the pack's quantisation,
        x's T and H)`.
        An accepted call of plain arguments leaves its plan in `_steady` for the next call like it."""
        error, sizes, first = None, None, not self._slots
        try:
            if kwargs:
                self._refuse_dispatch_kwargs(kwargs)
            if dispatch_wait_recv_cost_stats is not None:  # its device too once built
                self._check_cost_stats(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
            sizes = self._sizes(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8)
            self._check_dispatch_weights(topk_weights, topk_idx, x.device)
        except ValueError as exc:
            error = exc
        key = _set_key(sizes, x, num_max_dispatch_tokens_per_rank, num_experts)
        if not self._slots or (key is not None and key not in self._sets and not self.enable_shrink):
            # The first call, or the first of other sizes (every rank is in it: DeepEP needs the same
            # num_max_dispatch_tokens_per_rank, hidden and num_experts on every rank): build a set of
            # instances for them. Collective: raises on every rank when any rank cannot build.
            self._build(error, sizes, x, use_fp8)
        indices = self._sets.get(key)
        if indices is None:  # rejected input whose arguments name no set: the call aborts on the last one's
            key = self._last_key
            indices = self._sets[key]
        else:
            self._last_key = key
        built = self._slots[indices[0]].key
        if error is None and not _fits(sizes, built):
            if self.enable_shrink:
                error = ValueError(f"this Buffer was sized by its first dispatch (num_max_dispatch_tokens_per_rank, "
                                   f"num_experts, top-k, hidden) = {self._key}; got {sizes}: use another Buffer")
            else:  # these sizes have instances, built for fewer routes per token
                error = ValueError(f"topk_idx: top-k {sizes[2]} > {built[2]}, the top-k this Buffer's buffers for "
                                   f"(num_max_dispatch_tokens_per_rank, num_experts, hidden) = "
                                   f"{(built[0], built[1], built[3])} were built for (the largest any rank passed "
                                   f"when they were built, and 8 when num_rdma_bytes came from "
                                   f"get_low_latency_rdma_size_hint): build for more with warm_up(..., top_k=) "
                                   f"before the first call of these sizes")
        if error is None and cumulative_local_expert_recv_stats is not None:  # x's device: AllToAll checks it
            try:
                self._check_stats(cumulative_local_expert_recv_stats, self._slots[indices[0]])
            except ValueError as exc:
                error = exc
        if error is None and first and dispatch_wait_recv_cost_stats is not None:  # the device, now known
            try:
                self._check_cost_stats(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
            except ValueError as exc:
                error = exc
        flags = (use_fp8, round_scale, use_ue8m0)
        use_fp8 = bool(use_fp8)
        if error is not None:  # (the call aborts before what follows is needed)
            return error, key, indices, built, False, use_fp8, False, None, 0, 0
        pad = sizes[2] < built[2]
        ue8m0 = use_fp8 and bool(use_ue8m0)
        # fp8: the pack quantises x straight into the rows it sends (fp8 bytes, then the scales).
        quantize = _fp8_quantize(sizes[3], bool(round_scale) or ue8m0, ue8m0) if use_fp8 else None
        plan = (key, indices, built, pad, use_fp8, ue8m0, quantize, *x.shape)
        if not kwargs and cumulative_local_expert_recv_stats is None \
                and dispatch_wait_recv_cost_stats is None and all(type(f) is bool for f in flags) \
                and type(x) is _Tensor and type(topk_idx) is _Tensor:
            self._steady = ((x.shape, x.stride(), x.dtype, topk_idx.shape, num_max_dispatch_tokens_per_rank,
                             num_experts), *flags, plan, None if topk_weights is None else _weights_key(topk_weights))
        return (None, *plan)

    # ---- combine ----------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Handle,
                use_logfmt: bool, zero_copy: bool, async_finish: bool, return_recv_hook: bool,
                out: torch.Tensor | None, combine_wait_recv_cost_stats: torch.Tensor | None, kwargs: dict):
        """`Buffer.low_latency_combine` (its docstring says what it takes and returns)."""
        try:
            slot = self._slot_of(handle)
        except ValueError as exc:
            self._abort_for_handle(handle, exc)  # raises exc, once the call is void on every rank
        given = topk_weights  # as the caller passed it (padded below)
        # Fewer routes per token than the instances take: padded. Shrink mode's buffers are built for the
        # first set's top-k (8); other instances may be built for more routes than this call's (see the
        # dispatch).
        K = self._key[2] if self.enable_shrink else slot.key[2]
        if isinstance(topk_idx, _Tensor) and topk_idx.dim() == 2 and topk_idx.shape[1] < K \
                and isinstance(topk_weights, _Tensor) and topk_weights.dim() == 2 \
                and topk_weights.shape[1] == topk_idx.shape[1]:
            topk_idx, topk_weights = _pad_routes(topk_idx, K, -1), _pad_routes(topk_weights, K, 0.0)
        moved = None  # shrink mode: the rows of the handle's layout that a repeated combine moved
        state = slot.state
        if slot.reduce:  # the weights the experts' ranks apply travel with the dispatch
            if state == _DISPATCH_SENT or state == _COMBINE_SENT:
                slot.settle()
            if (not self.dispatch_weights or slot.state == _COMBINED) and not zero_copy and isinstance(x, _Tensor) \
                    and x.numel() and x.untyped_storage().data_ptr() == slot.ex.untyped_storage().data_ptr():
                x = x.clone()  # expert outputs written into recv_x: its dispatch again would rewrite them
            self._weights_to_experts(slot, topk_idx, topk_weights)
        elif state != _DISPATCHED:
            if state == _DISPATCH_SENT or state == _COMBINE_SENT:
                slot.settle()
            if slot.state == _COMBINED:  # combined before: dispatch the same payload and routes again
                moved = self._dispatch_again(slot, topk_idx)
        a2a, shape = slot.a2a, slot.shape
        H = shape[2]
        if out is None:
            out = torch.empty(slot.T, H, dtype=torch.bfloat16, device=a2a.device)
        y = x
        # The common case in one test; the checks (and their messages) in `_check_combine` otherwise.
        if kwargs or combine_wait_recv_cost_stats is not None or use_logfmt or zero_copy or return_recv_hook \
                or type(x) is not _Tensor or x.shape != shape or x.dtype is not _BF16 or x.device != a2a.device \
                or (slot.reduce and self.dispatch_weights and given is not slot.given_weights):
            try:
                y = self._check_combine(slot, x, topk_idx, topk_weights, use_logfmt, zero_copy, return_recv_hook,
                                        out, combine_wait_recv_cost_stats, kwargs, given)
            except ValueError as exc:
                try:
                    self._run(slot, lambda: a2a.abort(str(exc)))  # aborts this call at its combine on every rank
                except ValueError as aborted:
                    self._combine_aborted(slot, slot.call, str(exc), aborted)
                    raise
        if moved is not None:  # the outputs are in the handle's layout: into the one dispatched again
            expert_y = _move_rows(y.reshape(-1, H), *moved)
        else:  # [L, C, H] as it is when contiguous (AllToAll takes it: no view made a call), else its rows copied
            expert_y = y if y.is_contiguous() else y.reshape(-1, H)
        slot.combine_args = (out, topk_idx, topk_weights, expert_y)
        try:
            a2a.combine(out, topk_idx, topk_weights, expert_y, do_recv=not return_recv_hook)
        except (CallAborted, CapacityExceeded) as exc:
            slot.free()
            self._combine_aborted(slot, slot.call, None, exc)
            raise
        except BaseException:
            slot.free()
            raise
        if return_recv_hook:
            slot.state = _COMBINE_SENT
            return out, self._event(slot) if async_finish else _NO_EVENT, self._hook(slot, slot.call,
                                                                                      _Slot.receive_combine)
        slot.state = _COMBINED
        return out, self._event(slot) if async_finish else _NO_EVENT, None

    def _check_combine(self, slot: _Slot, x, topk_idx, topk_weights, use_logfmt, zero_copy, return_recv_hook,
                       out, combine_wait_recv_cost_stats, kwargs: dict, given=None) -> torch.Tensor:
        """A combine's checks of its own arguments (ValueError): the expert outputs it sends (`x`, or the
        zero-copy buffer). `given`: `topk_weights` as the caller passed it."""
        a2a, shape = slot.a2a, slot.shape
        if slot.reduce and self.dispatch_weights and given is not slot.given_weights:
            sent = slot.given_weights  # the weights the experts' ranks apply: the dispatch's
            if not (isinstance(given, torch.Tensor) and given.shape == sent.shape and given.dtype == sent.dtype
                    and given.device == sent.device and torch.equal(given, sent)):
                raise ValueError(f"topk_weights: over wire {self.wire!r} the combine applies the weights the dispatch "
                                 f"was given (they travel with its rows; Buffer(dispatch_weights=True)): pass that "
                                 f"tensor or equal values, got other ones")
        if kwargs:
            raise ValueError(f"unexpected arguments {sorted(kwargs)}: not arguments of DeepEP's "
                             f"low_latency_combine (SGLang's single-batch overlap passes overlap / "
                             f"comp_signal / src_signals ... for a DeepEP fork: not supported; docs/compat.md)")
        if combine_wait_recv_cost_stats is not None:
            self._check_cost_stats(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats")
        if use_logfmt:
            raise ValueError("use_logfmt=True: LogFMT (DeepEP's 10-bit combine encoding) is not implemented "
                             "by moe_a2a's DeepEP facade: pass use_logfmt=False (the combine sends bf16); "
                             "docs/compat.md")
        if zero_copy:
            if slot.combine_buf is None:
                raise ValueError("zero_copy=True: nothing was written to get_next_low_latency_combine_buffer("
                                 "handle) for this handle (call it, write the expert outputs there, then combine)")
            y = slot.combine_buf
        else:
            y = x
            if not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != torch.bfloat16 \
                    or x.device != a2a.device:
                raise ValueError(f"x: expected {list(shape)} bfloat16 expert outputs on {a2a.device}, got "
                                 f"{(tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if return_recv_hook:  # checked before sending: a receive that cannot run would leave the call open
            check_combine_recv(a2a.cfg, a2a.device, slot.T, out, topk_weights, topk_idx)
        return y

    def next_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """`Buffer.get_next_low_latency_combine_buffer`: the zero-copy combine's buffer of this handle."""
        return self._combine_buffer(self._slot_of(handle))

    # ---- shrink mode: the mask ---------------------------------------------------------------
    def update_mask(self, rank_to_mask: int, mask: bool) -> None:
        """Shrink mode: mask (`mask=True`: nothing is sent to it or awaited from it) or unmask one rank
        on this rank."""
        if self._mask is None:  # before the first dispatch: kept until the instances exist
            if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) \
                    or not 0 <= rank_to_mask < self.group_size or (mask and rank_to_mask == self.rank):
                raise ValueError(f"rank_to_mask: expected a rank in [0, {self.group_size}) other than this rank "
                                 f"({self.rank}) to mask, got {rank_to_mask!r}")
            (self._pending_mask.add if mask else self._pending_mask.discard)(rank_to_mask)
            return
        self._mask.set(rank_to_mask, bool(mask))

    def query_mask(self, mask_status: torch.Tensor) -> None:
        """Shrink mode: write into `mask_status` (`[num_ranks]` int32, any device) 1 for each rank this rank
        has masked, 0 for the others (stream-ordered on a GPU)."""
        if not isinstance(mask_status, torch.Tensor) or tuple(mask_status.shape) != (self.group_size,) \
                or mask_status.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"mask_status: expected an int32 [{self.group_size}] tensor, got "
                             f"{(tuple(mask_status.shape), mask_status.dtype) if isinstance(mask_status, torch.Tensor) else type(mask_status).__name__}")
        if self._mask is None:
            mask_status.zero_()
            for r in self._pending_mask:
                mask_status[r] = 1
        else:
            mask_status.copy_(self._mask.tensor)

    def clean_mask(self) -> None:
        """Shrink mode: unmask every rank (a rank still stopped is masked again by the next wait on it)."""
        self._pending_mask.clear()
        if self._mask is not None:
            self._mask.clear()

    def _empty_call(self) -> None:
        """Shrink mode's `clean_low_latency_buffer`: a call of no tokens on every rank, so that a rank which
        stopped before it is masked by every peer there (as DeepEP's clean does), not at the next call."""
        index, self._next = self._next, self._next ^ 1
        self._calls += 1
        slot = self._slots[index]
        self._retire(slot)
        a2a, s, H = slot.a2a, self._scratch_buffers(), slot.a2a.cfg.hidden_dim
        x = torch.empty(0, H, dtype=torch.bfloat16, device=a2a.device)
        slot.call, slot.T = self._calls, 0
        self._run(slot, lambda: a2a.dispatch(slot.num, slot.ex, slot.exs, x, self._token_ids[0], s["idx"][:0]))
        self._run(slot, lambda: a2a.combine(s["out"][:0], s["idx"][:0], s["w"][:0], slot.ex))
        slot.state = _FREE

    # ---- the calls of a slot ------------------------------------------------------------------
    # (The slot's state machine is `_slots.Slot`'s; these name its steps where the Buffer takes them.)
    @staticmethod
    def _run(slot: _Slot, half) -> None:
        slot.run(half)

    def _weights_to_experts(self, slot: _Slot, topk_idx: torch.Tensor, topk_weights) -> None:
        """Over a wire that reduces the combine at the experts' rank the weights those ranks apply are the ones the
        dispatch sent. `Buffer(dispatch_weights=True)`: the caller's (a handle combined again is dispatched again
        with them). Else the dispatch sent zeros: the call is finished with a combine of nothing and dispatched
        again (the same payload and routes) with the combine's weights. On every rank alike (the Buffer's options
        are the same everywhere). Routes or weights that AllToAll would refuse are left to its checks: a call
        awaiting its combine is then aborted there (the peers' combine of nothing ends aborted too), a combined one
        at its dispatch again (as the peers' dispatch again)."""
        if self.dispatch_weights:
            if slot.state == _COMBINED:
                self._dispatch_again(slot, topk_idx, slot.weights)
            return
        T, K, dev = slot.T, slot.key[2], slot.a2a.device
        if slot.state == _DISPATCHED and isinstance(topk_weights, _Tensor) and topk_weights.dtype == torch.float32 \
                and topk_weights.shape == (T, K) and topk_weights.device == dev \
                and (K <= 1 or topk_weights.stride(1) == 1) and isinstance(topk_idx, _Tensor) \
                and topk_idx.dtype in (torch.int32, torch.int64) and topk_idx.shape == (T, K) \
                and topk_idx.device == dev and topk_idx.is_contiguous():
            s = self._scratch_buffers(slot)
            try:
                self._run(slot, lambda: slot.a2a.combine(s["out"][:T], s["idx"][:T], s["w"][:T], slot.ex))
            except (CallAborted, CapacityExceeded) as exc:  # as the combine's own (the first fp8 call's agreement)
                self._combine_aborted(slot, slot.call, None, exc)
                raise
            slot.state = _COMBINED
        if slot.state == _COMBINED:
            self._dispatch_again(slot, topk_idx, topk_weights)

    def _dispatch_again(self, slot: _Slot, topk_idx: torch.Tensor, weights: torch.Tensor | None = None):
        """A handle combined before is dispatched again (the same payload and routes) before it is combined
        again. Without shrink mode every row lands where it did, rewritten with the same bytes; returns None.

        Shrink mode: a rank masked since the handle's dispatch sends nothing now, so its rows are missing
        and the rows of the sources after it in each expert's segment move up, while the combine's expert
        outputs are laid out as the handle says (DeepEP's zero-copy buffer was filled from its recv_x). So
        this dispatch receives into scratch buffers (the handle, recv_x and recv_count stay as the dispatch
        returned them, as DeepEP's combine leaves them), and when its layout differs from the handle's,
        returns `(src, dst)`: the expert-output rows to move (`_move_rows`); else None."""
        if not self.enable_shrink:
            self._run(slot, lambda: slot.a2a.dispatch(slot.num, slot.ex, slot.exs, slot.payload,
                                                      self._token_ids[slot.T], topk_idx, quantize=slot.quantize,
                                                      out_source_ranges=slot.layout_range,
                                                      out_quantized_scale=slot.quantized_scales(),
                                                      weights=weights))  # (`_weights_to_experts`' with slot.reduce)
            slot.state = _DISPATCHED
            return None
        if self._again is None:  # one set for both slots (shrink mode's instances share a config)
            num, ex, exs = slot.a2a.empty_dispatch_outputs()
            self._again = (num, ex, exs, torch.zeros_like(slot.layout_range))
        num, ex, exs, ranges = self._again
        self._run(slot, lambda: slot.a2a.dispatch(num, ex, exs, slot.payload, self._token_ids[slot.T], topk_idx,
                                                  quantize=slot.quantize, out_source_ranges=ranges))
        slot.state = _DISPATCHED
        if torch.equal(ranges, slot.layout_range):
            return None
        return _moved_rows(slot.layout_range, ranges, slot.shape[1])

    def _retire(self, slot: _Slot) -> None:
        slot.retire(self._scratch_buffers(slot))

    # ---- the first fp8 call of a set: use_fp8 agreed on every rank before its buffers are built ------------
    # Its fp8 instances are built collectively, and a rank whose call is bf16 takes part in no collective: it
    # is in its call on the bf16 instance, and with kernel waits (one GPU per rank) it learns that the call
    # was aborted only at the end of its combine. So an fp8 rank makes that call on the bf16 instance with
    # marker rows (`_markers`: a row to every rank whose source index is `_MARKER`, never a token's), then
    # aborts it at its combine; every rank whose combine of a call on a set without fp8 instances ends
    # aborted (CallAborted, CapacityExceeded, its own combine input rejected) looks for marker rows among the
    # rows it received in that call, and when there are some, it says its call number, use_fp8 and verdict
    # in one tagged all-gather, which the fp8 ranks make after their abort: every rank of the call makes it
    # (a call without fp8 ranks has no marker rows: no rank makes it), so host waits and kernel waits alike
    # meet there. Every rank fp8 with good input: the fp8 instances are built and the call runs on them;
    # else the call is refused on every rank (use_fp8 differing: ValueError naming it on every rank).
    def _agrees_on_fp8(self, slot: _Slot) -> bool:
        """Whether the first fp8 call on `slot`'s set agrees on use_fp8 (the same answer on every rank: it
        depends on the set's sizes only): not in shrink mode, and the marker rows fit in one call."""
        return not self.enable_shrink and not slot.fp8_outputs and slot.fp8 is not None \
            and -(-self.group_size // slot.key[2]) <= slot.key[0]

    def _markers(self, slot: _Slot) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The marker call's x, scale column and routes: ceil(W / K) tokens whose routes reach the first
        local expert of every rank, each row's scale column `_MARKER`."""
        (num_max, E, K, H), W, dev = slot.key, self.group_size, slot.a2a.device
        T = -(-W // K)
        routes = torch.arange(T * K, dtype=torch.int64, device=dev) * (E // W)
        idx = torch.where(routes < E, routes, torch.full_like(routes, -1)).view(T, K)
        scale = torch.full((T, 1), _MARKER, dtype=torch.int32, device=dev).view(torch.float32)
        return torch.zeros(T, H, dtype=torch.bfloat16, device=dev), scale, idx

    def _marked(self, slot: _Slot) -> bool:
        """Whether `slot`'s call received marker rows (some rank made it as the first fp8 call of its set):
        a look at the received rows' source indices (a host read: only after an aborted call)."""
        L, C, _ = slot.shape
        live = torch.arange(C, device=slot.num.device)[None, :] < slot.num.to(torch.int64)[:, None]
        return bool(((slot.src_info == _MARKER) & live).any())

    def _first_fp8_call(self, slot: _Slot, indices: tuple[int, int], call: int, error: ValueError | None) -> None:
        """An fp8 call on a set without fp8 instances: the marker call on the bf16 instance, aborted at its
        combine on every rank, the agreement, then the fp8 instances built (every rank fp8 with good input;
        returns) or a raise. A peer's rejected dispatch input aborts the marker call at its dispatch (host
        waits): CallAborted here, no agreement (nor on the peers, whose dispatch raised)."""
        a2a = slot.instances[False]
        x, scale, idx = self._markers(slot)
        slot.a2a, slot.call, slot.T, slot.quantize, slot.ue8m0 = a2a, call, 0, None, False
        try:
            weights = {"weights": self._scratch_buffers(slot)["w"][:x.shape[0]]} if slot.reduce else {}
            a2a.dispatch(slot.num, slot.ex, slot.exs, x, scale, idx, out_source_ranges=slot.layout_range, **weights)
        except BaseException:
            slot.free()
            raise
        slot.free()
        try:
            a2a.abort(str(error) if error is not None else (
                "use_fp8=True: the first fp8 call of these sizes (every rank says its use_fp8 before the fp8 "
                "buffers are built)"))
        except ValueError as exc:
            self._agree(slot, call, True, None if error is None else str(error), exc)
        self._build_fp8(indices)  # (returned: every rank is in this call with use_fp8 and good input)

    def _combine_aborted(self, slot: _Slot, call: int, error: str | None, exc: Exception) -> None:
        """Call `call` on `slot` (bf16) ended aborted at or after its combine: when an fp8 rank made it the
        first fp8 call of the set (marker rows received), the agreement (raises); else returns (the caller
        raises `exc`)."""
        if self._agrees_on_fp8(slot) and self._marked(slot):
            self._agree(slot, call, False, error, exc)

    def _agree(self, slot: _Slot, call: int, use_fp8: bool, error: str | None, exc: Exception) -> None:
        """Every rank of an aborted call of marker rows says its call number, use_fp8 and verdict (one
        all-gather). Raises ValueError on every rank when use_fp8 differs (or the ranks are out of step);
        else `exc` on a rank whose input was rejected, CallAborted naming the rejecting ranks on the others.
        Returns only when every rank was at the first fp8 call of these sizes with good input."""
        rows = all_gather(self.group, (_FP8_TAG, call, bool(use_fp8), error))
        ours = [isinstance(r, tuple) and len(r) == 4 and r[0] == _FP8_TAG for r in rows]
        if not all(ours) or len({r[1] for r in rows}) != 1:
            said = "; ".join(f"call {r[1]} on rank {i}" if ok else f"another collective on rank {i}"
                             for i, (r, ok) in enumerate(zip(rows, ours)))
            raise ValueError(f"rank {self.rank}: low_latency_dispatch: call {call} (the first fp8 call of its sizes "
                             f"on some rank) was aborted and the ranks are out of step ({said}); refused on every "
                             f"rank") from exc
        flags = [r[2] for r in rows]
        if len(set(flags)) > 1:
            said = "; ".join(f"{f} on rank {i}" for i, f in enumerate(flags))
            raise ValueError(f"rank {self.rank}: low_latency_dispatch: use_fp8 differs between ranks ({said}) at the "
                             f"first fp8 call of these sizes (num_max_dispatch_tokens_per_rank, num_experts, hidden) "
                             f"= {(slot.key[0], slot.key[1], slot.key[3])}: DeepEP needs the same use_fp8 on every "
                             f"rank; call {call} was refused on every rank (nothing was built; the next call "
                             f"works)") from None
        rejected = [i for i, r in enumerate(rows) if r[3] is not None]
        if not all(flags) or self.rank in rejected:
            raise exc
        if rejected:
            raise CallAborted(f"rank {self.rank}: call {call} was aborted by rank {', '.join(map(str, rejected))}: "
                              f"its input was rejected ({rows[rejected[0]][3]}); nothing was built; the next "
                              f"call works") from None

    def _hook(self, slot: _Slot, call: int, receive):
        def hook() -> None:
            """Receive this call's data (a no-op when it was received already)."""
            self.buf._check_open()
            if slot.call != call:
                raise ValueError(f"this hook's call ({call}) was finished and its buffers reused by call "
                                 f"{slot.call}: call hooks before the dispatch two calls later")
            receive(slot)
        return hook

    @staticmethod
    def _event(slot: _Slot) -> EventOverlap:
        """async_finish: an event recorded on the current stream after the call (none on a CPU)."""
        if slot.a2a.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(slot.a2a.device))
            return EventOverlap(event)
        return _NO_EVENT

    def _slot_of(self, handle) -> _Slot:
        if not isinstance(handle, Handle) or not 0 <= handle.slot < len(self._slots):
            what = repr(handle) if handle is None or isinstance(handle, Handle) else (
                f"a {type(handle).__name__}" + (f" of {len(handle)}" if isinstance(handle, (tuple, list)) else ""))
            raise ValueError(f"handle: expected the handle returned by low_latency_dispatch, got {what}")
        slot = self._slots[handle.slot]
        if slot.call != handle.call or slot.state == _FREE:
            raise ValueError(f"handle: call {handle.call} is over (its buffers were reused by a later dispatch, or "
                             f"the call was aborted): combine a handle before the dispatch two calls later")
        return slot

    def _abort_for_handle(self, handle, exc: ValueError) -> None:
        """A combine's handle was refused on this rank: its peers are in the combine of a call with a good
        handle, so abort that call on every rank (this rank raises `exc`, the peers CallAborted naming it),
        as bad combine input does; the next call works. The call is the one the handle names (a stale
        Handle's slot, or the slot whose `src_info` a plain tuple holds) while it awaits its combine, else the
        oldest call awaiting its combine (None, a plain tuple; the call DeepEP's callers combine first).
        With no call awaiting its combine there is none a peer can be in (but a repeated combine): `exc` is
        raised here alone."""
        live = [s for s in self._slots if s.state in (_DISPATCH_SENT, _DISPATCHED)]
        named = None
        if isinstance(handle, Handle) and 0 <= handle.slot < len(self._slots):
            named = self._slots[handle.slot]
        elif isinstance(handle, (tuple, list)) and handle and isinstance(handle[0], torch.Tensor):
            named = next((s for s in self._slots if s.src_info is handle[0]), None)
        slot = named if named in live else min(live, key=lambda s: s.call, default=None)
        if slot is None:
            raise exc
        slot.receive_dispatch()  # as a good handle's combine starts (a hook not called yet)
        try:
            self._run(slot, lambda: slot.a2a.abort(str(exc)))  # aborts the call at its combine on every rank
        except ValueError as aborted:
            self._combine_aborted(slot, slot.call, str(exc), aborted)
            raise
        raise exc  # (abort raised)
