"""The argument and tensor contracts of `AllToAll`: each failure a ValueError naming the argument, with
expected against actual. The device an instance works on (`canonical_device`), the shrink mode's mask
(`check_rank_mask`), and each half's tensors (`check_dispatch_inputs` ... `check_combine_recv`), checked
before anything of a call is sent. `moe_a2a.all_to_all` re-exports the public ones.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import A2AConfig, Layout
from ..triton_kernels import routing
from ..triton_kernels._checks import canonical_device, same_device
from ..triton_kernels.quant import Fp8Quantize, check_fused_quantize


_Tensor, _F32, _I32, _I64 = torch.Tensor, torch.float32, torch.int32, torch.int64


def check_tensor(name: str, t: Any, shape: tuple | None, dtype, device: torch.device, last_contig: bool = True) -> None:
    """Tensor contract at the API boundary: a ValueError naming the argument, expected vs actual."""
    # The common case in a few C calls (every call checks about ten tensors); messages only on a failure
    # (a subclass of Tensor takes the detailed path, which accepts it alike).
    if type(t) is _Tensor:
        dt = t.dtype
        if (dt is dtype or (type(dtype) is tuple and dt in dtype)) and t.device == device:
            sh = t.shape
            if (shape is None or sh == shape) and (not last_contig or not sh or t.stride()[-1] == 1 or sh[-1] <= 1):
                return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if not same_device(t.device, device):
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if last_contig and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got strides {t.stride()}")


def check_rank_mask(mask, rank: int, world_size: int) -> None:
    """`AllToAll(rank_mask=...)`: a `RankMask` of this rank and world."""
    from .shrink import RankMask

    if not isinstance(mask, RankMask) or (mask.rank, mask.world_size) != (rank, world_size):
        raise ValueError(f"rank_mask: expected a runtime.shrink.RankMask(world_size={world_size}, rank={rank}), "
                         f"got {mask!r}")


def check_dispatch_inputs(cfg: A2AConfig, device, x, x_scale, indices, bound_m, weights=None) -> None:
    """The send half's tensor contracts (indices checked on the host on a CPU only)."""
    # x, x_scale and indices: their common case in one test of what the checks after it accept; those
    # run (and say what is wrong) only when it fails.
    sh = x.shape if type(x) is _Tensor else None
    if sh is not None and len(sh) == 2 and x.dtype is cfg.in_dtype and x.device == device \
            and sh[1] == cfg.hidden_dim and sh[0] <= cfg.max_num_tokens and (sh[1] <= 1 or x.stride()[-1] == 1) \
            and (type(x_scale) is _Tensor and x_scale.dtype is _F32 and x_scale.device == device
                 and x_scale.shape == (sh[0], cfg.num_scales) and (cfg.num_scales <= 1 or x_scale.stride()[-1] == 1)
                 if cfg.has_scales else x_scale is None) \
            and type(indices) is _Tensor and (indices.dtype is _I64 or indices.dtype is _I32) \
            and indices.device == device and indices.shape == (sh[0], cfg.experts_per_token) \
            and indices.is_contiguous():
        T = sh[0]
    else:
        check_tensor("x", x, None, cfg.in_dtype, device)
        if x.dim() != 2 or x.shape[1] != cfg.hidden_dim:
            raise ValueError(f"x: expected [T, {cfg.hidden_dim}], got {tuple(x.shape)}")
        T = x.shape[0]
        if T > cfg.max_num_tokens:
            raise ValueError(f"x: {T} tokens > max_num_tokens ({cfg.max_num_tokens})")
        if cfg.has_scales:
            if x_scale is None:
                raise ValueError(f"x_scale: this config has scales (scale_block={cfg.block_size}); got None")
            check_tensor("x_scale", x_scale, (T, cfg.num_scales), torch.float32, device)
        elif x_scale is not None:
            raise ValueError("x_scale: this config has no scales; pass None")
        check_tensor("indices", indices, (T, cfg.experts_per_token), (torch.int32, torch.int64), device)
        if not indices.is_contiguous():
            raise ValueError("indices: must be contiguous")
    if bound_m is not None:
        check_tensor("bound_m", bound_m, (1,), torch.int32, device)
    if cfg.combine_rows == "rank":  # the experts' rank applies the weights: they travel with the rows
        if weights is None:
            raise ValueError("weights: cfg.combine_rows='rank' reduces at the experts' rank, which needs the "
                             "routes' weights with the dispatch: pass weights=[T, K] float32")
        check_tensor("weights", weights, (T, cfg.experts_per_token), torch.float32, device)
    elif weights is not None:
        raise ValueError("weights: only with cfg.combine_rows='rank' (else the combine takes them); pass None")
    if device.type != "cuda":
        # CPU: the checks cost no device sync, so bad input is refused before anything is sent.
        # GPU: the routing kernel checks on the device; the combine's end says it (no host sync).
        if bound_m is not None and not 0 <= int(bound_m[0]) <= T:
            raise ValueError(f"bound_m: expected a live token count in [0, {T}] (x has {T} rows), "
                             f"got {int(bound_m[0])}")
        routing.validate_indices(indices if bound_m is None else indices[: int(bound_m[0])], cfg.num_experts)


def check_quantize(cfg: A2AConfig, quantize, seen: tuple | None) -> tuple[Any, tuple | None]:
    """`dispatch(quantize=)`: `(the checked quantisation or None, what to remember)`. `seen` is the last
    `(Fp8Quantize given, as checked)`: a frozen Fp8Quantize is checked once (callers reuse one). Required
    when `A2AConfig.payload_bytes` makes the rows narrower than a token."""
    if quantize is not None:
        if seen is not None and seen[0] is quantize:
            quantize = seen[1]
        else:
            checked = check_fused_quantize("quantize", quantize, cfg)
            if isinstance(quantize, Fp8Quantize):
                seen = (quantize, checked)
            quantize = checked
    if quantize is None and cfg.x_bytes < cfg.token_bytes:
        raise ValueError(f"quantize: expected a quant.Fp8Quantize: this config's rows carry "
                         f"{cfg.x_bytes} of a token's {cfg.token_bytes} bytes "
                         f"(A2AConfig.payload_bytes), so every dispatch quantises in the pack")
    return quantize, seen


def check_dispatch_outputs(cfg: A2AConfig, lay: Layout, device, num, x, xs, ranges=None, qs=None,
                           quantize=None) -> None:
    """The receive half's output contracts (`qs`: out_quantized_scale, for the call's `quantize`)."""
    # Each optional output's common case in one test of what the checks below accept; they run (and say
    # what is wrong) only when it fails.
    if ranges is not None and not (type(ranges) is _Tensor and ranges.dtype is _I64 and ranges.device == device
                                   and ranges.shape == (lay.num_local_experts, lay.world_size)
                                   and ranges.is_contiguous()):
        check_tensor("out_source_ranges", ranges, (lay.num_local_experts, lay.world_size), torch.int64, device)
        if not ranges.is_contiguous():
            raise ValueError(f"out_source_ranges: expected a contiguous tensor, got strides {ranges.stride()}")
    check_tensor("out_expert_num_tokens", num, (lay.num_local_experts,), torch.int32, device)
    check_tensor("out_expert_x", x, None, cfg.in_dtype, device)
    if x.dim() != 2 or x.shape[1] != cfg.hidden_dim or x.shape[0] < lay.max_dispatch_rows:
        raise ValueError(f"out_expert_x: expected [>= {lay.max_dispatch_rows}, {cfg.hidden_dim}], "
                         f"got {tuple(x.shape)} (use empty_dispatch_outputs())")
    sh = xs.shape if type(xs) is _Tensor and xs.dtype is _F32 and xs.device == device else None
    if cfg.has_scales and not (sh is not None and (
            (len(sh) == 2 and sh[1] == cfg.num_scales and sh[0] >= lay.max_dispatch_rows)
            or (len(sh) == 3 and lay.expert_capacity and not lay.rank_rows
                and sh == (lay.num_local_experts, lay.expert_capacity, cfg.num_scales)))):
        check_tensor("out_expert_x_scale", xs, None, torch.float32, device, last_contig=False)
        # [L, C, S] of any strides (e.g. DeepEP's column-major scales) too, with a capacity C (the unpack's;
        # per-rank rows' expand takes [R, S] only).
        C, S = lay.expert_capacity, cfg.num_scales
        three_d = [lay.num_local_experts, C, S] if C and not lay.rank_rows else None
        if xs.dim() == 3 and three_d is None:
            why = "with dispatch_rows='rank'" if C else "without A2AConfig.expert_capacity"
            raise ValueError(f"out_expert_x_scale: expected [>= {lay.max_dispatch_rows}, {S}] (a 3-D one is not "
                             f"taken {why}), got {tuple(xs.shape)}")
        if list(xs.shape) != three_d and (xs.dim() != 2 or xs.shape[1] != S or xs.shape[0] < lay.max_dispatch_rows):
            raise ValueError(f"out_expert_x_scale: expected [>= {lay.max_dispatch_rows}, {S}]"
                             + (f" or {three_d}" if three_d else "") + f", got {tuple(xs.shape)}")
    elif xs is not None and not cfg.has_scales:
        raise ValueError("out_expert_x_scale: this config has no scales; pass None")
    n = None if qs is None or quantize is None else quantize.scale_bytes(cfg.hidden_dim) // 4  # words a row
    if qs is not None and not (n is not None and type(qs) is _Tensor
                               and (qs.dtype is _F32 or qs.dtype is _I32) and qs.device == device
                               and ((lay.expert_capacity
                                     and qs.shape == (lay.num_local_experts, lay.expert_capacity, n))
                                    or qs.shape == (x.shape[0], n))):
        if quantize is None:
            raise ValueError("out_quantized_scale: expected None (the call has no quantize), got a tensor")
        C = lay.expert_capacity
        check_tensor("out_quantized_scale", qs, None, (torch.float32, torch.int32), device, last_contig=False)
        if not (C and list(qs.shape) == [lay.num_local_experts, C, n]) and list(qs.shape) != [x.shape[0], n]:
            raise ValueError(f"out_quantized_scale: expected [{x.shape[0]}, {n}] (out_expert_x's rows)"
                             + (f" or {[lay.num_local_experts, C, n]}" if C else "") + f", got {tuple(qs.shape)}")


def check_combine_send(cfg: A2AConfig, lay: Layout, device, expert_y) -> None:
    """The combine's send half: expert outputs as many rows as the dispatch output (`[rows, H]`), or with an
    expert capacity C and rows by expert, `[L, C, H]` whose first two dimensions merge (one run of rows)."""
    H = cfg.hidden_dim
    if type(expert_y) is _Tensor and expert_y.dtype is cfg.out_dtype and expert_y.device == device:
        sh = expert_y.shape  # the common cases in one test each of what the checks below accept
        if len(sh) == 2 and sh[1] == H and sh[0] >= lay.max_dispatch_rows \
                and (sh[1] <= 1 or expert_y.stride()[-1] == 1):
            return
        if len(sh) == 3 and expert_y.is_contiguous() and sh == (lay.num_local_experts, lay.expert_capacity, H):
            return
    check_tensor("expert_y", expert_y, None, cfg.out_dtype, device)
    C, L = lay.expert_capacity, lay.num_local_experts
    if expert_y.dim() == 3:
        if not C:
            raise ValueError(f"expert_y: expected [rows, {H}] (a 3-D one is not taken without "
                             f"A2AConfig.expert_capacity), got {tuple(expert_y.shape)}")
        if tuple(expert_y.shape) != (L, C, H):
            raise ValueError(f"expert_y: expected [rows, {H}] or [{L}, {C}, {H}], got {tuple(expert_y.shape)}")
        st = expert_y.stride()
        if st[2] != 1 or st[0] != C * st[1]:
            raise ValueError(f"expert_y: a [{L}, {C}, {H}] tensor needs rows of stride 1 whose experts follow "
                             f"each other (strides (C * s, s, 1)), got strides {st}")
        return
    if expert_y.dim() != 2 or expert_y.shape[1] != cfg.hidden_dim:
        raise ValueError(f"expert_y: expected [rows, {cfg.hidden_dim}], got {tuple(expert_y.shape)}")
    if expert_y.shape[0] < lay.max_dispatch_rows:
        raise ValueError(f"expert_y: needs >= {lay.max_dispatch_rows} rows (as out_expert_x), "
                         f"got {expert_y.shape[0]}")


def check_combine_recv(cfg: A2AConfig, device, T: int, out_tokens, weights, indices, bound_m=None) -> None:
    """The combine's receive half: T is the dispatch's token count."""
    K = cfg.experts_per_token  # the common case in one test of what the checks below accept
    if bound_m is None and type(out_tokens) is _Tensor and type(weights) is _Tensor and type(indices) is _Tensor \
            and out_tokens.dtype is cfg.out_dtype and weights.dtype is _F32 \
            and (indices.dtype is _I64 or indices.dtype is _I32) and out_tokens.device == device \
            and weights.device == device and indices.device == device and out_tokens.shape == (T, cfg.hidden_dim) \
            and weights.shape == (T, K) and indices.shape == (T, K) \
            and (cfg.hidden_dim <= 1 or out_tokens.stride()[-1] == 1) \
            and (K <= 1 or (weights.stride()[-1] == 1 and indices.stride()[-1] == 1)):
        return
    check_tensor("out_tokens", out_tokens, (T, cfg.hidden_dim), cfg.out_dtype, device)
    check_tensor("weights", weights, (T, cfg.experts_per_token), torch.float32, device)
    check_tensor("indices", indices, (T, cfg.experts_per_token), (torch.int32, torch.int64), device)
    if bound_m is not None:  # as dispatch's: its value on a CPU only (a GPU's would need a host sync)
        check_tensor("bound_m", bound_m, (1,), torch.int32, device)
        if device.type != "cuda" and not 0 <= int(bound_m[0]) <= T:
            raise ValueError(f"bound_m: expected a live token count in [0, {T}] (the dispatch had {T} tokens), "
                             f"got {int(bound_m[0])}")
