"""A vLLM-shaped prepare/finalize class: `MoeA2APrepareAndFinalize`, over `moe_a2a.compat.Buffer`.

vLLM's modular fused-MoE splits a layer into [prepare: quantise + dispatch] -> [experts] -> [finalize:
combine]; an all-to-all backend is a `FusedMoEPrepareAndFinalize`. This class has that shape (the
methods and properties below, with vLLM's names), subclasses vLLM's base class when vLLM is installed
and is importable without it (then `FusedMoEActivationFormat` and `ExpertTokensMetadata` are local
stand-ins with the same names and fields). docs/compat.md says how to register it and what differs.

The experts see the batched format: `[num_local_experts, capacity, hidden]` with per-expert counts
(`activation_format == BatchedExperts`), capacity = `max_num_tokens_per_rank * num_dispatchers`.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

import torch

from .deep_ep import Buffer

try:  # vLLM's own types when it is there, so the engine's isinstance checks pass
    from vllm.model_executor.layers.fused_moe import modular_kernel as _mk

    _Base = _mk.FusedMoEPrepareAndFinalize
    FusedMoEActivationFormat = _mk.FusedMoEActivationFormat
    ExpertTokensMetadata = _mk.ExpertTokensMetadata
except Exception:  # noqa: BLE001 - any import failure: vLLM absent or of another shape
    _Base = object

    class FusedMoEActivationFormat(enum.Enum):
        """Stand-in for vLLM's enum (same names and values)."""

        Standard = ("standard",)
        BatchedExperts = ("batched_experts",)

    @dataclass
    class ExpertTokensMetadata:
        """Stand-in for vLLM's dataclass (same fields)."""

        expert_num_tokens: torch.Tensor
        expert_num_tokens_cpu: torch.Tensor | None


def _uses_fp8(quant_config) -> bool:
    """fp8 e4m3 with 128-element groups when vLLM's quant config asks for fp8 activations."""
    dtype = getattr(quant_config, "quant_dtype", None) if quant_config is not None else None
    if dtype is None:
        return False
    if dtype in (torch.float8_e4m3fn, "fp8"):
        return True
    raise ValueError(f"quant_config.quant_dtype: only None (bf16) and float8_e4m3fn are supported, got {dtype!r}")


class MoeA2APrepareAndFinalize(_Base):
    """moe_a2a as a vLLM all-to-all backend (low-latency, batched experts).

    Args:
        buffer: a `moe_a2a.compat.Buffer` over the expert-parallel group.
        max_num_tokens_per_rank: the most tokens a rank dispatches per call.
        num_dispatchers: ranks that dispatch (the group size).
        use_fp8: quantise activations to fp8 before dispatch (None: decide from `quant_config`).
    """

    def __init__(self, buffer: Buffer, max_num_tokens_per_rank: int, num_dispatchers: int,
                 use_fp8: bool | None = None) -> None:
        if _Base is not object:
            super().__init__()
        if not isinstance(buffer, Buffer):
            raise ValueError(f"buffer: expected a moe_a2a.compat.Buffer, got {type(buffer).__name__}")
        if isinstance(max_num_tokens_per_rank, bool) or not isinstance(max_num_tokens_per_rank, int) \
                or max_num_tokens_per_rank < 1:
            raise ValueError(f"max_num_tokens_per_rank: expected a positive int, got {max_num_tokens_per_rank!r}")
        if num_dispatchers != buffer.group_size:
            raise ValueError(f"num_dispatchers: expected the buffer's group size {buffer.group_size}, "
                             f"got {num_dispatchers!r}")
        self.buffer, self._max_tokens, self._num_dispatchers = buffer, max_num_tokens_per_rank, num_dispatchers
        self._use_fp8 = use_fp8
        self._handles: deque = deque()  # dispatched, not yet finalized (micro-batches in order)

    # ---- what vLLM asks of a backend ----------------------------------------------------------
    @property
    def activation_format(self):
        return FusedMoEActivationFormat.BatchedExperts

    def topk_indices_dtype(self) -> torch.dtype:
        return torch.int64

    def max_num_tokens_per_rank(self) -> int:
        return self._max_tokens

    def num_dispatchers(self) -> int:
        return self._num_dispatchers

    def output_is_reduced(self) -> bool:
        return True  # finalize writes the weighted sum over every rank's experts

    def supports_async(self) -> bool:
        return True

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: torch.Tensor | None, apply_router_weight_on_input: bool, quant_config=None,
                defer_input_quant: bool = False):
        """Quantise and dispatch; returns `(expert_x [L, C, H], expert_x_scale [L, C, S] | None,
        ExpertTokensMetadata, None, None)`."""
        hook, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                            apply_router_weight_on_input, quant_config, defer_input_quant)
        hook()
        return receiver()

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      expert_map: torch.Tensor | None, apply_router_weight_on_input: bool, quant_config=None,
                      defer_input_quant: bool = False):
        """Send now; returns `(hook, receiver)`: call the hook to receive, then the receiver for the
        same result as `prepare`."""
        if expert_map is not None:
            raise ValueError("expert_map: not supported (experts are contiguous per rank: rank r hosts "
                             "[r*L, (r+1)*L))")
        if defer_input_quant:
            raise ValueError("defer_input_quant: not supported (the dispatch quantises)")
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("apply_router_weight_on_input needs top-1 routing")
            a1 = (a1.float() * topk_weights.float()).to(a1.dtype)
        use_fp8 = self._use_fp8 if self._use_fp8 is not None else _uses_fp8(quant_config)
        recv_x, count, handle, _, hook = self.buffer.low_latency_dispatch(
            a1, topk_ids, self._max_tokens, num_experts, use_fp8=use_fp8, return_recv_hook=True)
        self._handles.append((handle, apply_router_weight_on_input))
        expert_x, expert_scale = recv_x if use_fp8 else (recv_x, None)

        def receiver():
            return expert_x, expert_scale, ExpertTokensMetadata(expert_num_tokens=count,
                                                                expert_num_tokens_cpu=None), None, None

        return hook, receiver

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool, weight_and_reduce_impl=None) -> None:
        """Combine: `output[t] = sum_k topk_weights[t, k] * fused_expert_output(t, k)`, written in place."""
        hook = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                   apply_router_weight_on_input, weight_and_reduce_impl)
        hook()

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, apply_router_weight_on_input: bool, weight_and_reduce_impl=None):
        """Send the expert outputs now; returns the hook that receives and writes `output`."""
        if not self._handles:
            raise ValueError("finalize: no prepared call to finalize (prepare and finalize alternate)")
        handle, weighted_on_input = self._handles.popleft()
        weights = torch.ones_like(topk_weights) if weighted_on_input else topk_weights
        _, _, hook = self.buffer.low_latency_combine(fused_expert_output, topk_ids, weights.float(), handle,
                                                     return_recv_hook=True, out=output)
        return hook


__all__ = ["MoeA2APrepareAndFinalize", "FusedMoEActivationFormat", "ExpertTokensMetadata"]
