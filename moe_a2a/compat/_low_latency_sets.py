"""The low-latency mode's sets of instances (`compat/_low_latency.py`'s `LowLatencyMode` is built on them):
per set of sizes (num_max_dispatch_tokens_per_rank, num_experts, hidden) the two slots' `AllToAll` instances,
built collectively at a set's first call or by `warm_up` (`_build`, `_build_fp8`), the checks of the sizes
that pick a set, the scratch buffers a combine of nothing uses, `clean`, `check` and `close`.
"""
from __future__ import annotations

import torch

from ..all_to_all import AllToAll, CallAborted, canonical_device
from ..fingerprint import all_gather, differences
from ..runtime.shrink import RankMask
from ._slots import COMBINE_SENT as _COMBINE_SENT
from ._slots import DISPATCH_SENT as _DISPATCH_SENT
from ._slots import Prefixes as _Prefixes
from ._slots import Slot as _Slot
from ._slots import config as _config
from ._slots import fp8_fits
from ._slots import instance_bytes as _instance_bytes
from ._slots import set_key as _set_key

# get_low_latency_rdma_size_hint's answers in this process: (bytes, num_ranks) -> the sizes behind them
# (None when two sizes gave the same bytes), so that shrink mode can build at construction.
_HINTS: dict[tuple[int, int], tuple | None] = {}

# Arguments of other DeepEP versions' low_latency_dispatch that the facade knows (DeepEP's hybrid-ep branch,
# passed by vLLM and SGLang for NVFP4 dispatch).
_NVFP4_ARGS = ("use_nvfp4", "x_global_scale")


class LowLatencySets:
    """The low-latency state of one `Buffer` (`buf`, whose group, sizes and options it reads): its slots, the
    sets of sizes they serve, shrink mode's mask, and the buffers shared by the sets."""

    def __init__(self, buf) -> None:
        self.buf = buf
        self.group, self.rank, self.group_size = buf.group, buf.rank, buf.group_size
        self.num_rdma_bytes, self.enable_shrink = buf.num_rdma_bytes, buf.enable_shrink
        self.wire, self.dispatch_weights = buf.wire, buf.dispatch_weights  # Buffer(wire=, dispatch_weights=)
        self._options = buf._options  # AllToAll's arguments as the Buffer was given them
        self._mask: RankMask | None = None  # shrink mode: made with the instances (on their device)
        self._pending_mask: set[int] = set()  # ranks masked by the caller before that
        self._slots: list[_Slot] = []
        self._key = None  # the sizes of the first set (shrink mode has only that one)
        # Sets of instances by (num_max_dispatch_tokens_per_rank, num_experts, hidden): their two slots'
        # indices in _slots (a call of sizes not built yet builds theirs); the set of the last call.
        self._sets: dict[tuple, tuple[int, int]] = {}
        self._last_key = None
        # The last accepted dispatch's plan, for the next call of the same arguments' signature
        # (`LowLatencyMode.dispatch`): (signature, use_fp8, round_scale, use_ue8m0, plan) or None.
        self._steady = None
        self._next = 0
        self._calls = 0
        self._token_ids: _Prefixes | None = None  # [T, 1]: tokens 0..T-1, the scale column (made at the build)
        self._scratch: dict = {}  # what a combine of nothing sends and receives, per set of sizes
        self._again = None  # shrink mode: what a handle's repeated combine dispatches again into (_dispatch_again)
        self._instance_options: dict = {}  # AllToAll's arguments, from the first call

    def _wire_args(self) -> dict:
        """The Buffer's options every rank must share, as the build's exchange compares them (a rank whose combine
        dispatches again while its peers' does not would be out of step with them)."""
        return {"wire (Buffer(wire=) or MOE_A2A_WIRE)": self.wire, "dispatch_weights": str(self.dispatch_weights)}

    @staticmethod
    def _combine_buffer(slot: _Slot) -> torch.Tensor:
        if slot.combine_buf is None:
            a2a = slot.a2a
            slot.combine_buf = torch.zeros(a2a.layout.num_local_experts, a2a.cfg.expert_capacity,
                                           a2a.cfg.hidden_dim, dtype=torch.bfloat16, device=a2a.device)
        return slot.combine_buf

    def warm_up(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, top_k: int = 8,
                use_fp8: bool = True, zero_copy: bool = False) -> None:
        """`Buffer.warm_up`'s work (its docstring says what it builds; collective)."""
        error = None
        try:
            for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                                ("hidden", hidden), ("num_experts", num_experts), ("top_k", top_k)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
            if use_fp8 and not fp8_fits(hidden):
                raise ValueError(f"use_fp8=True needs an even hidden size >= 4, got hidden {hidden}")
        except ValueError as exc:
            error = exc
        args = {"num_max_dispatch_tokens_per_rank": str(num_max_dispatch_tokens_per_rank), "hidden": str(hidden),
                "num_experts": str(num_experts), "top_k": str(top_k), "use_fp8": str(bool(use_fp8)),
                "zero_copy": str(bool(zero_copy)), **self._wire_args()}
        table = all_gather(self.group, (None if error is None else str(error), args))
        rejected = [(r, err) for r, (err, _) in enumerate(table) if err is not None]
        if rejected:
            raise ValueError(f"warm_up: {rejected[0][1]} (rank {rejected[0][0]}'s arguments; refused on every rank, "
                             f"nothing was built)")
        diff = differences([a for _, a in table])
        if diff:
            raise ValueError(f"rank {self.rank}: warm_up must get the same arguments on every rank; refused on every "
                             f"rank (nothing was built):\n  " + "\n  ".join(diff))
        key = (num_max_dispatch_tokens_per_rank, num_experts, hidden)
        if key not in self._sets:
            if self.enable_shrink:
                raise ValueError(f"warm_up: shrink mode built its buffers at construction for "
                                 f"(num_max_dispatch_tokens_per_rank, num_experts, top-k, hidden) = {self._key}, "
                                 f"got {(num_max_dispatch_tokens_per_rank, num_experts, top_k, hidden)}")
            self._build(None, (num_max_dispatch_tokens_per_rank, num_experts, top_k, hidden), None, bool(use_fp8))
        indices = self._sets[key]
        built = self._slots[indices[0]].key
        if top_k > built[2]:
            raise ValueError(f"warm_up: the buffers for these sizes were built for top-k {built[2]} (by an earlier "
                             f"call), got top_k={top_k}: warm up before the first call of these sizes to build for "
                             f"more")
        if use_fp8:
            self._build_fp8(indices)
        for i in indices:
            slot = self._slots[i]
            self._scratch_buffers(slot)
            if zero_copy:
                self._combine_buffer(slot)

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """`Buffer.clean_low_latency_buffer`'s work (its docstring says what is zeroed)."""
        if not self._slots:
            return
        key = (num_max_dispatch_tokens_per_rank, num_experts, hidden)
        if key not in self._sets:
            built = [(n, h, e) for n, e, h in self._sets]
            raise ValueError(f"clean_low_latency_buffer: this Buffer has buffers for (num_max_dispatch_tokens_per_rank, "
                             f"hidden, num_experts) = {', '.join(map(str, built))}, got "
                             f"{(num_max_dispatch_tokens_per_rank, hidden, num_experts)}")
        slots = [self._slots[i] for i in self._sets[key]]
        if any(s.state in (_DISPATCH_SENT, _COMBINE_SENT) for s in slots):
            raise ValueError("clean_low_latency_buffer: a call's receive hook has not run yet (call it first)")
        for s in slots:
            scales = s.recv_x[True, False][1] if s.fp8_outputs else None
            for t in (s.num, s.ex, s.exs, s.layout_range, s.combine_buf, scales):
                if t is not None:
                    t.zero_()
        if self.enable_shrink:
            self._empty_call()

    def check(self) -> None:
        """`AllToAll.check()` of every instance."""
        for s in self._slots:
            for a2a in s.instances.values():
                a2a.check()

    def close(self) -> None:
        """Stop every instance (their proxies, shared memory)."""
        for s in self._slots:
            for a2a in s.instances.values():
                a2a.close()
        self._slots, self._steady = [], None

    def _scratch_buffers(self, slot: _Slot | None = None) -> dict:
        """What a combine of nothing sends and receives, per set of sizes (`slot`'s; None: the first set)."""
        slot = self._slots[0] if slot is None else slot
        scratch = self._scratch.get(slot.key)
        if scratch is None:
            cfg, dev = slot.a2a.cfg, slot.a2a.device
            T, K, H = cfg.max_num_tokens, cfg.experts_per_token, cfg.hidden_dim
            scratch = self._scratch[slot.key] = {"out": torch.empty(T, H, dtype=torch.bfloat16, device=dev),
                                                 "idx": torch.zeros(T, K, dtype=torch.int64, device=dev),
                                                 "w": torch.zeros(T, K, dtype=torch.float32, device=dev)}
        return scratch

    # ---- checks -------------------------------------------------------------------------------
    @staticmethod
    def _refuse_dispatch_kwargs(kwargs: dict) -> None:
        """Keywords beyond DeepEP's low_latency_dispatch: those of its hybrid-ep branch (NVFP4) that engines
        pass; `use_nvfp4=True` is refused, `x_global_scale` unused without it; other names are unknown."""
        if kwargs.get("use_nvfp4"):
            raise ValueError("use_nvfp4=True: NVFP4 dispatch (DeepEP's hybrid-ep branch) is not supported by "
                             "moe_a2a's DeepEP facade; supported: bf16 (use_fp8=False) and fp8 e4m3 with one fp32 "
                             "scale per 128 elements (use_fp8=True; round_scale, use_ue8m0). vLLM: leave "
                             "VLLM_DEEPEPLL_NVFP4_DISPATCH unset (bf16 dispatch, quantised after); SGLang: a bf16 or "
                             "fp8 DeepEP output dtype; docs/compat.md")
        unknown = [k for k in kwargs if k not in _NVFP4_ARGS]
        if unknown:
            raise ValueError(f"unexpected arguments {unknown}")

    def _check_dispatch_weights(self, w, topk_idx: torch.Tensor, device) -> None:
        """A dispatch's `topk_weights`: required with `Buffer(dispatch_weights=True)`, refused without; a float32
        tensor of `topk_idx`'s shape on x's device, last stride 1."""
        if w is None:
            if self.dispatch_weights:
                raise ValueError("topk_weights: this Buffer was built with dispatch_weights=True: every "
                                 "low_latency_dispatch gives the routes' weights (topk_weights=, float32 like "
                                 "topk_idx)")
            return
        if not self.dispatch_weights:
            raise ValueError("topk_weights: this Buffer takes the routes' weights at the combine (DeepEP's API); build "
                             "it with dispatch_weights=True to give them to the dispatch (over the wires that reduce "
                             "the combine at the experts' rank the combine then sends nothing twice)")
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.shape != topk_idx.shape \
                or w.device != device or (w.dim() == 2 and w.shape[1] > 1 and w.stride(1) != 1):
            got = (tuple(w.shape), w.dtype, str(w.device), w.stride()) if isinstance(w, torch.Tensor) \
                else type(w).__name__
            raise ValueError(f"topk_weights: expected a float32 {list(topk_idx.shape)} tensor on {device} (last stride "
                             f"1), got {got}")

    def _check_cost_stats(self, stats, name: str) -> None:
        """DeepEP's wait-cost statistics: int64 `[num_ranks]`, contiguous, on the device (its extension's
        checks). Accepted and left untouched."""
        dev = self._slots[0].a2a.device if self._slots else None  # before the first call: checked after the build
        W = self.group_size
        if (not isinstance(stats, torch.Tensor) or tuple(stats.shape) != (W,) or stats.dtype != torch.int64
                or not stats.is_contiguous() or (dev is not None and stats.device != dev)):
            raise ValueError(f"{name}: expected an int64 [{W}] contiguous tensor on {dev or 'the device'} "
                             f"(DeepEP's checks; it is left untouched here: per-source wait times are not "
                             f"measured), got "
                             f"{(tuple(stats.shape), stats.dtype, str(stats.device)) if isinstance(stats, torch.Tensor) else type(stats).__name__}")

    @staticmethod
    def _sizes(x, topk_idx, num_max, num_experts, use_fp8: bool) -> tuple:
        """What sizes the buffers: (num_max_dispatch_tokens_per_rank, num_experts, top-k, hidden)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError(f"x: expected a [T, H] bfloat16 tensor, got "
                             f"{(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__}")
        T, H = x.shape
        if H > 1 and x.stride(1) != 1:
            raise ValueError(f"x: expected last stride 1, got strides {x.stride()}")
        if type(num_max) is not int or type(num_experts) is not int:
            for name, value in (("num_max_dispatch_tokens_per_rank", num_max), ("num_experts", num_experts)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{name}: expected an int, got {value!r}")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise ValueError(f"topk_idx: expected a [T, K] tensor, got "
                             f"{tuple(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__}")
        if T > num_max:
            raise ValueError(f"x: {T} tokens > num_max_dispatch_tokens_per_rank ({num_max})")
        if use_fp8 and not fp8_fits(H):
            raise ValueError(f"use_fp8=True needs an even hidden size >= 4 (its fp8 payload and scales travel in "
                             f"the bytes of a bf16 row), got hidden {H}")
        return (num_max, num_experts, topk_idx.shape[1], H)

    def _check_stats(self, stats, slot: _Slot) -> None:
        a2a = slot.a2a
        L = a2a.layout.num_local_experts
        if (not isinstance(stats, torch.Tensor) or tuple(stats.shape) != (L,)
                or stats.dtype not in (torch.int32, torch.int64) or stats.device != a2a.device):
            raise ValueError(f"cumulative_local_expert_recv_stats: expected an int32 [{L}] tensor on {a2a.device}, got "
                             f"{(tuple(stats.shape), stats.dtype, str(stats.device)) if isinstance(stats, torch.Tensor) else type(stats).__name__}")

    def _build(self, error: ValueError | None, sizes: tuple | None, x, use_fp8: bool = False) -> None:
        """The first call, the first call of other sizes, or `warm_up`: build a set of instances (both slots'
        bf16 ones) for `(num_max_dispatch_tokens_per_rank, num_experts, hidden)`, on every rank or on none.

        Every rank first sends its verdict on its own input, its sizes and its `use_fp8` (one all-gather over
        the group): if any rank rejected its input, or the sizes or `use_fp8` differ (an fp8 call also
        builds the fp8 instances, on every rank or on none), every rank raises (the rejecting rank its
        ValueError, the others CallAborted naming it; different sizes or use_fp8: ValueError naming them on
        every rank) and nothing is built, so the next call of these sizes builds on every rank alike.
        Top-k may differ between ranks: the set takes the largest (and 8 when `num_rdma_bytes` is
        `get_low_latency_rdma_size_hint`'s for these sizes); calls with fewer are padded with -1. A set
        after the first must fit `num_rdma_bytes` when one was given (its bytes as that hint counts them),
        as DeepEP serves a call only within its buffer: else ValueError on every rank."""
        first = not self._slots
        cfg = None
        if error is None:
            try:
                num_max, num_experts, top_k, hidden = sizes
                if num_max < 1 or num_experts < 1:
                    raise ValueError(f"num_max_dispatch_tokens_per_rank and num_experts must be >= 1, got "
                                     f"{num_max}, {num_experts}")
                if num_experts % self.group_size:
                    raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks "
                                     f"({self.group_size})")
                cfg = _config(num_max, num_experts, top_k, hidden, self.group_size, self.enable_shrink, wire=self.wire)
                device = self._options["device"] if first else self._instance_options["device"]
                if device is None:  # the first dispatch's x.device (refused here, with the verdict, if not one)
                    device = canonical_device(x.device if x is not None else None)
            except ValueError as exc:
                error = exc
        names = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden (x.shape[1])")
        mine = (None if error is None else str(error),
                None if sizes is None else {n: str(v) for n, v in zip(names, _set_key(sizes, x, 0, 0))},
                bool(use_fp8), None if sizes is None else sizes[2], self._wire_args())
        table = all_gather(self.group, mine)
        rejected = [r for r, row in enumerate(table) if row[0] is not None]
        which, call = ("the Buffer's first", "the first") if first else ("the first of its sizes",
                                                                         "the first of its sizes")
        if error is not None:
            others = [r for r in rejected if r != self.rank]
            raise ValueError(f"{error} (rank {self.rank} aborted this call, {which}, on every rank"
                             + (f", as did rank(s) {others}" if others else "")
                             + ": nothing was built or sent; the next call builds the buffers)") from None
        if rejected:
            raise CallAborted(f"rank {self.rank}: call {self._calls} of this Buffer ({call}: it builds the buffers) "
                              f"was aborted by rank {', '.join(map(str, rejected))}: its input was rejected "
                              f"({table[rejected[0]][0]}); nothing was built or sent; the next call builds the "
                              f"buffers")
        diff = differences([row[1] for row in table])
        if diff:
            raise ValueError(f"rank {self.rank}: the first low_latency_dispatch " + ("" if first else "of new sizes ")
                             + "sizes the buffers and must get the same sizes on every rank; refused on every rank "
                               "(nothing was built or sent):\n  " + "\n  ".join(diff))
        diff = differences([row[4] for row in table])
        if diff:
            raise ValueError(f"rank {self.rank}: the Buffer's wire options must be the same on every rank; refused on "
                             f"every rank (nothing was built or sent):\n  " + "\n  ".join(diff))
        diff = differences([{"use_fp8": str(row[2])} for row in table])
        if diff:
            raise ValueError(f"rank {self.rank}: the first low_latency_dispatch " + ("" if first else "of new sizes ")
                             + f"must get the same use_fp8 on every rank (an fp8 call builds the fp8 buffers, on "
                               f"every rank); refused on every rank (nothing was built or sent; the next call "
                               f"builds the buffers): {diff[0]}")
        top_k = max(row[3] for row in table)
        if _HINTS.get((self.num_rdma_bytes, self.group_size)) == (num_max, num_experts, 8, hidden):
            top_k = max(top_k, 8)  # the bytes the caller reserved: later calls up to top-k 8 are served
        if top_k != sizes[2]:
            cfg = _config(num_max, num_experts, top_k, hidden, self.group_size, self.enable_shrink, wire=self.wire)
        if not first and self.num_rdma_bytes > 0:
            nbytes = _instance_bytes(num_max, hidden, self.group_size, num_experts, top_k)
            if nbytes > self.num_rdma_bytes:
                raise ValueError(
                    f"rank {self.rank}: a low_latency_dispatch of (num_max_dispatch_tokens_per_rank, hidden, "
                    f"num_experts, top-k) = {(num_max, hidden, num_experts, top_k)}, sizes this Buffer has no "
                    f"buffers for, needs {nbytes} bytes (get_low_latency_rdma_size_hint's count) > num_rdma_bytes "
                    f"= {self.num_rdma_bytes}, the Buffer's bound (as DeepEP's buffer); refused on every rank "
                    f"(nothing was built or sent). Buffers for it: "
                    + ", ".join(f"{(n, h, e)}" for n, e, h in self._sets))
        options = dict(self._options, device=device) if first else self._instance_options
        if self.enable_shrink:  # one mask for all instances: a peer masked in one is skipped by the others
            self._mask = RankMask(self.group_size, self.rank, options["device"])
            for r in sorted(self._pending_mask):
                self._mask.set(r, True)
            options["rank_mask"] = self._mask
        built: list[AllToAll] = []
        try:
            # Under torch's stock default device, whatever the caller set (DeepEP's test sets cuda): the
            # construction's host-side tables are CPU tensors. The facade's own tensors name their device.
            with torch.device("cpu"):
                for _ in range(2):
                    built.append(AllToAll(cfg, **options))
            dev = built[0].device
            if self._token_ids is None or self._token_ids.rows.shape[0] < cfg.max_num_tokens:
                self._token_ids = _Prefixes(torch.arange(cfg.max_num_tokens, dtype=torch.int32, device=dev)
                                            .view(torch.float32).view(-1, 1))
            key = (num_max, num_experts, top_k, hidden)
            slots = [_Slot(a2a, key, self._token_ids) for a2a in built]
        except BaseException:
            for a2a in built:
                a2a.close()
            raise
        for slot in slots:  # a combine receive hook's aborted call takes part in the use_fp8 agreement
            slot.on_abort = self._hook_aborted
        n = len(self._slots)
        self._sets[num_max, num_experts, hidden] = (n, n + 1)
        self._slots = self._slots + slots
        if first:
            self._key, self._instance_options, self._last_key = key, options, (num_max, num_experts, hidden)
        if use_fp8:  # every rank said use_fp8 here: its fp8 instances are built with the set (no agreement later)
            self._build_fp8((n, n + 1))

    def _hook_aborted(self, slot: _Slot, exc) -> None:
        """A combine receive hook learnt its call was aborted: the agreement on use_fp8 (`_combine_aborted`)."""
        self._combine_aborted(slot, slot.call, None, exc)

    def _build_fp8(self, indices: tuple[int, int]) -> None:
        """At the first fp8 call of a set's sizes (on every rank: the set's first call, `warm_up`, or a later call
        whose use_fp8 every rank agreed, `LowLatencyMode._first_fp8_call`): each of its slots' fp8 instance, whose rows
        carry the fp8 bytes and scales only (`fp8_payload_bytes`, about half a bf16 row), so that the pack,
        the wire and the unpack of an fp8 call stride over half the bytes. It writes the slot's receive
        buffers (shared with the bf16 instance): what it adds is its send and receive rows, not a second set
        of outputs. Shrink mode builds none (its fp8 calls travel in bf16 rows). Then the slots' scales in
        DeepEP's layout (`_Slot.make_fp8_outputs`)."""
        slots = [self._slots[i] for i in indices]
        num_max, E, K, H = slots[0].key
        if True not in slots[0].instances and not self.enable_shrink and fp8_fits(H):
            cfg = _config(num_max, E, K, H, self.group_size, fp8=True, wire=self.wire)
            built: list[AllToAll] = []
            try:
                with torch.device("cpu"):  # as in _build: the construction's host tables are CPU tensors
                    for _ in slots:
                        built.append(AllToAll(cfg, **self._instance_options))
            except BaseException:
                for a2a in built:
                    a2a.close()
                raise
            for slot, a2a in zip(slots, built):
                slot.instances[True] = a2a
        for slot in slots:
            slot.make_fp8_outputs()
