"""Accuracy of the combine variants of issue 32 against an exact (fp64) sum, on the CPU, with torch.

Every variant is the executable specification in `moe_a2a/reference.py`:

- ``receiver_bf16``: today's combine (`reference.combine`): fp32 products and sums in k order at the home
  rank, one cast to bf16;
- ``sender_bf16``: reduced at the sender (`combine_reduced_at_sender`): each expert rank's fp32 partial,
  rounded to bf16 for the wire, summed at home in fp32 in rank order, one cast;
- ``receiver_fp8``: today's sum over per-route rows sent as fp8 e4m3 with fp32 scales per 128 elements
  (`combine_fp8`);
- ``sender_fp8``: reduced at the sender, the fp32 partials sent as fp8 blocks (`fp8=True`);
- ``receiver_fp32``: today's arithmetic with an fp32 output (no cast): the floor the others add to.

Inputs (the expert outputs y, bf16 as a grouped GEMM writes them, and the K weights a token):
- ``random``: y ~ N(0, 1), weights softmax(N(0, 1)) over the K slots times 2.5 (DeepSeek-V3's scale);
- ``dynamic_range``: y ~ N(0, 1) * 2**U(-10, 10) per element (within a 128-element block too);
- ``cancellation``: the K outputs of a token alternate in sign around a shared row (y_k = (-1)^k b +
  2**-6 noise), equal weights: the sum is small against its terms;
- ``outliers``: N(0, 1) with 4 fixed channels at 300x and 0.1% random elements at 100x (the outlier
  channels of LLM activations; they set the block scales).

Errors, per output element, against S = sum_k w_k y_k in fp64 (A = sum_k |w_k y_k|):
- ``rel_l2`` = ||out - S|| / ||S|| over all elements;
- ``max_ulpA`` / ``mean_ulpA`` = |out - S| / (2**-8 A): in bf16 units of roundoff (half-ulps) of A;
  a bf16 output's own rounding alone can reach 1 (|S| <= A);
- ``max_rel`` = max |out - S| / |S| over the well-conditioned elements, |S| >= A / 2 (little cancellation);
- ``frac_differs_from_today`` = share of elements whose value differs from ``receiver_bf16`` (bf16 outputs).

Run (writes docs/results/accuracy-<date>/combine_accuracy.json and .png):

    python -m benchmarks.combine_accuracy                 # the full grid (a few minutes on 2 cores)
    python -m benchmarks.combine_accuracy --quick         # a small grid, for a smoke test
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from moe_a2a import reference as R
from moe_a2a.config import A2AConfig

VARIANTS = ("receiver_bf16", "sender_bf16", "receiver_fp8", "sender_fp8", "receiver_fp32")
INPUTS = ("random", "dynamic_range", "cancellation", "outliers")
U_BF16 = 2.0 ** -8
NUM_EXPERTS = 256


def routing(g: torch.Generator, world: int, tokens: int, k: int) -> list[torch.Tensor]:
    """Per rank `[T, K]` int64: K distinct experts of 256, uniformly (a top-k of random scores)."""
    return [torch.rand(tokens, NUM_EXPERTS, generator=g).argsort(1)[:, :k] for _ in range(world)]


def expert_outputs(g: torch.Generator, kind: str, cfg: A2AConfig, indices, rows_per_rank) -> list[torch.Tensor]:
    """Per expert rank, its rows of y (bf16), built per route so that `cancellation` can pair a token's
    outputs: row(t, k) of source s gets the value the kind gives route (s, t, k)."""
    H = cfg.hidden_dim
    W = len(indices)
    L = cfg.layout(W).num_local_experts
    ys = [torch.zeros(n, H) for n in rows_per_rank]
    rows = R.expert_rows(cfg, indices)
    outlier_channels = torch.randperm(H, generator=g)[:4]
    for s, idx in enumerate(indices):
        T, K = idx.shape
        if kind == "random":
            y = torch.randn(T, K, H, generator=g)
        elif kind == "dynamic_range":
            y = torch.randn(T, K, H, generator=g) * torch.exp2(torch.empty(T, K, H).uniform_(-10, 10, generator=g))
        elif kind == "cancellation":
            base = torch.randn(T, 1, H, generator=g)
            sign = torch.tensor([(-1.0) ** k for k in range(K)]).view(1, K, 1)
            y = sign * base + 2.0 ** -6 * torch.randn(T, K, H, generator=g)
        elif kind == "outliers":
            y = torch.randn(T, K, H, generator=g)
            y[..., outlier_channels] *= 300.0
            y[torch.rand(T, K, H, generator=g) < 1e-3] *= 100.0
        else:
            raise ValueError(kind)
        for k in range(K):
            e = idx[:, k]
            for r in range(W):
                mine = torch.nonzero(e // L == r).squeeze(1)
                ys[r][rows[s][mine, k]] = y[mine, k]
    return [y.bfloat16() for y in ys]


def weights_for(g: torch.Generator, kind: str, indices) -> list[torch.Tensor]:
    out = []
    for idx in indices:
        T, K = idx.shape
        if kind == "cancellation":
            out.append(torch.full((T, K), 1.0 / K))
        else:
            out.append(torch.softmax(torch.randn(T, K, generator=g), 1) * 2.5)
    return out


def exact(cfg: A2AConfig, indices, weights, ys) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per home rank, fp64 S = sum_k w y and A = sum_k |w y|."""
    W = len(indices)
    L = cfg.layout(W).num_local_experts
    rows = R.expert_rows(cfg, indices)
    all_y = [y.double() for y in ys]
    S, A = [], []
    for s, idx in enumerate(indices):
        acc = torch.zeros(idx.shape[0], cfg.hidden_dim, dtype=torch.float64)
        mag = torch.zeros_like(acc)
        for k in range(idx.shape[1]):
            term = torch.zeros_like(acc)
            for r in range(W):
                mine = torch.nonzero(idx[:, k] // L == r).squeeze(1)
                term[mine] = weights[s][mine, k, None].double() * all_y[r][rows[s][mine, k]]
            acc += term
            mag += term.abs()
        S.append(acc)
        A.append(mag)
    return S, A


def run_variant(name: str, cfg: A2AConfig, cfg32: A2AConfig, indices, weights, ys) -> list[torch.Tensor]:
    if name == "receiver_bf16":
        return R.combine(cfg, indices, weights, ys)
    if name == "sender_bf16":
        return R.combine_reduced_at_sender(cfg, indices, weights, ys)
    if name == "receiver_fp8":
        return R.combine_fp8(cfg, indices, weights, ys)
    if name == "sender_fp8":
        return R.combine_reduced_at_sender(cfg, indices, weights, ys, fp8=True)
    if name == "receiver_fp32":
        return R.combine(cfg32, indices, weights, ys)
    raise ValueError(name)


def errors(out: torch.Tensor, S: torch.Tensor, A: torch.Tensor, today: torch.Tensor) -> dict:
    err = (out.double() - S).abs()
    ulp = err / (U_BF16 * A.clamp_min(1e-300))
    big = S.abs() >= 0.5 * A
    return {"rel_l2": float(err.norm() / S.norm()),
            "max_ulpA": float(ulp.max()), "mean_ulpA": float(ulp.mean()),
            "max_rel": float((err[big] / S.abs()[big]).max()) if bool(big.any()) else None,
            "frac_differs_from_today": (float((out.view(torch.int16) != today.view(torch.int16)).double().mean())
                                        if out.dtype == today.dtype else None)}


def case(kind: str, world: int, tokens: int, k: int, hidden: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    cfg = A2AConfig(max_num_tokens=tokens, num_experts=NUM_EXPERTS, experts_per_token=k, hidden_dim=hidden,
                    in_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    cfg32 = A2AConfig(max_num_tokens=tokens, num_experts=NUM_EXPERTS, experts_per_token=k, hidden_dim=hidden,
                      in_dtype=torch.bfloat16, out_dtype=torch.float32)
    indices = routing(g, world, tokens, k)
    counts = R.rows_per_pair(cfg, indices, "route").sum(0)            # rows each expert rank holds
    ys = expert_outputs(g, kind, cfg, indices, counts.tolist())
    weights = weights_for(g, kind, indices)
    S, A = exact(cfg, indices, weights, ys)
    S, A = torch.cat(S), torch.cat(A)
    outs = {v: torch.cat(run_variant(v, cfg, cfg32, indices, weights, ys)) for v in VARIANTS}
    ranks = sum(int(h.sum()) for h in R.token_ranks(cfg, indices)) / (world * tokens)
    return {"input": kind, "world": world, "tokens_per_rank": tokens, "k": k, "hidden": hidden, "seed": seed,
            "ranks_per_token": ranks,
            "errors": {v: errors(outs[v], S, A, outs["receiver_bf16"]) for v in VARIANTS}}


def grid(quick: bool) -> list[tuple]:
    if quick:
        return [(kind, 8, 8, 8, 256) for kind in INPUTS]
    return [(kind, w, 256 // w, k, h) for kind in INPUTS for w in (2, 8) for k in (4, 8) for h in (256, 2048, 7168)]


def summary_table(cases: list[dict], world: int = 8, k: int = 8, hidden: int = 7168) -> str:
    """The page's table: one line per input and variant at one (W, K, H)."""
    lines = [f"| input (W={world}, K={k}, H={hidden}) | variant | rel. L2 error | max error / (2^-8 A) | "
             "mean error / (2^-8 A) | max rel. error where \\|S\\| >= A/2 | elements differing from today |",
             "|---|---|---|---|---|---|---|"]
    for c in cases:
        if (c["world"], c["k"], c["hidden"]) != (world, k, hidden):
            continue
        for v in VARIANTS:
            e = c["errors"][v]
            mr = "–" if e["max_rel"] is None else f"{e['max_rel']:.2e}"
            diff = "–" if e["frac_differs_from_today"] is None else f"{100 * e['frac_differs_from_today']:.1f}%"
            lines.append(f"| {c['input']} | {v} | {e['rel_l2']:.2e} | {e['max_ulpA']:.2f} | {e['mean_ulpA']:.3f} | "
                         f"{mr} | {diff} |")
    return "\n".join(lines)


def worst_table(cases: list[dict]) -> str:
    """Worst case over the whole grid (every W, K, H), per input and variant."""
    lines = ["| input | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    for kind in INPUTS:
        cells = []
        for v in VARIANTS:
            mine = [c["errors"][v] for c in cases if c["input"] == kind]
            cells.append(f"{max(e['rel_l2'] for e in mine):.2e} / {max(e['max_ulpA'] for e in mine):.2f}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(cases: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    colors = dict(zip(VARIANTS, ("tab:blue", "tab:green", "tab:orange", "tab:red", "tab:gray")))
    for ax, metric, label in ((axes[0], "rel_l2", "relative L2 error vs fp64"),
                              (axes[1], "max_ulpA", "max |error| / (2^-8 sum|w y|)")):
        width = 0.8 / len(VARIANTS)
        for i, v in enumerate(VARIANTS):
            vals = [max(c["errors"][v][metric] for c in cases if c["input"] == kind) for kind in INPUTS]
            ax.bar([x + i * width for x in range(len(INPUTS))], vals, width, color=colors[v], label=v)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(INPUTS))], INPUTS)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.set_title(f"{label}: worst over W, K, H", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle("combine accuracy (moe_a2a/reference.py, CPU): receiver-side vs sender-reduced, bf16 vs fp8 rows",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.combine_accuracy", description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="folder (default docs/results/accuracy-<UTC date>)")
    ap.add_argument("--quick", action="store_true", help="a small grid (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-png", action="store_true")
    args = ap.parse_args(argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out or f"docs/results/accuracy-{now:%Y-%m-%d}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    t0 = time.time()
    cases = [case(*c, seed=args.seed + i) for i, c in enumerate(grid(args.quick))]
    doc = {"kind": "combine accuracy against an fp64 sum (moe_a2a/reference.py, CPU)",
           "date": now.isoformat(timespec="seconds"),
           "command": "python -m benchmarks.combine_accuracy" + (" --quick" if args.quick else ""),
           "host": {"cpu": _cpu(), "python": platform.python_version(), "torch": torch.__version__},
           "variants": VARIANTS, "inputs": INPUTS, "seconds": round(time.time() - t0, 1), "cases": cases}
    (out / "combine_accuracy.json").write_text(json.dumps(doc, indent=1))
    if not args.no_png:
        plot(cases, out / "combine_accuracy.png")
    print(summary_table(cases, *((8, 8, 256) if args.quick else (8, 8, 7168))))
    print()
    print("worst over the grid: rel. L2 / max error in 2^-8 A")
    print(worst_table(cases))
    print(f"\nwrote {out}/combine_accuracy.json ({doc['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
