"""A vLLM prepare/finalize backend: `MoeA2APrepareAndFinalize`, over `moe_a2a.compat.Buffer`.

vLLM's modular fused-MoE splits a layer into [prepare: quantise + dispatch] -> [experts] -> [finalize:
combine]; `FusedMoEKernel` accepts a prepare/finalize object only if it is a
`FusedMoEPrepareAndFinalizeModular` (vLLM 0.33, `modular_kernel.py`). This class subclasses that base
when vLLM is importable; without vLLM it subclasses a local stand-in of the same name and methods
(and `FusedMoEActivationFormat`, `ExpertTokensMetadata` are stand-ins with vLLM's names and fields), so
it imports and is tested here. docs/compat.md says how to use it and what differs from vLLM's DeepEP
low-latency backend, whose interface (not code) it follows.

- Experts see the batched format: `[num_local_experts, capacity, hidden]` with per-expert counts
  (`activation_format == BatchedExperts`), capacity = `max_num_tokens_per_rank * num_dispatchers`.
- Placement: rank r hosts physical experts `[r*L, (r+1)*L)`. vLLM's round-robin placement and EPLB
  give `global_to_physical` (logical id -> the physical slot dispatched to), `physical_to_global` and
  `local_expert_global_ids`; the routes are mapped through `global_to_physical` before the dispatch
  and the combine. `expert_map` (which vLLM passes under expert parallelism) is accepted and checked
  against that placement the first time each map tensor is seen (one host copy; vLLM's warm-up runs
  before graph capture).
- Quantisation follows vLLM's rule for DeepEP low-latency: fp8 in the dispatch only for 128 x 128 block
  quantisation (the dispatch's pack kernel quantises: fp32 scales per 128 elements, or UE8M0 when the
  experts take packed UE8M0 scales); per-token and per-tensor fp8 dispatch bf16 and quantise the
  received rows after. int8, nvfp4, mxfp4, mxfp8 (and any other) raise ValueError naming what is
  supported.
- Micro-batches (dual-batch overlap): the dispatch handle is kept per micro-batch id (vLLM's
  `dbo_current_ubatch_id()`, or the `ubatch_id` callable given), so prepare / finalize of two
  micro-batches may interleave in any order; `prepare_async` and `finalize_async` return
  `(hook, receiver)`.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .deep_ep import Buffer

FP8_MAX = 448.0  # float8_e4m3fn
DISPATCH_QUANT_BLOCK = 128  # the dispatch quantises in groups of 128 elements, as DeepEP's kernels do

try:  # vLLM's own types when it is there, so that FusedMoEKernel's isinstance checks pass
    from vllm.model_executor.layers.fused_moe import modular_kernel as _mk

    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    FusedMoEPrepareAndFinalizeModular = _mk.FusedMoEPrepareAndFinalizeModular
    FusedMoEActivationFormat = _mk.FusedMoEActivationFormat
    ExpertTokensMetadata = _mk.ExpertTokensMetadata
    HAVE_VLLM = True
except Exception:  # noqa: BLE001 - any import failure: vLLM absent or of another shape
    HAVE_VLLM = False

    class TopKWeightAndReduceDelegate:
        """Stand-in for vLLM's marker class: "the prepare/finalize applies the weights and reduces"."""

    class FusedMoEActivationFormat(enum.Enum):
        """Stand-in for vLLM's enum (same names and values)."""

        Standard = ("standard",)
        BatchedExperts = ("batched_experts",)

    @dataclass
    class ExpertTokensMetadata:
        """Stand-in for vLLM's dataclass (same fields)."""

        expert_num_tokens: torch.Tensor
        expert_num_tokens_cpu: torch.Tensor | None

    class FusedMoEPrepareAndFinalizeModular:
        """Stand-in for vLLM's base class: the defaults it gives (the abstract methods are this module's)."""

        def post_init_setup(self, fused_experts) -> None:
            return

        def supports_async(self) -> bool:
            return False

        def on_commit(self) -> None:
            return

try:
    from vllm.v1.worker.ubatching import dbo_current_ubatch_id as _vllm_ubatch_id
except Exception:  # noqa: BLE001
    _vllm_ubatch_id = None


def _no_ubatch() -> int:
    return 0


SUPPORTED_QUANT = ("None (bf16 dispatch); torch.float8_e4m3fn with block_shape [128, 128] (quantised in the "
                   "dispatch), per-token or per-tensor (a bf16 dispatch, quantised after)")


def quant_mode(quant_config, use_fp8_dispatch: bool | None = None) -> str:
    """What prepare does for `quant_config` (vLLM's `FusedMoEQuantConfig`, or anything with its fields):
    "bf16", "fp8_dispatch" (128 x 128 blocks, quantised by the dispatch), "fp8_block" (other blocks, or
    `use_fp8_dispatch=False`: quantised after a bf16 dispatch), "fp8_token", "fp8_tensor" (quantised after a
    bf16 dispatch). ValueError for any other activation dtype (int8, nvfp4, mxfp4, mxfp8, ...)."""
    dtype = getattr(quant_config, "quant_dtype", None) if quant_config is not None else None
    if dtype is None:
        if use_fp8_dispatch:
            raise ValueError("use_fp8_dispatch=True needs quant_config.quant_dtype=torch.float8_e4m3fn with "
                             "block_shape [128, 128], got no activation quantisation")
        return "bf16"
    if dtype is not torch.float8_e4m3fn:
        raise ValueError(f"quant_config.quant_dtype={dtype!r}: not supported by moe_a2a's prepare/finalize "
                         f"(int8, nvfp4, mxfp4 and mxfp8 are not); supported: {SUPPORTED_QUANT}")
    block = getattr(quant_config, "block_shape", None)
    if block is not None:
        block = [int(b) for b in block]
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"quant_config.block_shape: expected [rows, cols], got {block!r}")
        if block == [DISPATCH_QUANT_BLOCK, DISPATCH_QUANT_BLOCK] and use_fp8_dispatch is not False:
            return "fp8_dispatch"
        mode = "fp8_block"
    elif getattr(quant_config, "per_act_token_quant", False):
        mode = "fp8_token"
    else:
        mode = "fp8_tensor"
    if use_fp8_dispatch:
        raise ValueError(f"use_fp8_dispatch=True: the dispatch quantises only 128 x 128 blocks (vLLM's rule for "
                         f"DeepEP low-latency), got {mode[4:]} quantisation (block_shape={block!r}); leave "
                         f"use_fp8_dispatch None to dispatch bf16 and quantise after")
    return mode


def _fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """scale = amax / 448, and 1 where amax is 0 (the library's rule, triton_kernels/quant.py)."""
    # A tensor divisor: CUDA divides by a Python number through its reciprocal (not correctly rounded).
    return torch.where(amax > 0, amax / torch.full((), FP8_MAX, device=amax.device), torch.ones_like(amax))


def quantize_received(x: torch.Tensor, count: torch.Tensor, mode: str, quant_config) -> tuple:
    """fp8 of the received bf16 rows `x [L, C, H]` with scales in vLLM's batched shapes: per token
    `[L, C, 1]`, per tensor `[L, 1, 1]` (a static `quant_config.a1_scale` if set, else amax over the rows
    received, `count[l]` of expert l), blocks of k columns `[L, C, ceil(H / k)]`. fp32 scales; no host sync."""
    L, C, H = x.shape
    if mode == "fp8_token":
        scale = _amax_scale(x.abs().amax(dim=-1, keepdim=True).float())
        return _fp8(x, scale), scale
    if mode == "fp8_tensor":
        a1_scale = getattr(quant_config, "a1_scale", None)
        if a1_scale is not None:
            if a1_scale.numel() != 1:
                raise ValueError(f"quant_config.a1_scale: expected one per-tensor scale, got {a1_scale.numel()} "
                                 f"(per-token static scales are not dispatched)")
            scale = a1_scale.reshape(1, 1, 1).float().to(x.device)
        else:
            valid = torch.arange(C, device=x.device)[None, :] < count.to(x.device)[:, None]
            amax = torch.where(valid, x.abs().amax(dim=-1).float(), torch.zeros((), device=x.device)).amax()
            scale = _amax_scale(amax).reshape(1, 1, 1)
        return _fp8(x, scale), scale.expand(L, 1, 1).contiguous()
    k = int(quant_config.block_shape[1])
    S = -(-H // k)
    pad = S * k - H
    xp = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    scale = _amax_scale(xp.view(L, C, S, k).abs().amax(dim=-1))
    q = _fp8(xp.view(L, C, S, k), scale[..., None]).view(L, C, S * k)[..., :H]
    return q.contiguous(), scale


class MoeA2APrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    """moe_a2a as a vLLM all-to-all backend (low-latency, batched experts).

    Constructed as vLLM constructs its `DeepEPLLPrepareAndFinalize` (`all2all_utils.maybe_make_prepare_finalize`:
    the buffer positionally, the rest by keyword), so `install_as_deepep_low_latency` can put it in that
    class's place.

    Args:
        buffer: a `moe_a2a.compat.Buffer` over the expert-parallel group.
        max_num_tokens_per_rank: the most tokens a rank dispatches per call; `max_tokens_per_rank=` (the
            name vLLM's DeepEP backend takes) is the same argument: give one of the two.
        num_dispatchers: ranks that dispatch (the group size).
        use_fp8_dispatch: None (default): fp8 in the dispatch exactly when the quant config is fp8 with
            128 x 128 blocks; False: always dispatch bf16 (and quantise after); True: require the former.
        global_to_physical, physical_to_global, local_expert_global_ids: vLLM's expert-id mapping for
            round-robin placement and EPLB (None: physical = global, experts contiguous per rank).
        ubatch_id: returns the current micro-batch id (default: vLLM's `dbo_current_ubatch_id`, else 0).
    """

    def __init__(self, buffer: Buffer, max_num_tokens_per_rank: int | None = None, num_dispatchers: int | None = None,
                 use_fp8_dispatch: bool | None = None, global_to_physical: torch.Tensor | None = None,
                 physical_to_global: torch.Tensor | None = None,
                 local_expert_global_ids: torch.Tensor | None = None,
                 ubatch_id: Callable[[], int] | None = None, *, max_tokens_per_rank: int | None = None) -> None:
        super().__init__()
        if not isinstance(buffer, Buffer):
            raise ValueError(f"buffer: expected a moe_a2a.compat.Buffer, got {type(buffer).__name__} (with "
                             f"vLLM's deepep_low_latency backend, `import deep_ep` must resolve to "
                             f"moe_a2a.compat.deep_ep: MOE_A2A_AS_DEEP_EP=1, docs/compat.md)")
        if (max_num_tokens_per_rank is None) == (max_tokens_per_rank is None):
            raise ValueError(f"give one of max_num_tokens_per_rank ({max_num_tokens_per_rank!r}) and "
                             f"max_tokens_per_rank ({max_tokens_per_rank!r}, vLLM's name for it)")
        if max_num_tokens_per_rank is None:
            max_num_tokens_per_rank = max_tokens_per_rank
        if isinstance(max_num_tokens_per_rank, bool) or not isinstance(max_num_tokens_per_rank, int) \
                or max_num_tokens_per_rank < 1:
            raise ValueError(f"max_num_tokens_per_rank: expected a positive int, got {max_num_tokens_per_rank!r}")
        if num_dispatchers != buffer.group_size:
            raise ValueError(f"num_dispatchers: expected the buffer's group size {buffer.group_size}, "
                             f"got {num_dispatchers!r}")
        if use_fp8_dispatch not in (None, True, False):
            raise ValueError(f"use_fp8_dispatch: expected None, True or False, got {use_fp8_dispatch!r}")
        self.buffer, self._max_tokens, self._num_dispatchers = buffer, max_num_tokens_per_rank, num_dispatchers
        self.use_fp8_dispatch = use_fp8_dispatch
        self.use_ue8m0_dispatch = False  # set by post_init_setup when the experts take packed UE8M0 scales
        maps = {"global_to_physical": global_to_physical, "physical_to_global": physical_to_global,
                "local_expert_global_ids": local_expert_global_ids}
        for name, t in maps.items():
            if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 1
                                  or t.dtype.is_floating_point or t.dtype == torch.bool):
                raise ValueError(f"{name}: expected a 1-D integer tensor, got {t!r}")
        if global_to_physical is not None and physical_to_global is not None:
            g2p, p2g = global_to_physical.cpu().long(), physical_to_global.cpu().long()
            if g2p.numel() and (g2p.min() < 0 or g2p.max() >= p2g.numel()
                                or not torch.equal(p2g[g2p], torch.arange(g2p.numel()))):
                raise ValueError("global_to_physical / physical_to_global: physical_to_global[global_to_physical[e]] "
                                 "must be e for every global expert e")
        self.global_to_physical = None if global_to_physical is None else global_to_physical.long()
        self.physical_to_global = None if physical_to_global is None else physical_to_global.long()
        self.local_expert_global_ids = None if local_expert_global_ids is None else local_expert_global_ids.long()
        self._ubatch_id = ubatch_id or _vllm_ubatch_id or _no_ubatch
        self._handles: dict[int, tuple] = {}  # micro-batch id -> (handle, weighted_on_input, dispatch ids)
        self._checked_map = None  # (expert_map, num_experts) already checked against the placement

    # ---- what vLLM asks of a backend ----------------------------------------------------------
    @staticmethod
    def maybe_roundup_layer_hidden_size(hidden_size: int, act_dtype: torch.dtype | None = None) -> int:
        """The hidden size the layer's buffers get (vLLM's `all2all_utils.maybe_roundup_layer_hidden_size`
        calls it on its DeepEP low-latency class): `hidden_size` itself. DeepEP's kernels are compiled for eight
        sizes, so vLLM pads to the next of them; ours take any hidden size (an fp8 dispatch's last scale
        covers a partial group of 128)."""
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size!r}")
        return hidden_size

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

    def post_init_setup(self, fused_experts) -> None:
        """Called by FusedMoEKernel once with the experts: refuses their quant config early (ValueError),
        and turns on UE8M0 scales in an fp8 dispatch when they take packed UE8M0 activation scales."""
        quant_config = getattr(fused_experts, "quant_config", None)
        mode = quant_mode(quant_config, self.use_fp8_dispatch) if quant_config is not None else None
        supports = getattr(fused_experts, "supports_packed_ue8m0_act_scales", None)
        if mode in (None, "fp8_dispatch") and callable(supports) and supports():
            self.use_ue8m0_dispatch = True

    # ---- placement ---------------------------------------------------------------------------
    def _to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        ids = topk_ids.long()
        g2p = self.global_to_physical
        if g2p is None:
            return ids
        if g2p.device != ids.device:
            g2p = self.global_to_physical = g2p.to(ids.device)
        return torch.where(ids >= 0, g2p[ids.clamp(min=0)], ids)  # masked slots (-1) stay -1

    def _check_placement(self, expert_map: torch.Tensor | None, num_experts: int) -> None:
        """vLLM's expert_map (global id -> local index, -1 elsewhere) and the mapping tensors against this
        backend's placement (rank r hosts physical experts [r*L, (r+1)*L)); once per map tensor."""
        if expert_map is None or (self._checked_map is not None and self._checked_map[0] is expert_map
                                  and self._checked_map[1] == num_experts):
            return
        W, r = self.buffer.group_size, self.buffer.rank
        if num_experts % W:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size ({W})")
        L = num_experts // W
        em = expert_map.detach().cpu().long()
        n_global = em.numel()
        g2p = torch.arange(n_global) if self.global_to_physical is None else self.global_to_physical.cpu()
        if g2p.numel() != n_global:
            raise ValueError(f"expert_map has {n_global} global experts, global_to_physical {g2p.numel()}")
        if self.physical_to_global is not None and self.physical_to_global.numel() != num_experts:
            raise ValueError(f"physical_to_global: expected num_experts ({num_experts}) physical slots, got "
                             f"{self.physical_to_global.numel()}")
        if self.local_expert_global_ids is not None:
            lg = self.local_expert_global_ids.cpu()
            want = (self.physical_to_global.cpu()[r * L:(r + 1) * L] if self.physical_to_global is not None
                    else None)
            if lg.numel() != L or (want is not None and not torch.equal(lg, want)):
                raise ValueError(f"local_expert_global_ids on rank {r}: expected the {L} global ids of physical "
                                 f"experts [{r * L}, {(r + 1) * L}), got {lg.tolist()}")
        here = (g2p >= r * L) & (g2p < (r + 1) * L)
        bad = here & (em != g2p - r * L)
        if self.global_to_physical is None:  # no redundant experts: the map is exactly the contiguous one
            bad |= ~here & (em != -1)
        if bad.any():
            e = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"expert_map on rank {r}: global expert {e} maps to local {int(em[e])}, but this backend hosts "
                f"physical experts [{r * L}, {(r + 1) * L}) on rank {r} and dispatches expert {e} to physical "
                f"{int(g2p[e])}" + ("; with round-robin placement or EPLB pass global_to_physical / "
                                    "physical_to_global / local_expert_global_ids" if self.global_to_physical is None
                                    else ""))
        self._checked_map = (expert_map, num_experts)

    # ---- prepare -----------------------------------------------------------------------------
    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: torch.Tensor | None, apply_router_weight_on_input: bool, quant_config=None,
                defer_input_quant: bool = False):
        """Quantise and dispatch; returns `(expert_x [L, C, H], expert_x_scale | None,
        ExpertTokensMetadata, None, None)`."""
        hook, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                            apply_router_weight_on_input, quant_config, defer_input_quant)
        hook()
        return receiver()

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      expert_map: torch.Tensor | None, apply_router_weight_on_input: bool, quant_config=None,
                      defer_input_quant: bool = False):
        """Send now; returns `(hook, receiver)`: the hook receives, the receiver then returns what
        `prepare` returns. The handle is kept under the current micro-batch id."""
        if defer_input_quant:
            raise ValueError("defer_input_quant=True: not supported (this backend quantises in prepare); choose "
                             "experts that take quantised inputs")
        mode = quant_mode(quant_config, self.use_fp8_dispatch)
        self._check_placement(expert_map, num_experts)
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("apply_router_weight_on_input needs top-1 routing")
            a1 = (a1.float() * topk_weights.float()).to(a1.dtype)
        ids = self._to_physical(topk_ids)
        use_fp8 = mode == "fp8_dispatch"
        ue8m0 = use_fp8 and self.use_ue8m0_dispatch
        recv_x, count, handle, _, hook = self.buffer.low_latency_dispatch(
            a1, ids, self._max_tokens, num_experts, use_fp8=use_fp8, round_scale=ue8m0, use_ue8m0=ue8m0,
            return_recv_hook=True)
        self._handles[self._ubatch_id()] = (handle, apply_router_weight_on_input, ids)

        def receiver():
            if use_fp8:
                expert_x, expert_scale = recv_x
            elif mode == "bf16":
                expert_x, expert_scale = recv_x, None
            else:
                expert_x, expert_scale = quantize_received(recv_x, count, mode, quant_config)
            return expert_x, expert_scale, ExpertTokensMetadata(expert_num_tokens=count,
                                                                expert_num_tokens_cpu=None), None, None

        return hook, receiver

    # ---- finalize ----------------------------------------------------------------------------
    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool, weight_and_reduce_impl=None) -> None:
        """Combine: `output[t] = sum_k topk_weights[t, k] * fused_expert_output(t, k)`, written in place."""
        hook, receiver = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                             apply_router_weight_on_input, weight_and_reduce_impl)
        hook()
        receiver()

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, apply_router_weight_on_input: bool, weight_and_reduce_impl=None):
        """Send the expert outputs now; returns `(hook, receiver)`: the hook receives and writes `output`,
        the receiver has nothing left to do (vLLM's modular kernel calls both, the hook through DBO).

        `weight_and_reduce_impl` must be None or a `TopKWeightAndReduceDelegate` (vLLM's DeepEP backend
        asserts the same): the combine applies the weights and reduces, so experts that would do it
        themselves are refused (ValueError, before anything is sent; the prepared call stays for a retry)."""
        if weight_and_reduce_impl is not None and not isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            raise ValueError(f"weight_and_reduce_impl: expected None or a TopKWeightAndReduceDelegate (the combine "
                             f"applies the top-k weights and reduces), got {type(weight_and_reduce_impl).__name__}: "
                             f"choose experts whose finalize_weight_and_reduce_impl() delegates")
        ub = self._ubatch_id()
        if ub not in self._handles:
            raise ValueError(f"finalize: no prepared call for micro-batch {ub} (prepare it first; each prepare "
                             f"is finalized once)")
        handle, weighted_on_input, ids = self._handles.pop(ub)
        weights = torch.ones_like(topk_weights) if weighted_on_input else topk_weights
        _, _, hook = self.buffer.low_latency_combine(fused_expert_output, ids, weights.float(), handle,
                                                     return_recv_hook=True, out=output)
        return hook, _nothing


def _nothing() -> None:
    return None


def install_as_deepep_low_latency(all2all_utils=None) -> None:
    """Route vLLM's `deepep_low_latency` backend to `MoeA2APrepareAndFinalize`: sets the name
    `DeepEPLLPrepareAndFinalize` in vLLM's `fused_moe/all2all_utils.py` (default: that module, imported),
    which its `maybe_make_prepare_finalize` constructs and its `maybe_roundup_layer_hidden_size` asks. The
    name, not the function: five vLLM modules import `maybe_make_prepare_finalize` by name, so wrapping the
    function would miss them. `DEEPEP_QUANT_BLOCK_SHAPE` is set too where vLLM left it undefined (it imports
    its DeepEP modules only on CUDA-like platforms). The plugin (`moe_a2a.compat.plugin`, with
    `MOE_A2A_VLLM_PREPARE_FINALIZE=1`) calls this when that module is imported."""
    if all2all_utils is None:
        import importlib

        all2all_utils = importlib.import_module("vllm.model_executor.layers.fused_moe.all2all_utils")
    all2all_utils.DeepEPLLPrepareAndFinalize = MoeA2APrepareAndFinalize
    if not hasattr(all2all_utils, "DEEPEP_QUANT_BLOCK_SHAPE"):
        all2all_utils.DEEPEP_QUANT_BLOCK_SHAPE = [DISPATCH_QUANT_BLOCK, DISPATCH_QUANT_BLOCK]


__all__ = ["MoeA2APrepareAndFinalize", "FusedMoEPrepareAndFinalizeModular", "FusedMoEActivationFormat",
           "ExpertTokensMetadata", "TopKWeightAndReduceDelegate", "install_as_deepep_low_latency", "quant_mode",
           "quantize_received", "HAVE_VLLM", "SUPPORTED_QUANT"]
