"""A DeepEP-shaped low-latency facade: `Buffer.low_latency_dispatch` / `low_latency_combine`.

Inference engines (vLLM, SGLang) drive DeepEP's low-latency API; this class has its shape, so an engine
can switch with a few lines. It is a thin layer over `moe_a2a.AllToAll` with a fixed expert capacity
(`A2AConfig.expert_capacity`): the received tokens are `[num_local_experts, capacity, hidden]`, capacity =
`num_max_dispatch_tokens_per_rank * num_ranks`, as DeepEP's.

What matches DeepEP, what does not (also in docs/compat.md):
- same method names, argument names and order, return tuples (`recv_x, recv_count, handle, event, hook`
  and `combined_x, event, hook`); `recv_x` is `(fp8 [L, C, H], fp32 scales [L, C, H/128])` with
  `use_fp8=True`, else bf16 `[L, C, H]`; `recv_count` int32 `[L]`;
- `return_recv_hook=True` sends only; calling the hook receives (work in between overlaps);
- two calls may be in flight (two micro-batches alternating, two handles alive): the buffer keeps two
  `AllToAll` instances and alternates between them (twice the memory and two proxies per rank);
- not supported (ValueError when asked for): `round_scale`, `use_ue8m0`, `use_logfmt`, `zero_copy`,
  `cumulative_local_expert_recv_stats`, `async_finish=True` (our calls are stream-ordered: no event);
- a token routed twice to one expert is allowed (DeepEP assumes distinct top-k); when that makes an
  expert exceed the capacity, the next call raises (rows past the capacity are not written).
- the receive buffers are reused by the next dispatch of the same parity (every other call);
- input rejected by any call aborts that call on every rank (the peers raise
  `moe_a2a.all_to_all.CallAborted` naming the rank), and the next call works: after the first call
  through `AllToAll.abort`; the first call (which builds the buffers, sized from its arguments) is
  collective itself: the ranks exchange their verdicts and arguments first, so if one rank rejects its
  input, or the ranks' sizes differ, every rank raises and nothing is built; call numbering never drifts;
- `close()` (or DeepEP's `destroy()`) releases everything; any later call raises ValueError.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..all_to_all import AllToAll, CallAborted
from ..config import A2AConfig
from ..fingerprint import all_gather, differences
from ..triton_kernels.quant import quantize_fp8

_UNSUPPORTED = ("round_scale", "use_ue8m0", "use_logfmt", "zero_copy", "cumulative_local_expert_recv_stats")


# DeepEP's dtype of expert indices (its module-level `topk_idx_t`); int32 is taken too.
topk_idx_t = torch.int64


@dataclass(frozen=True)
class Handle:
    """What `low_latency_combine` needs from its dispatch (opaque to callers, as DeepEP's)."""

    slot: int
    num_tokens: int


class Buffer:
    """DeepEP's `Buffer` for the low-latency path, over `moe_a2a.AllToAll`.

    Args:
        group: the torch.distributed process group of the expert-parallel ranks (bootstrap only).
        num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank: accepted for signature
            compatibility and ignored (sizes come from the first dispatch's arguments).
        transport, node_group, timeout_s, gpu_wait, device: passed to `AllToAll`.
    """

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = True,
                 num_qps_per_rank: int = 1, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 transport: str = "auto",
                 node_group="auto", timeout_s: float = 30.0, gpu_wait: str = "auto", device=None) -> None:
        import torch.distributed as dist

        # DeepEP's transport switches have no meaning here (same-node peers always go through mapped memory,
        # the rest through the proxy); destroy() is always explicit. Shrinking (masking a dead rank) is not
        # built yet: refused rather than silently ignored.
        if enable_shrink:
            raise ValueError("enable_shrink=True: masking a rank that stopped is not supported by moe_a2a's "
                             "DeepEP facade yet (docs/compat.md)")

        if group is None:
            if not dist.is_initialized():
                raise ValueError("Buffer needs torch.distributed initialised (or pass group=)")
            group = dist.group.WORLD
        self.group = group
        self.rank, self.group_size = dist.get_rank(group), dist.get_world_size(group)
        self._options = dict(group=group, transport=transport, node_group=node_group, timeout_s=timeout_s,
                             gpu_wait=gpu_wait, device=device)
        self._a2a: list[AllToAll] = []
        self._key = None
        self._outputs: list = []
        self._next = 0
        self._closed = False

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes one rank allocates for its two instances at these sizes (fp8, top-k up to 8: DeepEP's
        assumption), for callers that pass it back as `num_rdma_bytes` (which this facade ignores: its
        buffers are sized by the first dispatch)."""
        cfg = A2AConfig(max_num_tokens=num_max_dispatch_tokens_per_rank, num_experts=num_experts, experts_per_token=8,
                        hidden_dim=hidden, in_dtype=torch.float8_e4m3fn, scale_block=128, out_dtype=torch.bfloat16,
                        expert_capacity=num_max_dispatch_tokens_per_rank * num_ranks)
        lay = cfg.layout(num_ranks)
        return 2 * (lay.send_bytes + lay.recv_bytes + lay.segment_bytes(False))

    # ---- the two halves ---------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, use_fp8: bool = True, async_finish: bool = False,
                             return_recv_hook: bool = False, **kwargs):
        """Send every token to the ranks of its top-k experts; receive `[L, C, H]` expert-major.

        Args:
            x: `[T, H]` bfloat16, T <= num_max_dispatch_tokens_per_rank.
            topk_idx: `[T, K]` int64 (or int32) expert ids, -1 = not routed.
            num_max_dispatch_tokens_per_rank: the largest T any rank passes (fixes the capacity).
            num_experts: E, divisible by the number of ranks.
            use_fp8: quantise to fp8 e4m3 with one fp32 scale per 128 elements before sending.
            return_recv_hook: send now, receive when the returned hook is called.

        Returns `(recv_x, recv_count, handle, event, hook)`: recv_x `[L, C, H]` (or `(fp8, scales)`),
        recv_count int32 `[L]`, an opaque handle for the combine, event None, hook or None.
        """
        self._check_open()
        error, sizes = None, None
        try:
            self._refuse(kwargs, async_finish)
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
                raise ValueError(f"x: expected a [T, H] bfloat16 tensor, got "
                                 f"{(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__}")
            if isinstance(num_max_dispatch_tokens_per_rank, bool) or not isinstance(num_max_dispatch_tokens_per_rank, int):
                raise ValueError(f"num_max_dispatch_tokens_per_rank: expected an int, got "
                                 f"{num_max_dispatch_tokens_per_rank!r}")
            sizes = self._sizes(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8)
        except ValueError as exc:
            error = exc
        if not self._a2a:
            self._build(error, sizes, x)  # collective: raises on every rank when any rank cannot build
        elif error is None and sizes != self._key:
            error = ValueError(f"this Buffer was sized by its first dispatch (num_max_dispatch_tokens_per_rank, "
                               f"num_experts, top-k, hidden, use_fp8) = {self._key}; got {sizes}: use another Buffer")
        slot, self._next = self._next, self._next ^ 1
        a2a = self._a2a[slot]
        if error is not None:
            # The peers are in this call already: it is aborted on every rank (they raise CallAborted)
            # and the next one works, as with bad input to AllToAll.dispatch.
            a2a.abort(str(error))
        num, ex, exs = self._outputs[slot]
        if use_fp8:
            xq, xs = quantize_fp8(x.contiguous(), 128)
        else:
            xq, xs = x, None
        a2a.dispatch(num, ex, exs, xq, xs, topk_idx, do_recv=not return_recv_hook)
        cfg, L = a2a.cfg, a2a.layout.num_local_experts
        cap = cfg.expert_capacity
        recv_x = ex.view(L, cap, cfg.hidden_dim)
        if use_fp8:
            recv_x = (recv_x, exs.view(L, cap, cfg.num_scales))
        hook = None
        if return_recv_hook:
            def hook():
                a2a.dispatch(num, ex, exs, xq, xs, topk_idx, do_send=False)
        return recv_x, num, Handle(slot, x.shape[0]), None, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Handle,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None, **kwargs):
        """Send expert outputs home; `out[t] = sum_k topk_weights[t, k] * y(t, k)` (fp32, k order).

        Args:
            x: `[L, C, H]` bfloat16 expert outputs, rows as the dispatch laid them out.
            topk_idx, topk_weights: `[T, K]` as given to the dispatch; weights float32.
            handle: from the dispatch of this micro-batch.
            out: optional `[T, H]` bfloat16 to write into.

        Returns `(combined_x, event, hook)`: combined_x `[T, H]` bfloat16 (valid once the hook ran when
        `return_recv_hook`), event None, hook or None.
        """
        self._check_open()
        self._refuse(kwargs, async_finish)
        if not isinstance(handle, Handle) or not 0 <= handle.slot < len(self._a2a):
            raise ValueError(f"handle: expected the handle returned by low_latency_dispatch, got {handle!r}")
        a2a = self._a2a[handle.slot]
        cfg, L = a2a.cfg, a2a.layout.num_local_experts
        shape = (L, cfg.expert_capacity, cfg.hidden_dim)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != torch.bfloat16:
            raise ValueError(f"x: expected {list(shape)} bfloat16 expert outputs, got "
                             f"{(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if out is None:
            out = torch.empty(handle.num_tokens, cfg.hidden_dim, dtype=torch.bfloat16, device=x.device)
        expert_y = x.contiguous().view(-1, cfg.hidden_dim)
        a2a.combine(out, topk_idx, topk_weights, expert_y, do_recv=not return_recv_hook)
        hook = None
        if return_recv_hook:
            def hook():
                a2a.combine(out, topk_idx, topk_weights, expert_y, do_send=False)
        return out, None, hook

    def close(self) -> None:
        """Stop both instances (their proxies, shared memory). Idempotent; every later call raises
        ValueError."""
        self._closed = True
        for a2a in self._a2a:
            a2a.close()
        self._a2a, self._outputs = [], []

    def destroy(self) -> None:
        """DeepEP's name for `close()`."""
        self.close()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------
    @staticmethod
    def _refuse(kwargs: dict, async_finish: bool) -> None:
        unknown = [k for k in kwargs if k not in _UNSUPPORTED]
        if unknown:
            raise ValueError(f"unexpected arguments {unknown}")
        used = [k for k in _UNSUPPORTED if kwargs.get(k)]
        if async_finish:
            used.append("async_finish")
        if used:
            raise ValueError(f"not supported by moe_a2a's DeepEP facade: {used} (docs/compat.md)")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this Buffer is closed (close() or destroy() released its buffers and proxies): "
                             "build a new Buffer")

    def _sizes(self, x, topk_idx, num_max: int, num_experts: int, use_fp8: bool) -> tuple:
        """What sizes the buffers: (num_max_dispatch_tokens_per_rank, num_experts, top-k, hidden, use_fp8)."""
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise ValueError(f"topk_idx: expected a [T, K] tensor, got "
                             f"{tuple(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__}")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int):
            raise ValueError(f"num_experts: expected an int, got {num_experts!r}")
        return (num_max, num_experts, topk_idx.shape[1], x.shape[1], bool(use_fp8))

    def _config(self, sizes: tuple) -> A2AConfig:
        num_max, num_experts, top_k, hidden, use_fp8 = sizes
        if num_max < 1 or num_experts < 1:
            raise ValueError(f"num_max_dispatch_tokens_per_rank and num_experts must be >= 1, got "
                             f"{num_max}, {num_experts}")
        if num_experts % self.group_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks ({self.group_size})")
        return A2AConfig(max_num_tokens=num_max, num_experts=num_experts, experts_per_token=top_k, hidden_dim=hidden,
                         in_dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16,
                         scale_block=128 if use_fp8 else None, out_dtype=torch.bfloat16,
                         expert_capacity=num_max * self.group_size)

    def _build(self, error: ValueError | None, sizes: tuple | None, x) -> None:
        """The first call: build both instances, sized from its arguments, on every rank or on none.

        Every rank first sends its verdict on its own input and its sizes (one all-gather over the group):
        if any rank rejected its input, or the sizes differ, every rank raises (the rejecting rank its
        ValueError, the others CallAborted naming it; different sizes: ValueError naming them on every
        rank) and nothing is built, so the next call is the first call again on every rank alike."""
        cfg = None
        if error is None:
            try:
                cfg = self._config(sizes)
            except ValueError as exc:
                error = exc
        names = ("num_max_dispatch_tokens_per_rank", "num_experts", "top-k (topk_idx.shape[1])",
                 "hidden (x.shape[1])", "use_fp8")
        mine = (None if error is None else str(error),
                None if sizes is None else {n: str(v) for n, v in zip(names, sizes)})
        table = all_gather(self.group, mine)
        rejected = [r for r, (err, _) in enumerate(table) if err is not None]
        if error is not None:
            others = [r for r in rejected if r != self.rank]
            raise ValueError(f"{error} (rank {self.rank} aborted this call, the Buffer's first, on every rank"
                             + (f", as did rank(s) {others}" if others else "")
                             + ": nothing was built or sent; the next call builds the buffers)") from None
        if rejected:
            raise CallAborted(f"rank {self.rank}: call 0 of this Buffer (the first: it builds the buffers) was "
                              f"aborted by rank {', '.join(map(str, rejected))}: its input was rejected "
                              f"({table[rejected[0]][0]}); nothing was built or sent; the next call builds the "
                              f"buffers")
        diff = differences([sz for _, sz in table])
        if diff:
            raise ValueError(f"rank {self.rank}: the first low_latency_dispatch sizes the buffers and must get the "
                             f"same sizes on every rank; refused on every rank (nothing was built or sent):\n  "
                             + "\n  ".join(diff))
        options = dict(self._options)
        if options["device"] is None:
            options["device"] = x.device
        built: list[AllToAll] = []
        try:
            for _ in range(2):
                built.append(AllToAll(cfg, **options))
            self._outputs = [a2a.empty_dispatch_outputs() for a2a in built]
        except BaseException:
            for a2a in built:
                a2a.close()
            raise
        self._a2a, self._key = built, sizes


__all__ = ["topk_idx_t", "Buffer", "Handle"]
