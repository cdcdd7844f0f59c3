"""The executable specification of dispatch and combine (docs/design.md, Semantics), in plain torch.

No transport, no kernels, any world size, CPU or GPU. Every other implementation in this package is
tested against these two functions: data movement must match bitwise, the weighted sum to fp32
rounding (the reference sums in fp32 in k order and casts once, as the kernels do).

After them, the variants of issue 32 ("fewer bytes"): dispatch in one row per (token, destination rank)
expanded by the receiver (`dispatch_per_rank`, equal to `dispatch`), the combine reduced at the sender
(`combine_reduced_at_sender`), the fp8 combine (`combine_fp8`, and `fp8=True`), and the bytes each rank
sends per phase under each variant (`bytes_per_phase`, `WIRE_VARIANTS`).

Last, the relay of issue 46 (each token crosses the network once per destination node, fanned out over
NVLink, the combine reduced inside the experts' node): `dispatch_relay` (equal to `dispatch`), `combine_relay`
and the bytes and writes per phase (`relay_bytes_per_phase`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from .config import ROW_ALIGN_BYTES, WIRES, A2AConfig, ceil_div, round_up


Tensors = Sequence[torch.Tensor]  # one tensor per rank
Received = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # a rank's (num_tokens, expert_x, expert_x_scale)


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


def segment_rows(cfg: A2AConfig, rank: int, counts: torch.Tensor) -> list[int]:
    """Rows of each local expert's segment of `rank`'s output: its count rounded up to `expert_padding`,
    or `expert_capacity` for every expert (a count above it is refused, as the kernels abort the call)."""
    if cfg.expert_capacity is None:
        return [round_up(int(c), cfg.expert_padding) for c in counts]
    over = [l for l in range(len(counts)) if int(counts[l]) > cfg.expert_capacity]
    if over:
        raise ValueError(f"rank {rank}: local expert {over[0]} receives {int(counts[over[0]])} rows > "
                         f"expert_capacity ({cfg.expert_capacity})")
    return [cfg.expert_capacity] * len(counts)


def dispatch(cfg: A2AConfig, xs: Tensors, x_scales: Sequence[torch.Tensor | None] | None,
             indices: Tensors) -> list[Received]:
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
        padded = segment_rows(cfg, r, counts)
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


def combine(cfg: A2AConfig, indices: Tensors, weights: Tensors, expert_ys: Tensors,
            out_tokens: Tensors | None = None) -> list[torch.Tensor]:
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


# =====================================================================================================
# Fewer bytes (issue 32): rows per (token, destination rank), combine reduced at the sender, fp8 combine.
#
# The functions below specify the variants; every one returns exactly what `dispatch` returns, or
# `combine`'s result up to the documented roundings. None of them changes `dispatch` / `combine`.
#
# - Dispatch, one row per (token, rank): source rank s sends token t ONCE to every rank r that hosts at
#   least one of its live experts (DeepEP's `is_token_in_rank`), with the token's K expert ids (and,
#   when the combine is reduced at the sender, its K fp32 weights). Rank r receives, per source in rank
#   order, its rows in token order (`dispatch_rows_per_rank`), and expands each row into the slot of
#   every local expert the token was routed to, k by k (`expand_rank_rows`): a token routed twice to the
#   same local expert (a duplicate) fills two slots, as in `dispatch`. The expert-major output is
#   `dispatch`'s, bitwise (`dispatch_per_rank`).
# - Combine reduced at the sender (`combine_reduced_at_sender`): on the rank r holding the experts, for
#   every source token (s, t) with routes to r, `partial = sum_k weights[t, k] * expert_y[row(t, k)]`
#   over the live k whose expert is on r, in fp32, in k order (a product rounded to fp32, then an fp32
#   add, starting from +0), sent as ONE row per (token, rank), in out_dtype (rounded once, to nearest
#   even) or fp8; the home rank sums the rows it received in fp32 in ascending rank order (after the old
#   value with `accumulate`), and casts once to out_dtype. The weights are those given to the dispatch,
#   which carries them (K fp32 a token): bitwise the home rank's weights.
# - fp8 combine: every combine row (node-local or remote, so that the result does not depend on the
#   node layout) is block-scaled fp8 e4m3 with fp32 scales, 128 elements a block, the scale as the
#   dispatch's quantisation (`triton_kernels/quant.py`) but x times its reciprocal where the dispatch
#   divides (`quantize_fp8_blocks` below: one division a block, not one an element); the reduce
#   dequantises (`fp32(q) * scale`, one fp32 rounding) before it weights and sums. Per route
#   (`combine_fp8`): the expert output rows, as the grouped GEMM wrote them in out_dtype, are quantised.
#   Reduced at the sender: the fp32 partial is quantised directly (no out_dtype rounding in between).
# - Bytes (`bytes_per_phase`): the rows each rank sends in each phase, to itself, to the other ranks of its
#   node and to other nodes, for a routing, a node size and a `Wire` variant (`WIRE_VARIANTS`).
# =====================================================================================================
FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128  # elements per fp32 scale of an fp8 combine row


def quantize_fp8_blocks(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 with one fp32 scale per `block` elements of a row: `triton_kernels/quant.py`'s formula.

    Per row and block (the last block may be shorter): `scale = amax(|x_block|) / 448` (fp32, correctly
    rounded), `scale = 1` when it is below 2**-126 (all-zero and tiny blocks),
    `q = e4m3fn(clamp(x * (1 / scale), -448, 448))` (the reciprocal correctly rounded in fp32, one a block;
    round to nearest even). Returns `(q [T, H] float8_e4m3fn, scale [T, ceil(H / block)] float32)`. x: `[T, H]`
    bf16/fp16/fp32, finite. (The dispatch's quantisation, `triton_kernels/quant.py`, divides instead.)
    """
    T, H = x.shape
    S = ceil_div(H, block)
    padded = torch.nn.functional.pad(x.float(), (0, S * block - H)).reshape(T, S, block)
    # A tensor divisor: CUDA divides by a Python number through its reciprocal (not correctly rounded).
    scale = padded.abs().amax(-1) / torch.full((), FP8_E4M3_MAX, device=x.device)
    scale = torch.where(scale >= 2.0 ** -126, scale, torch.ones_like(scale))
    q = (padded * (1.0 / scale)[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).reshape(T, S * block)[:, :H]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp32 `[T, H]`: `fp32(q) * scale` per block (one fp32 rounding), as the reduce dequantises."""
    H = q.shape[1]
    return q.float() * scale.repeat_interleave(block, dim=1)[:, :H]


def fp8_roundtrip(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """What an fp8 combine row carries, as the reduce sees it: fp32 `[T, H]`."""
    return dequantize_fp8_blocks(*quantize_fp8_blocks(x, block), block)


# ---- dispatch: one row per (token, destination rank) -------------------------------------------------
def token_ranks(cfg: A2AConfig, indices: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per source rank s, `[T_s, W]` bool: token t has at least one live route to rank r (the ranks it
    is sent to once each; DeepEP's `is_token_in_rank`)."""
    W = len(indices)
    L = cfg.layout(W).num_local_experts
    out = []
    for idx in indices:
        idx = idx.to(torch.int64).cpu()
        hit = torch.zeros(idx.shape[0], W, dtype=torch.bool)
        for k in range(idx.shape[1]):
            live = torch.nonzero(idx[:, k] >= 0).squeeze(1)
            hit[live, idx[live, k] // L] = True
        out.append(hit)
    return out


class RankRows(NamedTuple):
    """The rows one source rank sends one destination rank: one per token routed there, in token order."""
    tokens: torch.Tensor            # int64 [n]: the token's index on its source rank
    x: torch.Tensor                 # [n, H] in_dtype
    x_scale: torch.Tensor | None    # [n, num_scales] float32, or None without scales
    indices: torch.Tensor           # int64 [n, K]: the token's K expert ids (global, -1 kept)
    weights: torch.Tensor | None    # float32 [n, K]: the token's K weights, when they travel


def dispatch_rows_per_rank(cfg: A2AConfig, xs: Tensors, x_scales: Sequence[torch.Tensor | None] | None,
                           indices: Tensors, weights: Tensors | None = None) -> list[list[RankRows]]:
    """What crosses in a dispatch of one row per (token, rank): `out[r][s]` = the rows source s sends
    destination r (a token once, however many of its experts r hosts). Arguments as `dispatch`, and
    optionally per source rank `[T_s, K]` float32 weights that travel with the rows."""
    W = len(xs)
    if x_scales is None:
        x_scales = [None] * W
    if len(x_scales) != W or len(indices) != W or (weights is not None and len(weights) != W):
        raise ValueError("xs, x_scales, indices (and weights) must have one entry per source rank")
    for s in range(W):
        _check_rank_inputs(cfg, W, s, xs[s], x_scales[s], indices[s])
    hits = token_ranks(cfg, indices)
    out: list[list[RankRows]] = [[] for _ in range(W)]
    for r in range(W):
        for s in range(W):
            t = torch.nonzero(hits[s][:, r]).squeeze(1)                      # token order
            dev = xs[s].device
            td = t.to(dev)
            out[r].append(RankRows(
                tokens=t, x=xs[s][td],
                x_scale=None if x_scales[s] is None else x_scales[s][td],
                indices=indices[s].to(torch.int64).cpu()[t],
                weights=None if weights is None else weights[s].float().cpu()[t]))
    return out


def expand_rank_rows(cfg: A2AConfig, received: Sequence[Sequence[RankRows]]) -> list[Received]:
    """The receiver's unpack: `received[r][s]` (as `dispatch_rows_per_rank` gives them) expanded on rank r
    into the expert-major layout of `dispatch`: row i of source s goes to the slot of local expert l once
    for every k with `indices[i, k] == r*L + l` (k order; duplicates fill two slots). Within an expert,
    rows are ordered by (source, token, k), as `dispatch` orders them. Same return value as `dispatch`."""
    W = len(received)
    L = cfg.layout(W).num_local_experts
    out = []
    for r in range(W):
        # every (local expert, source, row of that source): iterating sources, rows, then k gives
        # (source, token, k) order within each expert
        slots: list[list[tuple[int, int]]] = [[] for _ in range(L)]
        for s, rows in enumerate(received[r]):
            for i in range(rows.indices.shape[0]):
                for e in rows.indices[i].tolist():
                    if e >= 0 and r * L <= e < (r + 1) * L:
                        slots[e - r * L].append((s, i))
        counts = torch.tensor([len(sl) for sl in slots], dtype=torch.int32)
        padded = segment_rows(cfg, r, counts)
        device = received[r][0].x.device if received[r] else "cpu"
        R = sum(padded)
        ex = torch.zeros(R, cfg.hidden_dim, dtype=cfg.in_dtype, device=device)
        exs = torch.zeros(R, cfg.num_scales, dtype=torch.float32, device=device) if cfg.has_scales else None
        seg_start = 0
        for l in range(L):
            for row, (s, i) in enumerate(slots[l]):
                ex[seg_start + row] = received[r][s].x[i]
                if exs is not None:
                    exs[seg_start + row] = received[r][s].x_scale[i]
            seg_start += padded[l]
        out.append((counts.to(device), ex, exs))
    return out


def dispatch_per_rank(cfg: A2AConfig, xs: Tensors, x_scales: Sequence[torch.Tensor | None] | None,
                      indices: Tensors) -> list[Received]:
    """Dispatch sending one row per (token, rank), then expanding: equal to `dispatch` (bitwise)."""
    return expand_rank_rows(cfg, dispatch_rows_per_rank(cfg, xs, x_scales, indices))


# ---- combine: reduced at the sender; fp8 rows ------------------------------------------------------
def combine_partials_at_sender(cfg: A2AConfig, indices: Tensors, weights: Tensors, expert_ys: Tensors,
                               fp8: bool = False) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The rows of a combine reduced at the sender: `out[r][s] = (tokens int64 [n], rows fp32 [n, H])`,
    what expert rank r sends home rank s, one row per token of s with routes to r (token order), as the
    reduce will read it: `partial = sum_k w[t,k] * y[row(t,k)]` over the live k whose expert is on r, in
    fp32 in k order, then rounded to out_dtype (`fp8=False`) or quantised to fp8 blocks from the fp32
    partial and dequantised (`fp8=True`). `weights` are the home ranks' (the dispatch carried them)."""
    W = len(indices)
    L = cfg.layout(W).num_local_experts
    rows = expert_rows(cfg, indices)
    hits = token_ranks(cfg, indices)
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(W)]
    for r in range(W):
        y = expert_ys[r].float().cpu()
        for s in range(W):
            idx = indices[s].to(torch.int64).cpu()
            w = weights[s].float().cpu()
            t = torch.nonzero(hits[s][:, r]).squeeze(1)
            acc = torch.zeros(len(t), cfg.hidden_dim, dtype=torch.float32)
            for k in range(idx.shape[1]):
                e = idx[t, k]
                mine = torch.nonzero((e >= 0) & (e // L == r)).squeeze(1)   # e >= 0 first: -1 // L == -1
                acc[mine] += w[t[mine], k, None] * y[rows[s][t[mine], k]]
            wire = fp8_roundtrip(acc) if fp8 else acc.to(cfg.out_dtype).float()
            out[r].append((t, wire))
    return out


def combine_reduced_at_sender(cfg: A2AConfig, indices: Tensors, weights: Tensors, expert_ys: Tensors,
                              out_tokens: Tensors | None = None, fp8: bool = False) -> list[torch.Tensor]:
    """Combine reduced at the sender: `out[t] = sum_r partial_r[t]` over the ranks r the token was sent
    to, in ascending r, accumulated in fp32 (the old value first when `out_tokens` is given) and cast
    once to out_dtype; `partial_r` as `combine_partials_at_sender` (`fp8`: its rows in fp8). Arguments
    and result as `combine`. A token with no live route gets zero (or its old value); a token whose live
    experts are all on one rank gets `combine`'s bits. Otherwise (bf16 rows, u = 2**-8, S the exact sum,
    A = sum_k |w y|): |this - combine| <= 2u|S| + (u + ~4K 2**-24) A (tests/test_reference_bytes.py
    derives it; docs/accuracy.md measures it)."""
    W = len(indices)
    parts = combine_partials_at_sender(cfg, indices, weights, expert_ys, fp8)
    return _sum_at_homes(cfg, indices, weights, out_tokens, lambda s: (parts[r][s] for r in range(W)))  # rank order


def _sum_at_homes(cfg: A2AConfig, indices: Tensors, weights: Tensors, out_tokens: Tensors | None,
                  rows_for) -> list[torch.Tensor]:
    """Each home s's tokens: the fp32 sum (after the old value, when `out_tokens` is given) of the `(t, rows)`
    pairs `rows_for(s)` yields, in the order it yields them, cast once to out_dtype."""
    out = []
    for s in range(len(indices)):
        acc = torch.zeros(indices[s].shape[0], cfg.hidden_dim, dtype=torch.float32)
        if out_tokens is not None:
            acc += out_tokens[s].float().cpu()
        for t, rows in rows_for(s):
            acc[t] += rows
        out.append(acc.to(cfg.out_dtype).to(weights[s].device))
    return out


def combine_fp8(cfg: A2AConfig, indices: Tensors, weights: Tensors, expert_ys: Tensors,
                out_tokens: Tensors | None = None) -> list[torch.Tensor]:
    """Today's receiver-side combine with fp8 rows: every expert output row (out_dtype) quantised to fp8
    blocks, dequantised in the reduce, then exactly `combine` (fp32, k order, one cast)."""
    return combine(cfg, indices, weights, [fp8_roundtrip(y.cpu()) for y in expert_ys], out_tokens)


# ---- bytes per phase ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wire:
    """How one call's rows travel (issue 32's three levers).

    dispatch_rows: "route" = one row per live (token, k); "rank" = one row per (token, destination rank),
        carrying per k an int32 local expert (or -1) and an int32 position among the sender's routes to it
        (and the K fp32 weights when `combine_rows` is "rank"): `A2AConfig.rank_meta_bytes`.
    combine_rows: "route" = one expert-output row per route, summed at the home rank (today); "rank" =
        reduced at the sender, one row per (token, rank) (needs dispatch_rows="rank": the weights travel
        with it).
    combine_fp8: combine rows as fp8 e4m3 with fp32 scales per FP8_BLOCK elements (else out_dtype).
    """
    dispatch_rows: str = "route"
    combine_rows: str = "route"
    combine_fp8: bool = False

    def __post_init__(self):
        if self.dispatch_rows not in ("route", "rank") or self.combine_rows not in ("route", "rank"):
            raise ValueError(f"dispatch_rows / combine_rows must be 'route' or 'rank', got {self}")
        if self.combine_rows == "rank" and self.dispatch_rows != "rank":
            raise ValueError("combine_rows='rank' needs dispatch_rows='rank' (the weights travel with it)")


# The variants of issue 32's levers, by name: `config.WIRES` without the relay (its rows are these; its
# bytes are `relay_bytes_per_phase`'s).
WIRE_VARIANTS = {name: Wire(dispatch_rows, combine_rows, combine_fp8)
                 for name, (dispatch_rows, combine_rows, combine_fp8, relay) in WIRES.items() if not relay}


def row_bytes(cfg: A2AConfig, wire: Wire) -> dict[str, int]:
    """Bytes of one row on the wire, per phase, each part padded to ROW_ALIGN_BYTES (16):
    dispatch: payload and scales (`cfg.dispatch_stride_bytes` of a route-row config), with per-rank rows plus
    the metadata `round_up(8K [+ 4K weights], 16)`; combine: `cfg.combine_stride_bytes` of a bf16-combine
    config, or in fp8 `round_up(H, 16) + round_up(4 * ceil(H / 128), 16)`. `cfg`'s own wire fields are not
    read: `wire` says how rows travel (for a config whose fields match, these equal its strides)."""
    K, H = cfg.experts_per_token, cfg.hidden_dim
    dispatch = cfg.rank_meta_offset_bytes  # payload and scales, each padded to 16
    if wire.dispatch_rows == "rank":
        dispatch += round_up(8 * K + (4 * K if wire.combine_rows == "rank" else 0), ROW_ALIGN_BYTES)
    if wire.combine_fp8:
        combine = round_up(H, ROW_ALIGN_BYTES) + round_up(4 * ceil_div(H, FP8_BLOCK), ROW_ALIGN_BYTES)
    else:
        combine = round_up(H * cfg.out_itemsize, ROW_ALIGN_BYTES)
    return {"dispatch": dispatch, "combine": combine}


def rows_per_pair(cfg: A2AConfig, indices: Sequence[torch.Tensor], per: str) -> torch.Tensor:
    """`[W, W]` int64, `[s, r]` = rows between home rank s and expert rank r: `per="route"` counts live
    routes (t, k) of s to an expert on r (duplicates twice); `per="rank"` counts tokens of s with at least
    one. Dispatch rows go s -> r, combine rows r -> s, the same counts."""
    W = len(indices)
    if per == "rank":
        return torch.stack([hit.sum(0) for hit in token_ranks(cfg, indices)]) if W else torch.zeros(0, 0)
    L = cfg.layout(W).num_local_experts
    n = torch.zeros(W, W, dtype=torch.int64)
    for s, idx in enumerate(indices):
        idx = idx.to(torch.int64).cpu()
        n[s] = torch.bincount(idx[idx >= 0] // L, minlength=W)
    return n


def bytes_per_phase(cfg: A2AConfig, indices: Sequence[torch.Tensor], node_size: int,
                    wire: Wire = Wire()) -> list[dict]:
    """Per rank q, the bytes it SENDS in each phase, by where they go: `{"dispatch": {"self", "node",
    "remote"}, "combine": {...}}`. "self": rows a rank keeps (no link), "node": to the other ranks of its
    node (ranks `[n*node_size, (n+1)*node_size)`), "remote": to other nodes. Dispatch rows go from the home
    rank to the expert rank, combine rows back; counts from `rows_per_pair`, sizes from `row_bytes`.
    Rows only: the count rows and flags are not included."""
    W = len(indices)
    if node_size < 1 or W % node_size:
        raise ValueError(f"node_size must divide the world size ({W}), got {node_size}")
    size = row_bytes(cfg, wire)
    dispatch = rows_per_pair(cfg, indices, wire.dispatch_rows)          # [home, expert rank]
    combine = rows_per_pair(cfg, indices, wire.combine_rows).T          # [expert rank, home]

    def where(a: int, b: int) -> str:
        return "self" if a == b else "node" if a // node_size == b // node_size else "remote"

    out = []
    for q in range(W):
        row = {ph: {"self": 0, "node": 0, "remote": 0} for ph in ("dispatch", "combine")}
        for other in range(W):
            row["dispatch"][where(q, other)] += int(dispatch[q, other]) * size["dispatch"]
            row["combine"][where(q, other)] += int(combine[q, other]) * size["combine"]
        out.append(row)
    return out


# =====================================================================================================
# The relay (issue 46): each token crosses the network once per destination node.
#
# Nodes are `node_size` consecutive ranks (node(r) = r // node_size). Source s's relay on node n is the rank
# with s's local index there, `relay_rank(s, n, node_size) = n * node_size + s % node_size`, so every network
# write stays on one rail (GPU j of one node to GPU j of another). None of this changes a function above.
#
# - Dispatch (`dispatch_relay`). Hop 1, network: source s sends each token ONCE to its relay on every other
#   node that one of the token's live routes hits: a per-rank row (`RankRows`) whose K ids keep the routes on
#   that node and are -1 elsewhere (the wire carries per k a node-local expert or -1, and the route's position
#   among s's routes to that expert: the per-rank row's metadata). To the ranks of its own node, itself
#   included, s sends today's per-rank rows directly. Hop 2, NVLink inside node n: the relay forwards each
#   hop-1 row, unchanged and in token order, to every rank of n that one of its routes hits, itself included.
#   Rank r then holds, per source, exactly `dispatch_rows_per_rank`'s rows (ids off r's node -1 for remote
#   sources) and expands them with `expand_rank_rows`: the output is `dispatch`'s, bitwise. Transport only.
# - Combine (`combine_relay`), for home rank s and each token t of s:
#   1. every expert rank r the token hits forms its partial P_r = sum_k w[t, k] * y[row(t, k)] over the live
#      k whose expert is on r, in fp32, in k order, from +0 (`combine_partials_at_sender`'s sum, not rounded);
#   2. r on s's node: P_r is rounded once (out_dtype, or fp8 blocks from fp32) and goes to s directly, as
#      today's combine reduced at the sender does;
#   3. r on another node m: P_r goes in fp32 over NVLink to the relay of s on m, `relay_rank(s, m)` (r itself
#      when r is that relay); the relay sums the partials of its node in ascending rank order, in fp32 from
#      +0, rounds once (out_dtype, or fp8 blocks quantised from the fp32 sum) and sends ONE row per (token,
#      node) to s over the network;
#   4. s sums in fp32, the old value first with `out_tokens`, over the nodes in ascending order: its own node's
#      rows one by one in ascending rank order, each other node's relay row; then casts once to out_dtype.
#   So with one node, or one rank a node, it is `combine_reduced_at_sender` bitwise; a token whose live
#   experts are all on one rank gets `combine`'s bits (bf16 rows); otherwise only the order of fp32 adds and
#   the roundings of rows differ from `combine`: the bound of `combine_reduced_at_sender` holds
#   (tests/test_reference_relay.py derives it). fp8 (`fp8=True`) applies to every row that reaches a home,
#   node-local or relayed (as `combine_reduced_at_sender(fp8=True)`); partials to the relay stay fp32.
# - Bytes (`relay_bytes_per_phase`): per rank and phase, bytes kept, to its node, over the network, the
#   NVLink bytes of the relay's fan-out and of the fp32 partials, and the network writes a proxy posts.
# =====================================================================================================
def relay_rank(source: int, node: int, node_size: int) -> int:
    """The relay of `source` on `node`: the GPU of that node with the source's local index (rail-aligned)."""
    return node * node_size + source % node_size


def _check_node_size(world_size: int, node_size: int) -> None:
    if node_size < 1 or world_size % node_size:
        raise ValueError(f"node_size must divide the world size ({world_size}), got {node_size}")


def token_nodes(cfg: A2AConfig, indices: Sequence[torch.Tensor], node_size: int) -> list[torch.Tensor]:
    """Per source rank s, `[T_s, W / node_size]` bool: token t has at least one live route to a rank of node n."""
    W = len(indices)
    _check_node_size(W, node_size)
    return [hit.reshape(hit.shape[0], W // node_size, node_size).any(2) for hit in token_ranks(cfg, indices)]


def _only_on(cfg: A2AConfig, idx: torch.Tensor, first_rank: int, num_ranks: int, W: int) -> torch.Tensor:
    """`idx` (int64 [n, K]) with every route not on ranks `[first_rank, first_rank + num_ranks)` set to -1."""
    L = cfg.layout(W).num_local_experts
    on = (idx >= first_rank * L) & (idx < (first_rank + num_ranks) * L)   # -1 is on no rank
    return torch.where(on, idx, torch.full_like(idx, -1))


class RelayDispatch(NamedTuple):
    """What a relay dispatch delivers, and what crossed on the way."""
    out: list[Received]                        # per rank: exactly `dispatch`'s
    network: dict[tuple[int, int], RankRows]   # (source s, relay q): hop 1, for every node other than s's
    received: list[list[RankRows]]             # [r][s]: the per-rank rows r expands (direct, or via s's relay)


def dispatch_relay(cfg: A2AConfig, xs: Tensors, x_scales: Sequence[torch.Tensor | None] | None,
                   indices: Tensors, node_size: int, weights: Tensors | None = None) -> RelayDispatch:
    """Dispatch through the relay (section above). Arguments as `dispatch_rows_per_rank`, and `node_size` ranks
    a node (dividing W).

    Returns `RelayDispatch`: `out` per rank equals `dispatch(cfg, xs, x_scales, indices)` bitwise (a ValueError
    alike for an expert over `expert_capacity`); `network[(s, q)]` for every source s and every node n other
    than s's, q = `relay_rank(s, n)`: the hop-1 rows, one per token of s that hits n, in token order, the K ids
    kept only where they name an expert on n (-1 elsewhere), the token's K weights when `weights` are given
    (possibly empty: then no write); `received[r][s]`: the per-rank rows r reads from source s, sent directly
    (s on r's node: `dispatch_rows_per_rank`'s) or forwarded over NVLink by `relay_rank(s, node(r))` (the
    hop-1 rows whose ids hit r, ids as in hop 1)."""
    W = len(xs)
    _check_node_size(W, node_size)
    direct = dispatch_rows_per_rank(cfg, xs, x_scales, indices, weights)   # checks every input
    if x_scales is None:
        x_scales = [None] * W
    nodes = W // node_size
    hits_node = token_nodes(cfg, indices, node_size)
    L = cfg.layout(W).num_local_experts

    # Hop 1 (network): built from the source's own tensors, one row per (token, remote node).
    network: dict[tuple[int, int], RankRows] = {}
    for s in range(W):
        for n in range(nodes):
            if n == s // node_size:
                continue
            t = torch.nonzero(hits_node[s][:, n]).squeeze(1)                 # token order
            td = t.to(xs[s].device)
            network[(s, relay_rank(s, n, node_size))] = RankRows(
                tokens=t, x=xs[s][td], x_scale=None if x_scales[s] is None else x_scales[s][td],
                indices=_only_on(cfg, indices[s].to(torch.int64).cpu()[t], n * node_size, node_size, W),
                weights=None if weights is None else weights[s].float().cpu()[t])

    # Hop 2 (NVLink): a relay forwards each hop-1 row to every rank of its node the row's routes hit.
    received: list[list[RankRows]] = [[] for _ in range(W)]
    for r in range(W):
        n = r // node_size
        for s in range(W):
            if s // node_size == n:
                received[r].append(direct[r][s])                               # same node: as today
                continue
            hop1 = network[(s, relay_rank(s, n, node_size))]
            i = torch.nonzero(((hop1.indices >= r * L) & (hop1.indices < (r + 1) * L)).any(1)).squeeze(1)  # row's ids
            idev = i.to(hop1.x.device)
            received[r].append(RankRows(
                tokens=hop1.tokens[i], x=hop1.x[idev],
                x_scale=None if hop1.x_scale is None else hop1.x_scale[idev],
                indices=hop1.indices[i], weights=None if hop1.weights is None else hop1.weights[i]))
    return RelayDispatch(expand_rank_rows(cfg, received), network, received)


class RelayCombine(NamedTuple):
    """The rows of a relay combine, keyed (sender, home s); each `(tokens int64 [n], rows fp32 [n, H])`."""
    partials: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]   # (expert rank r, s): fp32 P_r, all pairs
    node_rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]  # (r, s) on one node: as s reads them
    relay_rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]  # (relay q, s) on two: as s reads them


def combine_relay_rows(cfg: A2AConfig, indices: Tensors, weights: Tensors, expert_ys: Tensors, node_size: int,
                       fp8: bool = False) -> RelayCombine:
    """Every row of a relay combine (steps 1-3 above): `partials[(r, s)]`, expert rank r's fp32 partials for
    the tokens of home s with a route on r (token order; the ones r sends its relay, or rounds for a home of
    its node); `node_rows[(r, s)]`, r and s on one node: those rounded once to out_dtype (or fp8 blocks),
    as s reads them (= `combine_partials_at_sender`'s rows); `relay_rows[(q, s)]`, q = `relay_rank(s,
    node(q))` on another node than s: one row per token of s hitting q's node, the sum of that node's
    partials in ascending rank order (fp32 from +0), rounded once, as s reads it. `weights` are the home
    ranks' (the dispatch's rows carried them to every expert rank: the same bits)."""
    W = len(indices)
    _check_node_size(W, node_size)
    L = cfg.layout(W).num_local_experts
    H = cfg.hidden_dim
    rows = expert_rows(cfg, indices)
    hits = token_ranks(cfg, indices)
    base = torch.tensor([0] + [y.shape[0] for y in expert_ys], dtype=torch.int64).cumsum(0)
    all_y = torch.cat([y.float().cpu() for y in expert_ys])      # every expert rank's rows, stacked

    def wire(acc: torch.Tensor) -> torch.Tensor:                  # a row as the home reads it: one rounding
        return fp8_roundtrip(acc) if fp8 else acc.to(cfg.out_dtype).float()

    partials, node_rows, relay_rows = {}, {}, {}
    for s in range(W):
        idx = indices[s].to(torch.int64).cpu()
        w = weights[s].float().cpu()
        T = idx.shape[0]
        acc = torch.zeros(T, W, H, dtype=torch.float32)           # [token, expert rank]: P_r, k order
        for k in range(idx.shape[1]):
            live = torch.nonzero(idx[:, k] >= 0).squeeze(1)
            r = idx[live, k] // L
            acc[live, r] += w[live, k, None] * all_y[base[r] + rows[s][live, k]]   # (token, k): one rank
        for r in range(W):
            t = torch.nonzero(hits[s][:, r]).squeeze(1)
            partials[(r, s)] = (t, acc[t, r])
            if r // node_size == s // node_size:
                node_rows[(r, s)] = (t, wire(acc[t, r]))
        for m in range(W // node_size):
            if m == s // node_size:
                continue
            first = m * node_size
            t = torch.nonzero(hits[s][:, first:first + node_size].any(1)).squeeze(1)
            total = torch.zeros(len(t), H, dtype=torch.float32)
            for r in range(first, first + node_size):             # ascending local rank
                sel = torch.nonzero(hits[s][t, r]).squeeze(1)
                total[sel] += acc[t[sel], r]
            relay_rows[(relay_rank(s, m, node_size), s)] = (t, wire(total))
    return RelayCombine(partials, node_rows, relay_rows)


def combine_relay(cfg: A2AConfig, indices: Tensors, weights: Tensors, expert_ys: Tensors, node_size: int,
                  out_tokens: Tensors | None = None, fp8: bool = False) -> list[torch.Tensor]:
    """Combine through the relay (step 4 above): per home rank s, `[T_s, H]` out_dtype, the fp32 sum over
    nodes in ascending order of the node's row (its own node: its ranks' rows in ascending rank order), after
    the old value when `out_tokens` is given, cast once. Arguments and result as `combine`, with `node_size`
    ranks a node; `fp8`: every row reaching a home in fp8 blocks. Rows from `combine_relay_rows`."""
    W = len(indices)
    parts = combine_relay_rows(cfg, indices, weights, expert_ys, node_size, fp8)

    def rows_for(s):
        for m in range(W // node_size):                                # ascending node order
            if m == s // node_size:
                for r in range(m * node_size, (m + 1) * node_size):    # its own node: rank by rank
                    yield parts.node_rows[(r, s)]
            else:
                yield parts.relay_rows[(relay_rank(s, m, node_size), s)]

    return _sum_at_homes(cfg, indices, weights, out_tokens, rows_for)


# ---- bytes per phase, with the relay ----------------------------------------------------------------
RELAY_WIRE = Wire("rank", "rank")  # the relay's rows are the per-rank rows (ids and weights travel)


def relay_row_bytes(cfg: A2AConfig, fp8: bool = False) -> dict[str, int]:
    """Bytes of one relay row: "dispatch" (hop 1 and the fan-out: the per-rank row with its K weights,
    `row_bytes(cfg, RELAY_WIRE)`), "combine" (a row to a home: out_dtype, or fp8 blocks with `fp8`), and
    "partial" (an fp32 partial to the relay: `round_up(4 H, 16)`)."""
    size = row_bytes(cfg, Wire("rank", "rank", fp8))
    return {**size, "partial": round_up(4 * cfg.hidden_dim, ROW_ALIGN_BYTES)}


def relay_bytes_per_phase(cfg: A2AConfig, indices: Sequence[torch.Tensor], node_size: int,
                          fp8: bool = False) -> list[dict]:
    """Per rank q, what it SENDS per phase with the relay, rows only (count rows and flags excluded):

    - `"dispatch"`: "self" (its rows to itself), "node" (per-rank rows to the other ranks of its node), "remote"
      (hop-1 rows to its relays on other nodes: the network bytes), "fanout" (as a relay, the hop-1 rows it
      forwards to the OTHER ranks of its node over NVLink; those it keeps move no bytes);
    - `"combine"`: "self", "node" (rounded partials to homes of its node, as the sender-reduced combine),
      "partials" (fp32 partials to the relays of its node other than itself, NVLink), "remote" (as a relay,
      one row per (token, node) to homes on other nodes: the network bytes);
    - `"writes"`: per phase, the network writes its proxy posts: the remote nodes it sends rows to (dispatch:
      nodes its tokens hit; combine: homes of its rail that it relays rows to, one a node).

    "self" and "node" equal `bytes_per_phase(cfg, indices, node_size, RELAY_WIRE)`'s (or its fp8 wire's);
    sizes from `relay_row_bytes`."""
    W = len(indices)
    _check_node_size(W, node_size)
    size = relay_row_bytes(cfg, fp8)
    hits = token_ranks(cfg, indices)                                      # [s]: [T_s, W]
    nhits = token_nodes(cfg, indices, node_size)                          # [s]: [T_s, nodes]
    pair = torch.stack([h.sum(0) for h in hits])                          # [s, r] per-rank rows
    npair = torch.stack([h.sum(0) for h in nhits])                        # [s, n] per-node rows
    node_of = torch.arange(W) // node_size
    out = []
    for q in range(W):
        n, j = q // node_size, q % node_size
        mine = node_of == n
        others = (~mine) & (torch.arange(W) % node_size == j)             # sources / homes q relays for
        remote_nodes = torch.arange(W // node_size) != n
        relayed = pair[others][:, mine]                                   # [source of q's rail, rank of q's node]
        d = {"self": int(pair[q, q]) * size["dispatch"],
             "node": int(pair[q, mine].sum() - pair[q, q]) * size["dispatch"],
             "remote": int(npair[q, remote_nodes].sum()) * size["dispatch"],
             "fanout": int(relayed.sum() - relayed[:, j].sum()) * size["dispatch"]}
        c = {"self": int(pair[q, q]) * size["combine"],
             "node": int(pair[mine, q].sum() - pair[q, q]) * size["combine"],
             "partials": int(pair[(~mine) & (torch.arange(W) % node_size != j), q].sum()) * size["partial"],
             "remote": int(npair[others, n].sum()) * size["combine"]}
        writes = {"dispatch": int((npair[q, remote_nodes] > 0).sum()), "combine": int((npair[others, n] > 0).sum())}
        out.append({"dispatch": d, "combine": c, "writes": writes})
    return out


def bytes_per_node(per_rank: Sequence[dict], node_size: int) -> list[dict]:
    """`bytes_per_phase` or `relay_bytes_per_phase` rows summed over the ranks of each node (same keys)."""
    _check_node_size(len(per_rank), node_size)
    out = []
    for n in range(len(per_rank) // node_size):
        ranks = per_rank[n * node_size:(n + 1) * node_size]
        out.append({ph: {key: sum(r[ph][key] for r in ranks) for key in ranks[0][ph]} for ph in ranks[0]})
    return out
