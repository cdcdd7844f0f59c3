"""The DeepEP facade's slots and sizes (`compat/_low_latency.py`'s `LowLatencyMode`, behind `Buffer`, drives them).

A slot is one of the two alternating micro-batch slots of one set of sizes: its receive buffers (shared by
its `AllToAll` instances, a bf16 one and, from the first fp8 call, an fp8 one), the fp8 scales' copy in
DeepEP's layout, and the state of its current call, from the dispatch to the combine:

    FREE -> DISPATCH_SENT (a receive hook pending) -> DISPATCHED -> COMBINE_SENT (hook pending) -> COMBINED

A handle of a COMBINED call may be combined again (the Buffer dispatches it again first); the slot's next
dispatch `retire`s its call (a dispatch never combined gets a combine of nothing). Between calls the
instance is idle in FREE and COMBINED.

Also here: the instances' sizes (`config`, `instance_bytes`: what `get_low_latency_rdma_size_hint` counts),
the fp8 row format (`fp8_scale_offset`, `fp8_payload_bytes`, `fp8_fits`, `fp8_quantize`) and the rules that
map a call to a set of instances (`set_key`, `fits`, `pad_routes`).
"""
from __future__ import annotations

import functools

import torch

from ..all_to_all import AllToAll, CallAborted, CapacityExceeded
from ..config import A2AConfig, ceil_div, round_up, wire_config
from ..triton_kernels.quant import Fp8Quantize

FP8_BLOCK = 128  # elements per fp8 scale, as DeepEP's

# A slot's call, from its dispatch to its combine (the AllToAll instance is between calls in FREE and
# COMBINED; a handle of a COMBINED call may be combined again).
FREE, DISPATCH_SENT, DISPATCHED, COMBINE_SENT, COMBINED = range(5)


def tma_aligned_tokens(num_tokens: int) -> int:
    """The token stride of a scale column: `num_tokens` rounded up to 16 bytes of 4-byte words (DeepGEMM's
    `get_tma_aligned_size`; DeepEP's C is a multiple of 4 already)."""
    return round_up(num_tokens, 4)


def column_major_scales(num_experts: int, num_tokens: int, num_scales: int, dtype: torch.dtype,
                        device) -> torch.Tensor:
    """An `[L, C, S]` tensor in DeepEP's scale layout: the transpose of a contiguous `[L, S, C4]` tensor cut
    to C tokens (C4 = `tma_aligned_tokens(C)`), strides `(S * C4, 1, C4)`; zero-filled. dtype float32
    (scales) or int32 (packed UE8M0 codes). DeepEP (`csrc/legacy/buffer.hpp`, `low_latency_dispatch`)
    allocates `[L, S, C]` and returns its transpose: the token dimension contiguous, each scale column 16-byte
    aligned, DeepGEMM's MN-major TMA-aligned scale operand. The receive's unpack writes it directly
    (`AllToAll.dispatch(out_quantized_scale=)`)."""
    if dtype not in (torch.float32, torch.int32):
        raise ValueError(f"column_major_scales: dtype must be float32 or int32, got {dtype}")
    C4 = tma_aligned_tokens(num_tokens)
    storage = torch.zeros(num_experts, num_scales, C4, dtype=dtype, device=device)
    return storage[:, :, :num_tokens].transpose(1, 2)


class Prefixes(dict):
    """`prefixes[T]` is `rows[:T]`, a view made once per T (the slice costs a µs on every call)."""

    def __init__(self, rows: torch.Tensor) -> None:
        super().__init__()
        self.rows = rows

    def __missing__(self, T: int) -> torch.Tensor:
        view = self[T] = self.rows[:T]
        return view


def fits(sizes: tuple, key: tuple) -> bool:
    """A call's sizes fit buffers built for `key`: the same num_max_dispatch_tokens_per_rank, num_experts and
    hidden, top-k up to the key's (fewer are padded with -1)."""
    return sizes[0] == key[0] and sizes[1] == key[1] and sizes[3] == key[3] and sizes[2] <= key[2]


def set_key(sizes: tuple | None, x, num_max, num_experts) -> tuple | None:
    """Which set of instances serves a call: `(num_max_dispatch_tokens_per_rank, num_experts, hidden)`, from
    its checked sizes or, for rejected input, from its arguments as far as they say (None when they do not)."""
    if sizes is not None:
        return sizes[0], sizes[1], sizes[3]
    if isinstance(x, torch.Tensor) and x.dim() == 2 and type(num_max) is int and type(num_experts) is int:
        return num_max, num_experts, x.shape[1]
    return None


def pad_routes(t: torch.Tensor, K: int, fill) -> torch.Tensor:
    """`[T, k]` -> `[T, K]` with `fill` in the new columns (shrink mode's buffers are built for top-k 8)."""
    if t.shape[1] == K:
        return t
    return torch.cat([t, torch.full((t.shape[0], K - t.shape[1]), fill, dtype=t.dtype, device=t.device)], dim=1)


def config(num_max: int, num_experts: int, top_k: int, hidden: int, num_ranks: int,
            shrink: bool = False, fp8: bool = False, wire: str = "per_route") -> A2AConfig:
    """The instances' sizes: bf16 rows of `hidden` plus one 4-byte column (the source token index),
    capacity `num_max * num_ranks` per local expert. `fp8`: the fp8 instances' rows carry only an fp8
    call's payload and fp32 scales (`fp8_payload_bytes`) instead of 2H bytes. Shrink mode: a private
    region that holds every route of a pair (no shared remainder region). `wire`: how the rows travel
    (`config.wire_config`; the Buffer's `wire=`)."""
    cfg = A2AConfig(max_num_tokens=num_max, num_experts=num_experts, experts_per_token=top_k, hidden_dim=hidden,
                    in_dtype=torch.bfloat16, scale_block=hidden, out_dtype=torch.bfloat16,
                    expert_capacity=num_max * num_ranks, max_private_tokens=num_max * top_k if shrink else None,
                    payload_bytes=fp8_payload_bytes(hidden) if fp8 else None)
    return cfg if wire == "per_route" else wire_config(cfg, wire)


def instance_bytes(num_max: int, hidden: int, num_ranks: int, num_experts: int, top_k: int) -> int:
    """Bytes of one set's instances on one rank: two bf16 ones and (when fp8 fits) two fp8 ones, of per-route rows
    (what `get_low_latency_rdma_size_hint`, a static method, counts whatever the Buffer's wire)."""
    nbytes = 0
    for fp8 in (False, True) if fp8_fits(hidden) else (False,):
        lay = config(num_max, num_experts, top_k, hidden, num_ranks, fp8=fp8).layout(num_ranks)
        nbytes += 2 * (lay.send_bytes + lay.recv_bytes + lay.segment_bytes(False))
    return nbytes


def fp8_scale_offset(hidden: int) -> int:
    """Byte of an fp8 call's row where its scales start (after the H bytes of fp8 payload)."""
    return round_up(hidden, 4)


def fp8_payload_bytes(hidden: int) -> int:
    """Bytes of an fp8 call's row: fp8 payload, then fp32 scales (UE8M0 codes take fewer)."""
    return fp8_quantize(hidden, False, False).row_bytes(hidden)


@functools.lru_cache(maxsize=None)
def fp8_quantize(hidden: int, round_scale: bool, ue8m0: bool) -> Fp8Quantize:
    """An fp8 call's fused quantisation (one object per option set: a launch is remembered by it)."""
    return Fp8Quantize(scale_offset_bytes=fp8_scale_offset(hidden), block=FP8_BLOCK, round_scale=round_scale,
                       ue8m0=ue8m0)


@functools.lru_cache(maxsize=None)
def fp8_fits(hidden: int) -> bool:
    """An fp8 call's payload and fp32 scales fit in the bytes of a bf16 row (any even H >= 4), at
    4-byte-aligned offsets."""
    return hidden % 2 == 0 and fp8_payload_bytes(hidden) <= 2 * hidden


class Slot:
    """One of the two alternating micro-batch slots of one set of sizes: its receive buffers, its `AllToAll`
    instances (bf16 rows, and fp8 rows from the first fp8 call), and its current call."""

    def __init__(self, a2a: AllToAll, key: tuple, token_ids: Prefixes) -> None:
        # By use_fp8 (without an fp8 one, fp8 calls use bf16 rows); `a2a` is the current call's.
        self.instances: dict[bool, AllToAll] = {False: a2a}
        self.a2a = a2a
        # The sizes it was built for: (num_max_dispatch_tokens_per_rank, num_experts, top-k, hidden).
        self.key = key
        self.token_ids = token_ids  # [T, 1] views of tokens 0..T-1: the scale column a dispatch sends
        cfg, lay, dev = a2a.cfg, a2a.layout, a2a.device
        # The combine reduced at the experts' rank (Buffer(wire=) "sender_reduced*", "relay*"): the routes'
        # weights travel with the dispatch (`AllToAll.dispatch(weights=)`).
        self.reduce = cfg.combine_rows == "rank"
        L, C, H, W = lay.num_local_experts, cfg.expert_capacity, cfg.hidden_dim, a2a.world_size
        # Shared by the instances (their receive halves write here): int32 [L]; bf16 [L*C, H]; f32 [L*C, 1].
        self.num, self.ex, self.exs = a2a.empty_dispatch_outputs()
        self.shape = (L, C, H)
        self.src_info = self.exs.view(torch.int32).view(L, C)
        self.layout_range = torch.zeros(L, W, dtype=torch.int64, device=dev)
        # What a dispatch returns as recv_x, by (use_fp8, use_ue8m0): views of the received rows. An fp8
        # call's bytes are in them as its pack wrote them (it quantises x into the rows it sends).
        self.recv_x = {(False, False): self.ex.view(L, C, H)}
        # fp8 calls: recv_x's scales in DeepEP's layout (column-major per expert, TMA-aligned; made at the
        # first fp8 call, `make_fp8_outputs`), written by the receive's unpack itself (`quantized_scales`).
        self.fp8_outputs = False
        self.fp8 = None
        if fp8_fits(H):
            self.fp8 = self.ex.view(torch.uint8)[:, :H].view(torch.float8_e4m3fn).view(L, C, H)
        self.ue8m0 = False        # the current call's scale format (which view of the scales it writes)
        self.combine_buf: torch.Tensor | None = None  # get_next_low_latency_combine_buffer, made on first use
        # The current call.
        self.state, self.call = FREE, -1
        self.T = 0
        self.payload = None       # [T, H] bf16 the dispatch's x (a repeated combine sends it again)
        self.quantize = None      # fp8 call: the pack's fused quantisation (quant.Fp8Quantize), else None
        self.stats = None         # cumulative_local_expert_recv_stats, added to at the receive
        self.combine_args = None  # (out, topk_idx, topk_weights, expert_y) of a combine sent, not received
        # With `reduce`: the [T, K] weights the dispatch sent (padded; placeholder zeros when the Buffer takes them
        # at the combine), and the tensor the caller gave the dispatch (None: none given).
        self.weights = None
        self.given_weights = None
        # Called with (slot, exception) when a combine receive hook's call ends aborted (CallAborted,
        # CapacityExceeded): the Buffer's agreement on use_fp8 at a set's first fp8 call
        # (LowLatencyMode._combine_aborted); it raises, or returns to let the exception go on.
        self.on_abort = None
        self._register(a2a)

    def _register(self, a2a: AllToAll, scales: torch.Tensor | None = None, quantize=None) -> None:
        """Tell `a2a` these receive buffers are the slot's own: checked once, not at every dispatch."""
        try:
            a2a.register_dispatch_outputs(self.num, self.ex, self.exs, self.layout_range, scales, quantize)
        except ValueError:  # a combination a dispatch refuses: each call then checks (and says) it
            pass

    def free(self) -> None:
        """The call ended (an exception in one of its halves ends it on every rank): the slot is free."""
        self.state, self.combine_args = FREE, None

    def make_fp8_outputs(self) -> None:
        """The scales' destination in DeepEP's layout (`column_major_scales`, shared by the fp32
        and UE8M0 formats: an int32 view of the first `[L, S4, C]` words), and fp8 recv_x returning it."""
        if self.fp8_outputs or self.fp8 is None:
            return
        L, C, H = self.shape
        S = ceil_div(H, FP8_BLOCK)
        S4 = ceil_div(S, 4)
        fp32 = column_major_scales(L, C, S, torch.float32, self.a2a.device)
        C4 = fp32.stride(2)
        # UE8M0 words: strides (S4 * C4, 1, C4) over the same storage (DeepEP's layout for S4 columns).
        ue8m0 = fp32.view(torch.int32).as_strided((L, C, S4), (S4 * C4, 1, C4))
        self.recv_x[True, False] = (self.fp8, fp32)
        self.recv_x[True, True] = (self.fp8, ue8m0)
        self.fp8_outputs = True
        a2a = self.instances.get(True) or self.instances[False]  # what an fp8 call uses
        for round_scale, ue8m0 in ((False, False), (True, False), (True, True)):  # the plan's quantisations
            self._register(a2a, self.recv_x[True, ue8m0][1], fp8_quantize(H, round_scale, ue8m0))

    def quantized_scales(self) -> torch.Tensor | None:
        """Where the current call's receive writes its fp8 scales (`AllToAll.dispatch(out_quantized_scale=)`):
        DeepEP's layout, fp32 or UE8M0 words; None for a bf16 call."""
        return self.recv_x[True, self.ue8m0][1] if self.quantize is not None else None

    # ---- the call's halves and its state ----------------------------------------------------------
    def run(self, half) -> None:
        """One half of this slot's `AllToAll` call. An exception ends the call (on every rank, for the
        ValueError, CallAborted and CapacityExceeded that leave the instance usable): the slot is free.
        (Buffer.low_latency_dispatch and low_latency_combine inline this for their own halves.)"""
        try:
            half()
        except BaseException:
            self.free()
            raise

    def received(self) -> None:
        """After the dispatch's receive half (whose unpack wrote handle[1] and an fp8 call's scales in
        DeepEP's layout): the caller's statistics."""
        self.state = DISPATCHED
        if self.stats is not None:
            self.stats.add_(self.num)

    def receive_dispatch(self) -> None:
        """The dispatch's receive half, if a hook has not run it yet."""
        if self.state == DISPATCH_SENT:
            T = self.T
            self.run(lambda: self.a2a.dispatch(self.num, self.ex, self.exs, self.payload, self.token_ids[T], None,
                                               do_send=False, out_source_ranges=self.layout_range,
                                               out_quantized_scale=self.quantized_scales()))
            self.received()

    def receive_combine(self) -> None:
        """The combine's receive half, if a hook has not run it yet."""
        if self.state == COMBINE_SENT:
            out, idx, w, y = self.combine_args
            try:
                self.run(lambda: self.a2a.combine(out, idx, w, y, do_send=False))
            except (CallAborted, CapacityExceeded) as exc:
                if self.on_abort is not None:
                    self.on_abort(self, exc)
                raise
            self.state, self.combine_args = COMBINED, None

    def settle(self) -> None:
        """Run the receive half a hook has not run yet (its data is then in place when the hook runs)."""
        self.receive_dispatch()
        self.receive_combine()

    def retire(self, scratch: dict) -> None:
        """Before the slot's next dispatch: finish its call. A dispatch never combined gets a combine of
        nothing (zero weights into `scratch` rows: every rank does it, as every rank skipped that combine)."""
        if self.state == DISPATCH_SENT or self.state == COMBINE_SENT:
            self.settle()
        if self.state == DISPATCHED:
            T = self.T
            self.run(lambda: self.a2a.combine(scratch["out"][:T], scratch["idx"][:T], scratch["w"][:T], self.ex))
        self.state, self.payload, self.stats, self.combine_args = FREE, None, None, None
        self.weights = self.given_weights = None
