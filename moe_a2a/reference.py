"""The executable specification of dispatch and combine (docs/design.md, Semantics), in plain torch.

No transport, no kernels, any world size, CPU or GPU. Every other implementation in this package is
tested against these two functions: data movement must match bitwise, the weighted sum to fp32
rounding (the reference sums in fp32 in k order and casts once, as the kernels do).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .config import A2AConfig, round_up


def _check_rank_inputs(cfg: A2AConfig, world_size: int, s: int, x, x_scale, idx) -> None:
    T = x.shape[0]
    if x.dim() != 2 or x.shape[1] != cfg.hidden_dim or x.dtype != cfg.in_dtype:
        raise ValueError(f"xs[{s}]: expected [T, {cfg.hidden_dim}] {cfg.in_dtype}, got {tuple(x.shape)} {x.dtype}")
    if T > cfg.max_num_tokens:
        raise ValueError(f"xs[{s}]: {T} tokens > max_num_tokens ({cfg.max_num_tokens})")
    if cfg.has_scales:
        if x_scale is None or tuple(x_scale.shape) != (T, cfg.num_scales) or x_scale.dtype != torch.float32:
            raise ValueError(f"x_scales[{s}]: expected [{T}, {cfg.num_scales}] float32")
    elif x_scale is not None:
        raise ValueError(f"x_scales[{s}]: this config has no scales; pass None")
    if idx.dim() != 2 or tuple(idx.shape) != (T, cfg.experts_per_token) or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices[{s}]: expected [{T}, {cfg.experts_per_token}] int32/int64, got "
                         f"{tuple(idx.shape)} {idx.dtype}")
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= cfg.num_experts):
        raise ValueError(f"indices[{s}]: values must be in [-1, {cfg.num_experts})")


def dispatch(
    cfg: A2AConfig,
    xs: Sequence[torch.Tensor],
    x_scales: Sequence[torch.Tensor | None] | None,
    indices: Sequence[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Dispatch of every source rank's tokens, as each destination rank must see it.

    Args:
        xs: per source rank, `[T_s, H]` in_dtype.
        x_scales: per source rank, `[T_s, num_scales]` float32, or None (entries or the whole list)
            when the config has no scales.
        indices: per source rank, `[T_s, K]` int32/int64, `-1` = not routed.

    Returns: per destination rank r, `(num_tokens int32[L], expert_x [R, H], expert_x_scale [R, S] | None)`
    with `R = sum_l round_up(num_tokens[l], expert_padding)`; expert l's rows start at
    `sum_{j<l} round_up(num_tokens[j], pad)`, ordered by (source rank, token, k); padding rows are zero.
    With `cfg.expert_capacity = C`: `R = L * C` and expert l's rows start at `l * C` (the rest of its C
    rows are zero); an expert receiving more than C rows is a ValueError.
    """
    W = len(xs)
    lay = cfg.layout(W)
    L = lay.num_local_experts
    if x_scales is None:
        x_scales = [None] * W
    if len(x_scales) != W or len(indices) != W:
        raise ValueError("xs, x_scales and indices must have one entry per source rank")
    for s in range(W):
        _check_rank_inputs(cfg, W, s, xs[s], x_scales[s], indices[s])

    # Every route as (expert, source, token, k), sorted by expert then (source, token, k).
    experts, sources, tokens = [], [], []
    for s in range(W):
        idx = indices[s].to(torch.int64)
        t, k = torch.nonzero(idx >= 0, as_tuple=True)  # row-major: (token, k) order
        experts.append(idx[t, k])
        sources.append(torch.full_like(t, s))
        tokens.append(t)
    expert = torch.cat(experts).cpu()
    source = torch.cat(sources).cpu()
    token = torch.cat(tokens).cpu()
    order = torch.argsort(expert, stable=True)  # stable keeps (source, token, k) order
    expert, source, token = expert[order], source[order], token[order]

    device = xs[0].device if W else "cpu"
    out = []
    for r in range(W):
        mine = (expert >= r * L) & (expert < (r + 1) * L)
        e_loc, src, tok = expert[mine] - r * L, source[mine], token[mine]
        counts = torch.bincount(e_loc, minlength=L).to(torch.int32)
        padded = [round_up(int(c), cfg.expert_padding) for c in counts]
        if cfg.expert_capacity is not None:
            over = [l for l in range(L) if int(counts[l]) > cfg.expert_capacity]
            if over:
                raise ValueError(f"rank {r}: local expert {over[0]} receives {int(counts[over[0]])} rows > "
                                 f"expert_capacity ({cfg.expert_capacity})")
            padded = [cfg.expert_capacity] * L
        R = sum(padded)
        ex = torch.zeros(R, cfg.hidden_dim, dtype=cfg.in_dtype, device=device)
        exs = torch.zeros(R, cfg.num_scales, dtype=torch.float32, device=device) if cfg.has_scales else None
        seg_start = 0
        for l in range(L):
            sel = e_loc == l
            n = int(counts[l])
            for row, (s, t) in enumerate(zip(src[sel].tolist(), tok[sel].tolist())):
                ex[seg_start + row] = xs[s][t]
                if exs is not None:
                    exs[seg_start + row] = x_scales[s][t]
            assert n == int(sel.sum())
            seg_start += padded[l]
        out.append((counts.to(device), ex, exs))
    return out


def expert_rows(cfg: A2AConfig, indices: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """For every source rank s, `[T_s, K]` int64: the row of `expert_x` (on the rank hosting the
    expert) that holds route (t, k) after dispatch, -1 for masked slots. Shared by `combine`."""
    W = len(indices)
    L = cfg.layout(W).num_local_experts
    counts = torch.zeros(W, cfg.num_experts, dtype=torch.int64)  # [source, expert]
    for s in range(W):
        idx = indices[s].to(torch.int64).cpu()
        counts[s] = torch.bincount(idx[idx >= 0], minlength=cfg.num_experts)
    totals = counts.sum(0)                                        # per expert
    padded = (totals + cfg.expert_padding - 1) // cfg.expert_padding * cfg.expert_padding
    seg_start = torch.zeros(cfg.num_experts, dtype=torch.int64)  # per expert, within its rank
    for r in range(W):
        p = padded[r * L:(r + 1) * L]
        if cfg.expert_capacity is not None:
            p = torch.full_like(p, cfg.expert_capacity)
        seg_start[r * L:(r + 1) * L] = torch.cumsum(p, 0) - p
    before = torch.cumsum(counts, 0) - counts                     # rows from earlier sources
    rows = []
    for s in range(W):
        flat = indices[s].to(torch.int64).cpu().reshape(-1)
        valid = torch.nonzero(flat >= 0).squeeze(1)               # (token, k) order
        e = flat[valid]
        order = torch.argsort(e, stable=True)
        sorted_e = e[order]
        first = torch.searchsorted(sorted_e, sorted_e)              # first position of each expert
        seen = torch.empty_like(e)
        seen[order] = torch.arange(len(e)) - first                  # earlier routes to the same expert
        row = torch.full_like(flat, -1)
        row[valid] = seg_start[e] + before[s, e] + seen
        rows.append(row.reshape(indices[s].shape))
    return rows


def combine(
    cfg: A2AConfig,
    indices: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    expert_ys: Sequence[torch.Tensor],
    out_tokens: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Combine: `out[t] = sum_k weights[t,k] * expert_y[row(t,k)]` over unmasked k.

    Args:
        indices: per source (home) rank, `[T_s, K]`, as given to `dispatch`.
        weights: per home rank, `[T_s, K]` float32.
        expert_ys: per expert rank, rows as `dispatch` laid them out, out_dtype.
        out_tokens: optional per home rank `[T_s, H]` previous values (the `accumulate=True` case).

    Returns per home rank `[T_s, H]` out_dtype: accumulated in fp32 in k order (the old value first
    when given) and cast once.
    """
    W = len(indices)
    rows = expert_rows(cfg, indices)
    L = cfg.layout(W).num_local_experts
    # All expert ranks' rows stacked, so a route's row is rank_base[rank] + row.
    rank_base = [0]
    for y in expert_ys:
        rank_base.append(rank_base[-1] + y.shape[0])
    all_y = torch.cat([y.float().cpu() for y in expert_ys]) if W else torch.zeros(0)
    out = []
    for s in range(W):
        idx = indices[s].to(torch.int64).cpu()
        T = idx.shape[0]
        acc = torch.zeros(T, cfg.hidden_dim, dtype=torch.float32)
        if out_tokens is not None:
            acc += out_tokens[s].float().cpu()
        w = weights[s].float().cpu()
        for k in range(idx.shape[1]):
            e = idx[:, k]
            live = torch.nonzero(e >= 0).squeeze(1)
            base = torch.tensor(rank_base[:-1], dtype=torch.int64)[e[live] // L]
            acc[live] += w[live, k, None] * all_y[base + rows[s][live, k]]
        out.append(acc.to(cfg.out_dtype).to(weights[s].device))
    return out
