"""Toy SwiGLU experts and their dense reference, shared by the engines' rank scripts (torch only).

Expert e: `y = (silu(x @ w1[e, :N].T) * (x @ w1[e, N:].T)) @ w2[e].T` (vLLM's `w13` layout: gate rows, then
up rows), in fp32 from bf16 inputs. The dense reference is the same function on every (token, top-k slot),
weighted and summed in fp32: what every engine's dispatch -> experts -> combine must give, up to bf16 rounding.
"""
from __future__ import annotations

import torch

E, K, N = 8, 2, 64  # experts, top-k, the experts' intermediate size


def weights(hidden: int, num_experts: int = E):
    """w1 `[E, 2N, H]`, w2 `[E, H, N]` bf16, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(1234)
    w1 = (torch.randn(num_experts, 2 * N, hidden, generator=g) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, N, generator=g) / N ** 0.5).to(torch.bfloat16)
    return w1, w2


def tokens(rank: int, num_tokens: int, hidden: int, num_experts: int = E, call: int = 0):
    """x `[T, H]` bf16, topk_ids `[T, K]` int64 (distinct per token, some -1 = not routed on rank 1's
    last token), topk_weights `[T, K]` fp32; seeded by rank and call."""
    g = torch.Generator().manual_seed(100 * rank + call)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:K] for _ in range(num_tokens)]).long()
    w = torch.rand(num_tokens, K, generator=g) + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    return x, ids, w.float()


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on rows `x [M, H]` -> fp32 `[M, H]`."""
    h = x.float() @ w1.float().t()
    n = h.shape[-1] // 2
    return (torch.nn.functional.silu(h[:, :n]) * h[:, n:]) @ w2.float().t()


def dense(x, ids, w, w1, w2) -> torch.Tensor:
    """fp32 `[T, H]`: sum over k of w[t, k] * expert ids[t, k] (x[t]); -1 slots add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= 0:
                out[t] += float(w[t, k]) * swiglu(x[t:t + 1], w1[e], w2[e])[0]
    return out


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to the largest |want| (bf16 output: ~1e-2 at most)."""
    return float((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-6))
