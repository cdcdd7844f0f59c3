"""A DeepEP-shaped facade: the low-latency `Buffer.low_latency_dispatch` / `low_latency_combine` (here), and
the normal (high-throughput) `get_dispatch_layout` / `dispatch` / `combine` (`compat/_normal.py`, issue 32
item 6, on the same Buffer).

Inference engines (vLLM, SGLang) and DeepEP's own tests drive DeepEP's `Buffer`; this module
has its names, so `import deep_ep` may resolve to it (`sys.modules["deep_ep"] = moe_a2a.compat.deep_ep`,
docs/compat.md). It is a thin layer over `moe_a2a.AllToAll` with a fixed expert capacity
(`A2AConfig.expert_capacity`): the received tokens are `[num_local_experts, C, hidden]`,
C = `num_max_dispatch_tokens_per_rank * num_ranks`, as DeepEP's.

How it is built: `compat/_low_latency.py` (the low-latency mode: its calls, and how one set of receive
buffers serves bf16 and fp8 calls of any size within the Buffer's bounds, two calls in flight, and
shrink mode), `compat/_low_latency_sets.py` (its sets of instances and their collective build),
`compat/_slots.py` (the slots and their call's state machine), `compat/_normal.py` (normal mode).
`Buffer` checks that it is open and routes each call to its mode. Input rejected by any call aborts that
call on every rank (the peers raise `moe_a2a.all_to_all.CallAborted` naming the rank) and the next call
works; `close()` (or DeepEP's `destroy()`) releases everything; any later call raises ValueError.
"""
from __future__ import annotations

import os

import torch

from ..all_to_all import canonical_device
from ..config import WIRES
from ._api import _NO_EVENT, Config, EventOverlap  # noqa: F401 - DeepEP's names, importable here
from ._low_latency import Handle, LowLatencyMode
from ._low_latency import _move_rows, _moved_rows  # noqa: F401 - kept importable here
from ._low_latency_sets import _HINTS, _NVFP4_ARGS  # noqa: F401 - kept importable here
from ._slots import FP8_BLOCK  # noqa: F401 - DeepEP's block size, kept importable here
from ._slots import Prefixes as _Prefixes
from ._slots import Slot as _Slot  # noqa: F401 - kept importable here
from ._slots import config as _config  # noqa: F401 - kept importable here
from ._slots import fp8_fits, fp8_payload_bytes, fp8_scale_offset  # noqa: F401 - kept importable here
from ._slots import fp8_quantize as _fp8_quantize  # noqa: F401 - kept importable here
from ._slots import instance_bytes as _instance_bytes

# DeepEP's dtype of expert indices (its module-level `topk_idx_t`); int32 is taken too.
topk_idx_t = torch.int64


def _wire(wire: str | None, enable_shrink: bool) -> str:
    """The Buffer's wire: `wire`, else the environment's MOE_A2A_WIRE, else "per_route"; ValueError for a name
    `config.WIRES` lacks, or for another wire in shrink mode."""
    source = "wire"
    if wire is None:
        wire, source = os.environ.get("MOE_A2A_WIRE") or "per_route", "MOE_A2A_WIRE"
    if not isinstance(wire, str) or wire not in WIRES:
        raise ValueError(f"Buffer: {source}={wire!r} is not a wire: expected one of {', '.join(WIRES)} "
                         f"(moe_a2a.config.WIRES)")
    if enable_shrink and wire != "per_route":
        # AllToAll refuses rank_mask with per-rank rows (the masks drop routes those rows do not follow); the fp8
        # combine is untested in shrink mode.
        raise ValueError(f"Buffer: enable_shrink=True takes wire 'per_route' only, got {source}={wire!r}: per-rank "
                         f"rows (and so the relay) do not follow shrink mode's masks, and the fp8 combine is not "
                         f"tested with them")
    return wire


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
        wire: how the rows of both modes travel, a name of `moe_a2a.config.WIRES` ("per_route", "per_rank_dispatch",
            "sender_reduced", "fp8_combine", "sender_reduced_fp8", "relay", "relay_fp8"; `config.wire_config`).
            Default: the environment's `MOE_A2A_WIRE` when set (so that DeepEP's own tests run over a wire
            unchanged), else "per_route" (one row per route each way). Another name: ValueError naming them. Shrink
            mode takes "per_route" only (ValueError otherwise). docs/compat.md, "Over other wires".
        dispatch_weights: False (default, DeepEP's API): the routes' weights come with the low-latency combine.
            Over the wires that reduce the combine at the experts' rank ("sender_reduced*", "relay*") they must
            travel with the dispatch's rows, so each such combine first dispatches its call again with them (the
            same x and routes; twice the dispatch's transfers, and `x` must be unchanged until the combine). True:
            every `low_latency_dispatch` gives them (`topk_weights=`, float32 like `topk_idx`), nothing is sent
            twice, and over those wires the combine's `topk_weights` must be that tensor or equal to it (the
            dispatch's are the ones applied; other values abort the combine on every rank). The same on every rank.
    """

    # DeepEP's SM count for its normal-mode kernels (a class attribute, read by engines: SGLang's DeepEPConfig,
    # two-batch overlap). Recorded by set_num_sms and used by get_dispatch_config / get_combine_config; our
    # kernels choose their own grids, so it changes no launch.
    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = True,
                 num_qps_per_rank: int = 1, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 transport: str = "auto",
                 node_group="auto", timeout_s: float | None = None, gpu_wait: str = "auto", device=None,
                 wire: str | None = None, dispatch_weights: bool = False) -> None:
        import torch.distributed as dist

        # Checked first, before the group: a bad wire is the caller's, whatever else is wrong.
        self.wire = _wire(wire, enable_shrink)
        if not isinstance(dispatch_weights, bool):
            raise ValueError(f"dispatch_weights: expected a bool, got {dispatch_weights!r}")
        self.dispatch_weights = dispatch_weights

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
        self._ll = LowLatencyMode(self)  # the low-latency mode's slots, sets and mask (compat/_low_latency.py)
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
            self._ll._build(None, sizes, None)

    # The low-latency state, read here by tests and benchmarks (benchmarks/gpu/facade_cost.py).
    @property
    def _slots(self) -> list:
        return self._ll._slots

    @property
    def _next(self) -> int:
        return self._ll._next

    @_next.setter
    def _next(self, value: int) -> None:
        self._ll._next = value

    @property
    def _token_ids(self) -> "_Prefixes | None":
        return self._ll._token_ids


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
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False, **kwargs):
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
        count). A cached dispatch returns `(recv_x, None, None, None, None, event)`. Bad input on any rank
        (an unknown keyword included): ValueError there, CallAborted on the others, nothing sent; arguments
        that must agree and differ between ranks, or ranks out of step (one at its combine, another at its
        dispatch): ValueError on every rank saying which rank has what. `config` is checked and unused.
        """
        return self._normal_mode().dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                            topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                            previous_event, async_finish, allocate_on_comm_stream, kwargs)

    def combine(self, x: torch.Tensor, handle, topk_weights=None, bias=None, config: "Config | None" = None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False, **kwargs):
        """DeepEP's normal-mode combine (collective): `x` `[num_recv, H]` bf16 in the handle's recv_x order goes
        home; `combined_x[t] = bias_0[t] + bias_1[t] + sum over the ranks r that received t (in rank order) of
        x_r[row]`, in fp32, cast to bf16 once (no weights applied, as DeepEP). After a dispatch with
        `num_worst_tokens` N, `x` may have N rows (DeepEP's: recv_x's rows; those past the count are not
        sent). `topk_weights` `[num_recv (or N), K]` float32, K the dispatch's num_topk, is summed the same
        way; every rank passes it or none does. Returns `(combined_x [T, H] bf16, combined_topk_weights or
        None, event)`. A handle may be combined any number of times. Refusals as `dispatch`'s."""
        return self._normal_mode().combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                           allocate_on_comm_stream, kwargs)

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, config: "Config | None" = None, previous_event=None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False, **kwargs):
        """DeepEP's name for `dispatch` across nodes (which `dispatch` takes itself): the same call."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, 0, config,
                             previous_event, async_finish, allocate_on_comm_stream, **kwargs)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config: "Config | None" = None,
                          previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False,
                          **kwargs):
        """DeepEP's name for `combine` across nodes: the same call."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream, **kwargs)

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
                             async_finish: bool = False, return_recv_hook: bool = False, *,
                             topk_weights: torch.Tensor | None = None, **kwargs):
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
            topk_weights (ours, keyword only): `[T, K]` float32 like `topk_idx`, the routes' weights. Required by a
                Buffer built with `dispatch_weights=True` and refused by one without (ValueError, the call aborted
                on every rank): over the wires that reduce the combine at the experts' rank they travel with the
                rows and are the weights the combine applies; over the others they are not used.

        Returns `(recv_x, recv_count, handle, event, hook)`: recv_x bf16 `[L, C, H]`, or with use_fp8
        `(fp8 [L, C, H], scales)` (fp32 `[L, C, ceil(H/128)]`, or int32 `[L, C, ceil(H/512)]` with
        use_ue8m0; DeepEP's layout: strides `(S * C4, 1, C4)`, C4 = C rounded up to a multiple of 4, valid
        below each expert's count); recv_count int32 `[L]`; a `Handle`; an `EventOverlap` (without an event unless
        `async_finish` on a GPU); the hook or None.
        """
        if self._closed:
            self._check_open()
        return self._ll.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                 round_scale, use_ue8m0, async_finish, return_recv_hook, kwargs, topk_weights)

    # ---- combine ----------------------------------------------------------------------------
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None, **kwargs):
        """Send expert outputs home; `out[t] = sum_k topk_weights[t, k] * y(t, k)` (fp32, k order).

        Args:
            x: `[L, C, H]` bfloat16 expert outputs, rows as the dispatch laid them out (ignored with
                `zero_copy`).
            topk_idx, topk_weights: `[T, K]` as given to the dispatch; weights float32. Over the wires that
                reduce the combine at the experts' rank, a Buffer built with `dispatch_weights=True` applies the
                dispatch's weights: these must be that tensor or equal to it (else ValueError, the call aborted on
                every rank); without it the call is dispatched again first, with these.
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
        return self._ll.combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                return_recv_hook, out, combine_wait_recv_cost_stats, kwargs)

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """The `[L, C, H]` bfloat16 buffer that `low_latency_combine(..., zero_copy=True)` sends from, for
        this handle's micro-batch: write the expert outputs there (one buffer per alternating instance,
        allocated at the first call: zero-copy callers pay its memory, others do not)."""
        self._check_open()
        return self._ll.next_combine_buffer(handle)

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
        self._ll.warm_up(num_max_dispatch_tokens_per_rank, hidden, num_experts, top_k, use_fp8, zero_copy)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's reset for reuse: zero the receive buffers of both slots of these sizes (recv_x and its
        DeepEP-layout scales, recv_count, the handles' src_info and layout_range) and their zero-copy combine
        buffers, stream-ordered. Local: no peer writes into these buffers outside this rank's own calls, so,
        unlike DeepEP's, it needs no barrier (calling it on every rank, as DeepEP requires, does the same).
        Before the first dispatch there is nothing to clean. Refused (ValueError) with sizes this Buffer has
        no buffers for, or while a returned hook of theirs has not run."""
        self._check_open()
        self._ll.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    # ---- shrink mode: the mask ---------------------------------------------------------------
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Shrink mode: mask (`mask=True`: nothing is sent to it or awaited from it) or unmask one rank
        on this rank."""
        self._check_shrink("low_latency_update_mask_buffer")
        self._ll.update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Shrink mode: write into `mask_status` (`[num_ranks]` int32, any device) 1 for each rank this rank
        has masked, 0 for the others (stream-ordered on a GPU)."""
        self._check_shrink("low_latency_query_mask_buffer")
        self._ll.query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Shrink mode: unmask every rank (a rank still stopped is masked again by the next wait on it)."""
        self._check_shrink("low_latency_clean_mask_buffer")
        self._ll.clean_mask()

    def _check_shrink(self, name: str) -> None:
        self._check_open()
        if not self.enable_shrink:
            raise ValueError(f"{name}: needs a Buffer built with enable_shrink=True")

    def check(self) -> None:
        """`AllToAll.check()` of every instance: raise what went wrong in calls already issued (for CUDA-graph
        replays, which make no host call)."""
        self._check_open()
        self._ll.check()

    def close(self) -> None:
        """Stop every instance (their proxies, shared memory). Idempotent; every later call raises
        ValueError."""
        self._closed = True
        if self._normal is not None:
            self._normal.close()
        self._ll.close()

    def destroy(self) -> None:
        """DeepEP's name for `close()`."""
        self.close()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this Buffer is closed (close() or destroy() released its buffers and proxies): "
                             "build a new Buffer")


__all__ = ["topk_idx_t", "Buffer", "Config", "EventOverlap", "Handle"]
