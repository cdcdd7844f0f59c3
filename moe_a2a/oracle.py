"""The end-to-end oracle: what ranks returned from dispatch and combine, held against `reference.py`.

Every multi-process test, the demo and the soak judge a run with `check_against_reference`, and it is
exact wherever the result is determined:

- per-expert counts: equal;
- received rows and their scales: bitwise equal to `reference.dispatch`, row for row;
- every other row of the output buffers (padding, unused capacity, the tail past the last segment):
  untouched, i.e. still holding the `SENTINEL` byte that `fill_sentinel` wrote before the call;
- the weighted sum: `reference.combine` adds the same fp32 products in the same (k) order and casts
  once, so compiled kernels may differ from it only by FMA contraction (`acc + w * y` fused on the GPU:
  a few fp32 ulps, at most one ulp after the cast to bf16 / fp16). The bound is therefore 0 ulps for
  results computed on the CPU (the Triton interpreter rounds every operation) and 1 ulp on a GPU.
  With `cfg.combine_fp8` the sum is held against `reference.combine_fp8` (every expert output row through
  fp8 blocks and back, then the same sum), with the same bound. With `cfg.combine_rows="rank"` (the sum
  reduced at the experts' rank) it is held against `reference.combine_reduced_at_sender(fp8=cfg.combine_fp8)`,
  with the same bound: exact on the CPU; on a GPU an FMA in a partial sum may move that partial's one
  rounding for the wire, which the one-ulp bound does not cover in general (not yet run on a GPU).
  With `cfg.relay` (the combine reduced inside the experts' node) against `reference.combine_relay`, which
  needs the run's `node_size`.

A rank function records a call with `record_call` after filling its outputs with `fill_sentinel`;
`tests/test_oracle.py` mutates correct results (one dropped route, two swapped rows, a written padding
row, one ulp) and checks that each is reported.
"""
from __future__ import annotations

import torch

from . import reference
from .config import A2AConfig, round_up

SENTINEL = 0xA5
"""The byte `fill_sentinel` writes over the dispatch outputs before a call: rows a call must not write
keep it (it is a finite value in every payload dtype, so a stray read does no harm either)."""


def fill_sentinel(expert_x: torch.Tensor, expert_x_scale: torch.Tensor | None = None) -> None:
    """Fill the dispatch outputs with `SENTINEL` bytes before a call (the scales' used columns only)."""
    expert_x.view(torch.uint8).fill_(SENTINEL)
    if expert_x_scale is not None:
        expert_x_scale.view(torch.uint8).fill_(SENTINEL)


def used_rows(cfg: A2AConfig, num: torch.Tensor) -> int:
    """Rows of `expert_x` that the call's segments span: the padded segments, or `L * C` with a capacity."""
    if cfg.expert_capacity:
        return len(num) * cfg.expert_capacity
    return sum(round_up(int(n), cfg.expert_padding) for n in num.tolist())


def record_call(cfg: A2AConfig, x, x_scale, indices, weights, num, expert_x, expert_x_scale, out, *,
                out_before=None) -> dict:
    """One call on one rank, as the oracle reads it: the inputs, the counts, the rows the segments span
    (copied), whether every row past them kept the sentinel, the combined tokens and, for
    `accumulate=True`, what `out` held before the combine. Tensors stay on their device (LocalCluster
    brings results back on the CPU); `device` says where they were computed."""
    rows = used_rows(cfg, num)
    tail = expert_x[rows:].view(torch.uint8)
    tail_scale = None if expert_x_scale is None else expert_x_scale[rows:].view(torch.uint8)
    tail_untouched = bool((tail == SENTINEL).all()) and (tail_scale is None or bool((tail_scale == SENTINEL).all()))
    return {"x": x, "x_scale": x_scale, "indices": indices, "weights": weights, "num": num.clone(),
            "expert_x": expert_x[:rows].clone(),
            "expert_x_scale": None if expert_x_scale is None else expert_x_scale[:rows].clone(),
            "tail_untouched": tail_untouched, "out": out.clone(),
            "out_before": None if out_before is None else out_before.clone(), "device": out.device.type}


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns as int64 keys that order like the values (-0.0 and +0.0 alike), so
    that the difference of two keys counts the representable values between them (ulps)."""
    bits = {2: torch.int16, 4: torch.int32}[t.element_size()]
    i = t.contiguous().view(bits).to(torch.int64)
    sign_min = -(1 << (8 * t.element_size() - 1))
    return torch.where(i < 0, sign_min - i, i)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in ulps of their dtype between two float tensors of one dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"ulp_distance: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
    return (ordered_bits(a) - ordered_bits(b)).abs()


def default_max_ulps(device_type: str) -> int:
    """0 on the CPU (the interpreter rounds each product and sum as the reference does); 1 on a GPU,
    where the compiler fuses `acc + w * y` into an FMA (fp32 sums a few ulps apart: one bf16/fp16 ulp)."""
    return 0 if device_type == "cpu" else 1


def check_against_reference(cfg: A2AConfig, results: list, max_ulps: int | None = None,
                            node_size: int | None = None) -> list[str]:
    """Compare every call of every rank with `reference`; return the problems found (empty = all good).

    `results[r]["calls"]` are rank r's calls in order, each a `record_call` dict; call i of every rank
    belongs to the same collective call. `max_ulps`: the weighted sum's bound (default by where the
    call ran: `default_max_ulps`). `node_size`: ranks per node of the run, needed with `cfg.relay`."""
    problems = []
    for it in range(len(results[0]["calls"])):
        calls = [res["calls"][it] for res in results]
        inputs = [(c["x"], c["x_scale"], c["indices"], c["weights"], c["out_before"] if "out_before" in c else None)
                  for c in calls]
        problems += check_call(cfg, inputs, dict(enumerate(calls)), max_ulps, where=f"call {it} ", node_size=node_size)
    return problems


def check_call(cfg: A2AConfig, inputs: list, got: dict, max_ulps: int | None = None, where: str = "",
               node_size: int | None = None) -> list[str]:
    """One collective call: `inputs[s] = (x, x_scale, indices, weights, out_before)` of every source rank
    (out_before None unless `accumulate=True`), `got[r]` the `record_call` dict of each rank checked
    (all or some), `node_size` the run's (needed with `cfg.relay`). Returns the problems found."""
    if getattr(cfg, "relay", False) and node_size is None:
        raise ValueError("check_call: cfg.relay=True: the combine depends on the node size; pass node_size")
    missing = [r for r, c in got.items() if "tail_untouched" not in c]
    if missing:
        return [f"{where}ranks {missing}: not recorded with oracle.record_call"]
    cpu = [[None if t is None else t.cpu() for t in i] for i in inputs]
    xs, x_scales, indices, weights, olds = (list(col) for col in zip(*cpu))
    ref = reference.dispatch(cfg, xs, x_scales if cfg.has_scales else None, indices)
    problems, counts_ok = [], True
    for r, call in got.items():
        num, ex, exs = ref[r]
        if not torch.equal(call["num"].cpu(), num):
            problems.append(f"{where}rank {r}: expert counts {call['num'].tolist()} != {num.tolist()}")
            counts_ok = False
        else:
            problems += _dispatch_problems(cfg, f"{where}rank {r}", call, num, ex, exs)
    if not counts_ok:
        return problems  # the rows are laid out by the counts: the combine has nothing to compare against
    ys = [toy_expert(ex, exs, cfg) for _, ex, exs in ref]
    olds = None if olds[0] is None else olds
    if getattr(cfg, "relay", False):  # reduced inside the experts' node, one row per (token, node) home
        outs = reference.combine_relay(cfg, indices, weights, ys, node_size, out_tokens=olds, fp8=cfg.combine_fp8)
    elif cfg.combine_rows == "rank":  # reduced at the experts' rank, with the weights the dispatch carried
        outs = reference.combine_reduced_at_sender(cfg, indices, weights, ys, olds, fp8=cfg.combine_fp8)
    else:
        combine = reference.combine_fp8 if cfg.combine_fp8 else reference.combine
        outs = combine(cfg, indices, weights, ys, olds)
    for r, call in got.items():
        bound = default_max_ulps(call["device"]) if max_ulps is None else max_ulps
        problems += combine_problems(call["out"].cpu(), outs[r], bound, f"{where}rank {r}")
    return problems


def combine_problems(have: torch.Tensor, want: torch.Tensor, max_ulps: int, where: str = "") -> list[str]:
    """Combined tokens `[T, H]` against the reference's, within `max_ulps` (see `default_max_ulps`)."""
    if have.shape != want.shape or have.dtype != want.dtype:
        return [f"{where}: combined tokens {have.dtype} {tuple(have.shape)}, expected {want.dtype} {tuple(want.shape)}"]
    ulps = ulp_distance(have, want)
    if not ulps.numel() or int(ulps.max()) <= max_ulps:
        return []
    t, h = divmod(int(ulps.argmax()), have.shape[1])
    return [f"{where}: combined token {t} differs from the reference by {int(ulps.max())} ulps at column {h} "
            f"({have[t, h].item()} vs {want[t, h].item()}; {int((ulps > max_ulps).sum())} elements over {max_ulps})"]


def _dispatch_problems(cfg: A2AConfig, where: str, got: dict, num, ex, exs) -> list[str]:
    """Received rows bitwise as the reference's, every other row of the outputs still the sentinel."""
    problems = []
    live = live_rows(cfg, num)
    rows = used_rows(cfg, num)
    for name, want in (("expert_x", ex), ("expert_x_scale", exs)):
        if want is None:
            continue
        have = got[name].cpu()
        if have.shape[0] != rows:
            problems.append(f"{where}: {name} has {have.shape[0]} rows recorded, the segments span {rows}")
            continue
        have_bytes, want_bytes = have.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        bad = (have_bytes[live] != want_bytes[live]).any(1).nonzero().flatten()
        if len(bad):
            problems.append(f"{where}: {name} differs from the reference in {len(bad)} received rows "
                            f"(first: row {int(live[bad[0]])})")
        dead = torch.ones(rows, dtype=torch.bool)
        dead[live] = False
        written = (have_bytes[dead] != SENTINEL).any(1).nonzero().flatten()
        if len(written):
            problems.append(f"{where}: {name}: {len(written)} padding rows written "
                            f"(first: row {int(dead.nonzero().flatten()[written[0]])})")
    if not got["tail_untouched"]:
        problems.append(f"{where}: rows past the last segment written")
    return problems


def live_rows(cfg: A2AConfig, num: torch.Tensor) -> torch.Tensor:
    """Indices of the received (non-padding) rows of an expert-major tensor with per-expert counts `num`."""
    rows, start = [], 0
    for n in num.tolist():
        rows.extend(range(start, start + n))
        start += cfg.expert_capacity or round_up(n, cfg.expert_padding)
    return torch.tensor(rows, dtype=torch.int64)


def toy_expert(expert_x: torch.Tensor, expert_x_scale, cfg: A2AConfig) -> torch.Tensor:
    """The expert every checked rank function runs, a stand-in for the grouped GEMM: y = 2 * x
    (dequantised with its scales when present), exact in out_dtype for bf16 inputs."""
    y = expert_x.float()
    if expert_x_scale is not None:
        y = y * expert_x_scale.repeat_interleave(cfg.block_size, dim=1)[:, : cfg.hidden_dim]
    return (2 * y).to(cfg.out_dtype)
