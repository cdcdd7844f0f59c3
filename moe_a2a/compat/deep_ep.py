"""A DeepEP-shaped facade: the low-latency `Buffer.low_latency_dispatch` / `low_latency_combine` (here), and
the normal (high-throughput) `get_dispatch_layout` / `dispatch` / `combine` (`compat/_normal.py`, issue 32
item 6, on the same Buffer).

Inference engines (vLLM, SGLang) and DeepEP's own tests drive DeepEP's `Buffer`; this module
has its names, so `import deep_ep` may resolve to it (`sys.modules["deep_ep"] = moe_a2a.compat.deep_ep`,
docs/compat.md). It is a thin layer over `moe_a2a.AllToAll` with a fixed expert capacity
(`A2AConfig.expert_capacity`): the received tokens are `[num_local_experts, C, hidden]`,
C = `num_max_dispatch_tokens_per_rank * num_ranks`, as DeepEP's.

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
  expert, TMA-aligned: `triton_kernels/scale_layout.py` copies them out of the rows at each fp8 receive).
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
  expert outputs, laid out as the handle says, are moved to it (`Buffer._dispatch_again`).
- every tensor is created with an explicit device and dtype: nothing depends on torch's defaults.
- input rejected by any call aborts that call on every rank (the peers raise
  `moe_a2a.all_to_all.CallAborted` naming the rank) and the next call works, a bad `handle` to a combine
  included; the first call (which builds the buffers, sized from its arguments) is collective itself: the
  ranks exchange their verdicts, sizes and `use_fp8` first, so if one rank rejects its input, or the
  ranks' sizes or `use_fp8` differ, every rank raises and nothing is built.
- `close()` (or DeepEP's `destroy()`) releases everything; any later call raises ValueError.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..all_to_all import AllToAll, CallAborted, canonical_device, check_combine_recv
from ..fingerprint import all_gather, differences
from ..runtime.shrink import RankMask
from ._api import _NO_EVENT, Config, EventOverlap  # noqa: F401 - DeepEP's names, importable here
from ._slots import COMBINE_SENT as _COMBINE_SENT
from ._slots import COMBINED as _COMBINED
from ._slots import DISPATCH_SENT as _DISPATCH_SENT
from ._slots import DISPATCHED as _DISPATCHED
from ._slots import FP8_BLOCK  # noqa: F401 - DeepEP's block size, kept importable here
from ._slots import FREE as _FREE
from ._slots import Prefixes as _Prefixes
from ._slots import Slot as _Slot
from ._slots import config as _config
from ._slots import fits as _fits
from ._slots import fp8_fits, fp8_payload_bytes, fp8_scale_offset  # noqa: F401 - kept importable here
from ._slots import fp8_quantize as _fp8_quantize
from ._slots import instance_bytes as _instance_bytes
from ._slots import pad_routes as _pad_routes
from ._slots import set_key as _set_key

# DeepEP's dtype of expert indices (its module-level `topk_idx_t`); int32 is taken too.
topk_idx_t = torch.int64


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


# get_low_latency_rdma_size_hint's answers in this process: (bytes, num_ranks) -> the sizes behind them
# (None when two sizes gave the same bytes), so that shrink mode can build at construction.
_HINTS: dict[tuple[int, int], tuple | None] = {}


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


# Arguments of other DeepEP versions' low_latency_dispatch that the facade knows (DeepEP's hybrid-ep branch,
# passed by vLLM and SGLang for NVFP4 dispatch).
_NVFP4_ARGS = ("use_nvfp4", "x_global_scale")


class Buffer:
    """DeepEP's `Buffer` (low-latency and normal mode), over `moe_a2a.AllToAll`.

    Args:
        group: the torch.distributed process group of the expert-parallel ranks (bootstrap only; default
            WORLD).
        num_nvl_bytes, num_rdma_bytes: kept as attributes. The buffers are built by the first call of each
            set of sizes (or `warm_up`); `num_rdma_bytes` bounds the sets after the first (their bytes as
            `get_low_latency_rdma_size_hint` counts them) and, when it is that hint's, makes the instances
            take top-k up to 8.
        low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric:
            DeepEP's transport switches; no meaning here (same-node peers always go through mapped
            memory, the rest through the proxy and `transport`), accepted and ignored.
        explicitly_destroy: True: release with `destroy()` (or `close()`); False as well, or when the
            instances are garbage collected (their own finaliser), so both are honoured.
        enable_shrink: shrink mode (DeepEP's): a rank that stops calling is masked by each peer whose wait
            on it times out (`timeout_s`), and the calls go on without it (its tokens dropped, nothing
            sent to its experts); `low_latency_query_mask_buffer` says who is masked. Every rank on one
            node with kernel waits (one GPU per rank, or MPS): the kernels' own waits mask, CUDA-graph safe;
            else the host's; `moe_a2a.runtime.shrink` says how. The masking time is `timeout_s`.
        timeout_s: every wait's deadline, and shrink mode's masking time (default: `MOE_A2A_TIMEOUT_S`
            from the environment, else 30 s: DeepEP's own tests cannot pass it).
        transport, node_group, gpu_wait, device: passed to `AllToAll` (device default: the
            first dispatch's `x.device`; "cuda" is the current CUDA device, "cpu:0" is "cpu", normalised
            and checked here).
    """

    # DeepEP's SM count for its normal-mode kernels (a class attribute, read by engines: SGLang's DeepEPConfig,
    # two-batch overlap). Recorded by set_num_sms and used by get_dispatch_config / get_combine_config; our
    # kernels choose their own grids, so it changes no launch.
    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = True,
                 num_qps_per_rank: int = 1, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 transport: str = "auto",
                 node_group="auto", timeout_s: float | None = None, gpu_wait: str = "auto", device=None) -> None:
        import torch.distributed as dist

        if group is None:
            if not dist.is_initialized():
                raise ValueError("Buffer needs torch.distributed initialised (or pass group=)")
            group = dist.group.WORLD
        self.group = group
        self.rank, self.group_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        # A device is normalised here, once ("cuda" -> the current CUDA device, "cpu:0" -> "cpu"), or refused.
        if timeout_s is None:
            timeout_s = float(os.environ.get("MOE_A2A_TIMEOUT_S", "30"))
        self._options = dict(group=group, transport=transport, node_group=node_group, timeout_s=timeout_s,
                             gpu_wait=gpu_wait, device=None if device is None else canonical_device(device))
        self.enable_shrink = bool(enable_shrink)
        self._mask: RankMask | None = None  # shrink mode: made with the instances (on their device)
        self._pending_mask: set[int] = set()  # ranks masked by the caller before that
        self._slots: list[_Slot] = []
        self._key = None  # the sizes of the first set (shrink mode has only that one)
        # Sets of instances by (num_max_dispatch_tokens_per_rank, num_experts, hidden): their two slots'
        # indices in _slots (a call of sizes not built yet builds theirs); the set of the last call.
        self._sets: dict[tuple, tuple[int, int]] = {}
        self._last_key = None
        self._next = 0
        self._calls = 0
        self._token_ids: _Prefixes | None = None  # [T, 1]: tokens 0..T-1, the scale column (made at the build)
        self._scratch: dict = {}  # what a combine of nothing sends and receives, per set of sizes
        self._again = None  # shrink mode: what a handle's repeated combine dispatches again into (_dispatch_again)
        self._instance_options: dict = {}  # AllToAll's arguments, from the first call
        self._normal = None  # normal mode's instances (compat/_normal.py), made at its first call
        self._closed = False
        if self.enable_shrink:
            # A rank that stops before its first call must not hold the others in a collective build:
            # shrink mode builds here, from the sizes of the hint that gave num_rdma_bytes (top-k <= 8).
            sizes = _HINTS.get((num_rdma_bytes, self.group_size))
            if sizes is None:
                raise ValueError(f"enable_shrink=True: num_rdma_bytes ({num_rdma_bytes}) must come from "
                                 f"Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, "
                                 f"{self.group_size}, num_experts) called in this process: shrink mode builds the "
                                 f"buffers at construction, from those sizes")
            self._build(None, sizes, None)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's: set `Buffer.num_sms` (even, as DeepEP asserts; ValueError otherwise). Recorded only: it
        tunes DeepEP's normal-mode kernels, and the facade's kernels choose their own grids."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms < 0 \
                or new_num_sms % 2:
            raise ValueError(f"set_num_sms: the SM count must be an even int >= 0 (as DeepEP's), "
                             f"got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """DeepEP's: an `EventOverlap` holding a CUDA event recorded on the current stream (an engine passes
        it as `previous_event` to normal-mode calls). Without an initialised CUDA context (CPU), one without
        an event, whose methods do nothing."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            return EventOverlap(event)
        return EventOverlap()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended normal-mode dispatch `Config` for `num_ranks`: here `Config(Buffer.num_sms)`
        with DeepEP's constructor defaults for any number of ranks (not DeepEP's per-size tuning table: the
        values are never used, the facade's kernels pick their own grids)."""
        return Buffer._normal_config("get_dispatch_config", num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended normal-mode combine `Config`: as `get_dispatch_config`."""
        return Buffer._normal_config("get_combine_config", num_ranks)

    @staticmethod
    def _normal_config(name: str, num_ranks) -> Config:
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"{name}: num_ranks must be an int >= 1, got {num_ranks!r}")
        return Config(Buffer.num_sms)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: "torch.Size | None" = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """Refused (NotImplementedError): DeepEP returns its one registered buffer (RDMA or NVLink) as raw
        elements from `offset`; vLLM's fault tolerance zeroes it whole (`clean_buffers`). The facade has no
        such buffer: its memory is several allocations (each slot's receive rows, each `AllToAll`
        instance's send and receive regions), so a view of one would not be the buffer and zeroing it would
        not reset the others. `clean_low_latency_buffer` zeroes what a caller can read (and is collective in
        shrink mode), `low_latency_clean_mask_buffer` unmasks."""
        raise NotImplementedError(
            "get_local_buffer_tensor: moe_a2a's DeepEP facade has no single raw buffer to return (its memory is "
            "several allocations: each slot's receive rows and each AllToAll instance's regions), so a view would "
            "not be DeepEP's buffer; use clean_low_latency_buffer(...) to zero what callers read and "
            "low_latency_clean_mask_buffer() to unmask. vLLM calls it only with fault tolerance enabled "
            "(parallel_config.enable_fault_tolerance): run without it; docs/compat.md")

    # ---- DeepEP's normal (high-throughput) mode (compat/_normal.py) ----------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP's: whether its SM90 (fp8) kernels were compiled. True: the facade's fp8 paths need no such
        build (DeepEP's tests take their fp8 cases when it is True)."""
        return True

    def _normal_mode(self):
        self._check_open()
        if self._normal is None:
            from ._normal import NormalMode
            self._normal = NormalMode(self)
        return self._normal

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's: from `topk_idx` `[T, K]` (-1 = no expert), `(num_tokens_per_rank` int32 `[W]`,
        `num_tokens_per_rdma_rank` int32 `[num_nodes]` or None on one node, `num_tokens_per_expert` int32 `[E]`,
        `is_token_in_rank` bool `[T, W]`, event)`. Local (no communication), on topk_idx's device."""
        return self._normal_mode().get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                                       allocate_on_comm_stream)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: "Config | None" = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's normal-mode dispatch (collective): each token to every rank `is_token_in_rank` names, once.

        `x`: bf16 `[T, H]`, or `(float8_e4m3fn [T, H], scales [T, S] float32 or int32)` (moved bit-exactly).
        Without `handle`: `num_tokens_per_rank`, `is_token_in_rank`, `num_tokens_per_expert` (from
        `get_dispatch_layout`) and optionally `topk_idx` / `topk_weights` (both or neither). With `handle` (a
        cached dispatch): the handle's routes, no top-k. `num_tokens_per_rdma_rank` is not needed (ignored).

        Returns `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)`
        as DeepEP's: recv_x in (source rank, token) order, the same type as `x`; recv_topk_idx local expert
        ids (-1: an expert of another rank); recv_topk_weights (0 where the id is -1); the list of received
        tokens per local expert from `num_tokens_per_expert`, each rounded up to `expert_alignment` (empty
        with `num_worst_tokens`, which pads the received tensors to that many rows, recv_topk_idx -1 past the
        count). A cached dispatch returns `(recv_x, None, None, None, None, event)`. Bad input on any rank:
        ValueError there, CallAborted on the others, nothing sent. `config` is checked and unused.
        """
        return self._normal_mode().dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                            topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                            previous_event, async_finish, allocate_on_comm_stream)

    def combine(self, x: torch.Tensor, handle, topk_weights=None, bias=None, config: "Config | None" = None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's normal-mode combine (collective): `x` `[num_recv, H]` bf16 in the handle's recv_x order goes
        home; `combined_x[t] = bias_0[t] + bias_1[t] + sum over the ranks r that received t (in rank order) of
        x_r[row]`, in fp32, cast to bf16 once (no weights applied, as DeepEP). `topk_weights` `[num_recv, K]`
        float32 is summed the same way. Returns `(combined_x [T, H] bf16, combined_topk_weights or None,
        event)`. A handle may be combined any number of times."""
        return self._normal_mode().combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                           allocate_on_comm_stream)

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, config: "Config | None" = None, previous_event=None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's name for `dispatch` across nodes (which `dispatch` takes itself): the same call."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, 0, config,
                             previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config: "Config | None" = None,
                          previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's name for `combine` across nodes: the same call."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes one rank's instances take at these sizes (top-k up to 8, DeepEP's assumption): the two bf16
        ones and, once an fp8 call was made, the two fp8 ones (their rows about half as wide); callers pass
        it back as `num_rdma_bytes`, which this facade does not need."""
        nbytes = _instance_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, 8)
        sizes = (num_max_dispatch_tokens_per_rank, num_experts, 8, hidden)
        key = (nbytes, num_ranks)  # two sizes giving the same bytes: ambiguous, not remembered
        _HINTS[key] = sizes if _HINTS.get(key, sizes) == sizes else None
        return nbytes

    # ---- dispatch ---------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, **kwargs):
        """Send every token to the ranks of its top-k experts; receive `[L, C, H]` expert-major.

        Args:
            x: `[T, H]` bfloat16, last stride 1, T <= num_max_dispatch_tokens_per_rank.
            topk_idx: `[T, K]` int64 (or int32) expert ids, -1 = not routed.
            num_max_dispatch_tokens_per_rank: the largest T any rank passes (fixes the capacity).
            num_experts: E, divisible by the number of ranks.
            cumulative_local_expert_recv_stats: optional int32 (or int64) `[L]` on the device: this call's
                received rows per local expert are added to it (stream-ordered, at the receive).
            dispatch_wait_recv_cost_stats: DeepEP's sixth argument (positionally too): an int64 `[num_ranks]`
                tensor on the device (as DeepEP's extension checks it) to which DeepEP adds the GPU clock
                cycles its receive waited on each source rank. Checked and **left untouched**: the facade
                does not measure per-source wait times.
            use_fp8: quantise to fp8 e4m3 with one scale per 128 elements before sending (may differ from
                call to call). round_scale: scales rounded up to powers of two. use_ue8m0: scales as
                UE8M0 codes packed four per int32 (implies round_scale; DeepEP requires both). Both
                ignored without use_fp8.
            async_finish: return an `EventOverlap` holding a CUDA event recorded after the call.
            return_recv_hook: send now, receive when the returned hook is called.
            use_nvfp4, x_global_scale (keywords of DeepEP's hybrid-ep branch, which vLLM and SGLang pass for
                NVFP4 dispatch): `use_nvfp4=True` is refused (ValueError naming what is supported);
                `x_global_scale` (the NVFP4 cast's global scale) is accepted and unused without it.

        Returns `(recv_x, recv_count, handle, event, hook)`: recv_x bf16 `[L, C, H]`, or with use_fp8
        `(fp8 [L, C, H], scales)` (fp32 `[L, C, ceil(H/128)]`, or int32 `[L, C, ceil(H/512)]` with
        use_ue8m0; DeepEP's layout: strides `(S * C4, 1, C4)`, C4 = C rounded up to a multiple of 4, valid
        below each expert's count); recv_count int32 `[L]`; a `Handle`; an `EventOverlap` (without an event unless
        `async_finish` on a GPU); the hook or None.
        """
        if self._closed:
            self._check_open()
        error, sizes, first = None, None, not self._slots
        try:
            if kwargs:
                self._refuse_dispatch_kwargs(kwargs)
            if dispatch_wait_recv_cost_stats is not None:  # its device too once built
                self._check_cost_stats(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
            sizes = self._sizes(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8)
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
            indices = self._sets[self._last_key]
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
        index, self._next = self._next, self._next ^ 1
        self._calls += 1  # every rank counts every call, aborted ones included
        index = indices[index]  # this set's slot of the alternation
        slot = self._slots[index]
        if slot.state != _FREE:
            self._retire(slot)  # the slot's previous call, if it was left unfinished
        use_fp8 = bool(use_fp8)
        if use_fp8 and not slot.fp8_outputs:  # the first fp8 call of these sizes: fp8 instances, scale outputs
            self._build_fp8(indices)  # every rank is in this call (the same use_fp8 on every rank, as DeepEP's)
        slot.a2a = slot.instances.get(use_fp8) or slot.instances[False]  # no fp8 instance: bf16 rows
        if error is not None:
            # The peers are in this call already: it is aborted on every rank (they raise CallAborted)
            # and the next one works, as with bad input to AllToAll.dispatch.
            slot.a2a.abort(str(error))
        T, H = x.shape
        if sizes[2] < built[2]:  # fewer routes per token than the instances take: padded with -1
            topk_idx = _pad_routes(topk_idx, built[2], -1)
        ue8m0 = use_fp8 and bool(use_ue8m0)
        # fp8: the pack quantises x straight into the rows it sends (fp8 bytes, then the scales).
        quantize = _fp8_quantize(H, bool(round_scale) or ue8m0, ue8m0) if use_fp8 else None
        slot.call, slot.T, slot.payload, slot.quantize, slot.ue8m0 = self._calls, T, x, quantize, ue8m0
        slot.stats, slot.combine_args = cumulative_local_expert_recv_stats, None
        try:
            slot.a2a.dispatch(slot.num, slot.ex, slot.exs, x, self._token_ids[T], topk_idx,
                              do_recv=not return_recv_hook, quantize=quantize, out_source_ranges=slot.layout_range)
        except BaseException:
            slot.free()
            raise
        if return_recv_hook:
            slot.state = _DISPATCH_SENT
        else:
            slot.received()
        handle = Handle(slot.src_info, slot.layout_range, built[0], H, built[1], index, slot.call, T)
        hook = self._hook(slot, slot.call, _Slot.receive_dispatch) if return_recv_hook else None
        return slot.recv_x[use_fp8, ue8m0], slot.num, handle, self._event(slot) if async_finish else _NO_EVENT, hook

    # ---- combine ----------------------------------------------------------------------------
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None, **kwargs):
        """Send expert outputs home; `out[t] = sum_k topk_weights[t, k] * y(t, k)` (fp32, k order).

        Args:
            x: `[L, C, H]` bfloat16 expert outputs, rows as the dispatch laid them out (ignored with
                `zero_copy`).
            topk_idx, topk_weights: `[T, K]` as given to the dispatch; weights float32.
            handle: from the dispatch of this micro-batch (it may be combined more than once).
            use_logfmt: refused (ValueError): LogFMT-compressed combine is not provided.
            zero_copy: send from `get_next_low_latency_combine_buffer(handle)` (written by the caller)
                instead of `x`.
            async_finish: return an `EventOverlap` holding a CUDA event recorded after the call.
            return_recv_hook: send now, receive when the returned hook is called.
            out: optional `[T, H]` bfloat16 to write into.
            combine_wait_recv_cost_stats: as the dispatch's `dispatch_wait_recv_cost_stats`: an int64
                `[num_ranks]` tensor on the device, checked and left untouched (not measured).

        Returns `(combined_x, event, hook)`: combined_x `[T, H]` bfloat16 (valid once the hook ran when
        `return_recv_hook`), an `EventOverlap`, the hook or None.
        """
        if self._closed:
            self._check_open()
        try:
            slot = self._slot_of(handle)
        except ValueError as exc:
            self._abort_for_handle(handle, exc)  # raises exc, once the call is void on every rank
        K = self._key[2]  # shrink mode's buffers are built for top-k 8: pad fewer
        if self.enable_shrink and isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 \
                and topk_idx.shape[1] < K and isinstance(topk_weights, torch.Tensor) and topk_weights.dim() == 2 \
                and topk_weights.shape[1] == topk_idx.shape[1]:
            topk_idx, topk_weights = _pad_routes(topk_idx, K, -1), _pad_routes(topk_weights, K, 0.0)
        K = slot.key[2]  # instances built for more routes per token than this call's (see the dispatch)
        if not self.enable_shrink and isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 \
                and topk_idx.shape[1] < K and isinstance(topk_weights, torch.Tensor) and topk_weights.dim() == 2 \
                and topk_weights.shape[1] == topk_idx.shape[1]:
            topk_idx, topk_weights = _pad_routes(topk_idx, K, -1), _pad_routes(topk_weights, K, 0.0)
        if slot.state == _DISPATCH_SENT or slot.state == _COMBINE_SENT:
            slot.settle()
        moved = None  # shrink mode: the rows of the handle's layout that a repeated combine moved
        if slot.state == _COMBINED:  # combined before: dispatch the same payload and routes again
            moved = self._dispatch_again(slot, topk_idx)
        a2a, shape = slot.a2a, slot.shape
        H = shape[2]
        if out is None:
            out = torch.empty(slot.T, H, dtype=torch.bfloat16, device=a2a.device)
        try:
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
        except ValueError as exc:
            self._run(slot, lambda: a2a.abort(str(exc)))  # aborts this call at its combine on every rank
        expert_y = y.reshape(-1, H)  # a view of contiguous outputs (a copy of others)
        if moved is not None:  # the outputs are in the handle's layout: into the one dispatched again
            expert_y = _move_rows(expert_y, *moved)
        slot.combine_args = (out, topk_idx, topk_weights, expert_y)
        try:
            a2a.combine(out, topk_idx, topk_weights, expert_y, do_recv=not return_recv_hook)
        except BaseException:
            slot.free()
            raise
        slot.state = _COMBINE_SENT if return_recv_hook else _COMBINED
        hook = self._hook(slot, slot.call, _Slot.receive_combine) if return_recv_hook else None
        return out, self._event(slot) if async_finish else _NO_EVENT, hook

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """The `[L, C, H]` bfloat16 buffer that `low_latency_combine(..., zero_copy=True)` sends from, for
        this handle's micro-batch: write the expert outputs there (one buffer per alternating instance,
        allocated at the first call: zero-copy callers pay its memory, others do not)."""
        self._check_open()
        return self._combine_buffer(self._slot_of(handle))

    @staticmethod
    def _combine_buffer(slot: _Slot) -> torch.Tensor:
        if slot.combine_buf is None:
            a2a = slot.a2a
            slot.combine_buf = torch.zeros(a2a.layout.num_local_experts, a2a.cfg.expert_capacity,
                                           a2a.cfg.hidden_dim, dtype=torch.bfloat16, device=a2a.device)
        return slot.combine_buf

    def warm_up(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, top_k: int = 8,
                use_fp8: bool = True, zero_copy: bool = False) -> None:
        """Build now what the calls of these sizes would build at their first call, so that none is left for a
        CUDA-graph capture: the first dispatch of a set of sizes builds its instances, and its first fp8 call
        the fp8 ones, each with a host collective (an all-gather and the instances' bootstrap), which a
        capture cannot hold. Builds both slots' bf16 instances for calls of up to `top_k` routes per token
        (fewer are padded), with `use_fp8` their fp8 instances and the scales in DeepEP's layout, the
        buffers a dispatch never combined is finished with, and with `zero_copy` the buffers
        `get_next_low_latency_combine_buffer` returns. What is built already is kept (idempotent).

        Collective: every rank calls it with the same arguments (not DeepEP's: engines call it once after
        making the Buffer, before capture). Arguments that are bad on any rank or differ between ranks raise
        ValueError on every rank, with nothing built. Top-k above what an earlier call of these sizes built
        for is refused the same way (warm up before the first call to build for more). Shrink mode builds at
        construction: there it checks the sizes are those and builds the scale outputs.
        """
        self._check_open()
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
                "zero_copy": str(bool(zero_copy))}
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

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's reset for reuse: zero the receive buffers of both slots of these sizes (recv_x and its
        DeepEP-layout scales, recv_count, the handles' src_info and layout_range) and their zero-copy combine
        buffers, stream-ordered. Local: no peer writes into these buffers outside this rank's own calls, so,
        unlike DeepEP's, it needs no barrier (calling it on every rank, as DeepEP requires, does the same).
        Before the first dispatch there is nothing to clean. Refused (ValueError) with sizes this Buffer has
        no buffers for, or while a returned hook of theirs has not run."""
        self._check_open()
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

    # ---- shrink mode: the mask ---------------------------------------------------------------
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Shrink mode: mask (`mask=True`: nothing is sent to it or awaited from it) or unmask one rank
        on this rank."""
        self._check_shrink("low_latency_update_mask_buffer")
        if self._mask is None:  # before the first dispatch: kept until the instances exist
            if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) \
                    or not 0 <= rank_to_mask < self.group_size or (mask and rank_to_mask == self.rank):
                raise ValueError(f"rank_to_mask: expected a rank in [0, {self.group_size}) other than this rank "
                                 f"({self.rank}) to mask, got {rank_to_mask!r}")
            (self._pending_mask.add if mask else self._pending_mask.discard)(rank_to_mask)
            return
        self._mask.set(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Shrink mode: write into `mask_status` (`[num_ranks]` int32, any device) 1 for each rank this rank
        has masked, 0 for the others (stream-ordered on a GPU)."""
        self._check_shrink("low_latency_query_mask_buffer")
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

    def low_latency_clean_mask_buffer(self) -> None:
        """Shrink mode: unmask every rank (a rank still stopped is masked again by the next wait on it)."""
        self._check_shrink("low_latency_clean_mask_buffer")
        self._pending_mask.clear()
        if self._mask is not None:
            self._mask.clear()

    def _check_shrink(self, name: str) -> None:
        self._check_open()
        if not self.enable_shrink:
            raise ValueError(f"{name}: needs a Buffer built with enable_shrink=True")

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

    def check(self) -> None:
        """`AllToAll.check()` of every instance: raise what went wrong in calls already issued (for CUDA-graph
        replays, which make no host call)."""
        self._check_open()
        for s in self._slots:
            for a2a in s.instances.values():
                a2a.check()

    def close(self) -> None:
        """Stop every instance (their proxies, shared memory). Idempotent; every later call raises
        ValueError."""
        self._closed = True
        if self._normal is not None:
            self._normal.close()
        for s in self._slots:
            for a2a in s.instances.values():
                a2a.close()
        self._slots = []

    def destroy(self) -> None:
        """DeepEP's name for `close()`."""
        self.close()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the calls of a slot ------------------------------------------------------------------
    # (The slot's state machine is `_slots.Slot`'s; these name its steps where the Buffer takes them.)
    @staticmethod
    def _run(slot: _Slot, half) -> None:
        slot.run(half)

    def _dispatch_again(self, slot: _Slot, topk_idx: torch.Tensor):
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
                                                      out_source_ranges=slot.layout_range))
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

    def _hook(self, slot: _Slot, call: int, receive):
        def hook() -> None:
            """Receive this call's data (a no-op when it was received already)."""
            self._check_open()
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
        self._run(slot, lambda: slot.a2a.abort(str(exc)))  # aborts the call at its combine on every rank
        raise exc  # (abort raised)

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

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this Buffer is closed (close() or destroy() released its buffers and proxies): "
                             "build a new Buffer")

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
                cfg = _config(num_max, num_experts, top_k, hidden, self.group_size, self.enable_shrink)
                device = self._options["device"] if first else self._instance_options["device"]
                if device is None:  # the first dispatch's x.device (refused here, with the verdict, if not one)
                    device = canonical_device(x.device if x is not None else None)
            except ValueError as exc:
                error = exc
        names = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden (x.shape[1])")
        mine = (None if error is None else str(error),
                None if sizes is None else {n: str(v) for n, v in zip(names, _set_key(sizes, x, 0, 0))},
                bool(use_fp8), None if sizes is None else sizes[2])
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
            cfg = _config(num_max, num_experts, top_k, hidden, self.group_size, self.enable_shrink)
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
        n = len(self._slots)
        self._sets[num_max, num_experts, hidden] = (n, n + 1)
        self._slots = self._slots + slots
        if first:
            self._key, self._instance_options, self._last_key = key, options, (num_max, num_experts, hidden)

    def _build_fp8(self, indices: tuple[int, int]) -> None:
        """At the first fp8 call of a set's sizes (on every rank): each of its slots' fp8 instance, whose rows
        carry the fp8 bytes and scales only (`fp8_payload_bytes`, about half a bf16 row), so that the pack,
        the wire and the unpack of an fp8 call stride over half the bytes. It writes the slot's receive
        buffers (shared with the bf16 instance): what it adds is its send and receive rows, not a second set
        of outputs. Shrink mode builds none (its fp8 calls travel in bf16 rows). Then the slots' scales in
        DeepEP's layout (`_Slot.make_fp8_outputs`)."""
        slots = [self._slots[i] for i in indices]
        num_max, E, K, H = slots[0].key
        if True not in slots[0].instances and not self.enable_shrink and fp8_fits(H):
            cfg = _config(num_max, E, K, H, self.group_size, fp8=True)
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


__all__ = ["topk_idx_t", "Buffer", "Config", "EventOverlap", "Handle"]
