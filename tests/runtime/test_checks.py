"""`runtime/checks.py`: each check's one-test common case accepts exactly what its detailed checks accept (a
Tensor subclass too), and every refusal keeps its message (no processes)."""
from __future__ import annotations

import pytest
import torch

from moe_a2a.compat._slots import column_major_scales, config
from moe_a2a.runtime import checks
from moe_a2a.triton_kernels.quant import Fp8Quantize

CPU = torch.device("cpu")
T, E, K, H, W = 4, 8, 2, 256, 2
CFG = config(T, E, K, H, W)  # the facade's rows: bf16, one scale column, capacity T * W
LAY = CFG.layout(W)
L, C, R = LAY.num_local_experts, CFG.expert_capacity, LAY.max_dispatch_rows
Q = Fp8Quantize(scale_offset_bytes=H, block=128)  # 2 words of scales a row


def _good() -> dict:
    return {"x": torch.zeros(T, H, dtype=torch.bfloat16), "x_scale": torch.zeros(T, 1),
            "indices": torch.tensor([[0, 1], [2, 3], [4, -1], [7, 6]]),
            "num": torch.zeros(L, dtype=torch.int32), "ex": torch.zeros(R, H, dtype=torch.bfloat16),
            "exs": torch.zeros(L, C, 1).transpose(1, 2).contiguous().transpose(1, 2),
            "ranges": torch.zeros(L, W, dtype=torch.int64), "qs": column_major_scales(L, C, 2, torch.float32, CPU),
            "expert_y": torch.zeros(R, H, dtype=torch.bfloat16), "out": torch.zeros(T, H, dtype=torch.bfloat16),
            "weights": torch.zeros(T, K)}


def _run(t: dict, quantize=Q) -> str | None:
    """Every check of one call's tensors: None, or the first refusal's message."""
    try:
        checks.check_dispatch_inputs(CFG, CPU, t["x"], t["x_scale"], t["indices"], None)
        checks.check_dispatch_outputs(CFG, LAY, CPU, t["num"], t["ex"], t["exs"], t["ranges"], t["qs"], quantize)
        checks.check_combine_send(CFG, LAY, CPU, t["expert_y"])
        checks.check_combine_recv(CFG, CPU, T, t["out"], t["weights"], t["indices"])
    except ValueError as exc:
        return str(exc)
    return None


def test_good_tensors_pass_as_tensors_subclasses_and_other_accepted_layouts():
    assert _run(_good()) is None
    t = _good()
    t.update(exs=torch.zeros(R, 1), qs=torch.zeros(R, 2, dtype=torch.int32))  # 2-D scale outputs
    assert _run(t) is None
    sub = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in _good().items()}  # the detailed path
    assert all(type(v) is not torch.Tensor for v in sub.values())
    assert _run(sub) is None
    t = _good()
    t["x"] = torch.zeros(T, 2 * H, dtype=torch.bfloat16)[:, :H]  # last stride 1, not contiguous: taken
    assert _run(t) is None
    t = _good()
    t["expert_y"] = torch.zeros(L, C, H, dtype=torch.bfloat16)  # [L, C, H] with a capacity: its rows
    assert _run(t) is None
    t["expert_y"] = torch.zeros(L, C, 2 * H, dtype=torch.bfloat16)[:, :, :H]  # rows of stride 2H, one run
    assert _run(t) is None
    checks.check_tensor("s", torch.zeros(()), (), torch.float32, CPU)  # 0-dim: no last dimension
    checks.check_tensor("one", torch.zeros(3, 1).t(), (1, 3), torch.float32, CPU)  # [1, 3], strides (1, 1)
    checks.check_tensor("col", torch.zeros(1, 3).t(), (3, 1), torch.float32, CPU)  # last size 1: any stride


@pytest.mark.parametrize("name, bad, message", [
    ("x", torch.zeros(T, H), "x: expected dtype torch.bfloat16, got torch.float32"),
    ("x", torch.zeros(T, H, dtype=torch.bfloat16, device="meta"), "x: expected device cpu, got meta"),
    ("x", torch.zeros(H, T, dtype=torch.bfloat16).t(), "x: last dimension must be contiguous (stride 1), got "
                                                        "strides (1, 4)"),
    ("x", torch.zeros(T, H // 2, dtype=torch.bfloat16), "x: expected [T, 256], got (4, 128)"),
    ("x", torch.zeros(T + 1, H, dtype=torch.bfloat16), "x: 5 tokens > max_num_tokens (4)"),
    ("x", [[0.0]], "x: expected a torch.Tensor, got list"),
    ("x_scale", None, "x_scale: this config has scales (scale_block=256); got None"),
    ("x_scale", torch.zeros(T, 2), "x_scale: expected shape (4, 1), got (4, 2)"),
    ("indices", torch.zeros(T, K, dtype=torch.int16), "indices: expected dtype torch.int32 or torch.int64, got "
                                                      "torch.int16"),
    ("indices", torch.zeros(T, K + 1, dtype=torch.int64)[:, :K], "indices: must be contiguous"),
    ("indices", torch.zeros(K, T, dtype=torch.int64).t(), "indices: last dimension must be contiguous"),
    ("indices", torch.tensor([[0, 1], [2, 3], [4, 8], [7, 6]]), "indices[2, 1] = 8: expected -1 (not routed) or a value in [0, 8)"),
    ("ranges", torch.zeros(L, W, dtype=torch.int32), "out_source_ranges: expected dtype torch.int64, got "
                                                     "torch.int32"),
    ("ranges", torch.zeros(L, W + 1, dtype=torch.int64)[:, :W], "out_source_ranges: expected a contiguous tensor"),
    ("ranges", torch.zeros(L, W + 1, dtype=torch.int64), "out_source_ranges: expected shape (4, 2), got (4, 3)"),
    ("num", torch.zeros(L, dtype=torch.int64), "out_expert_num_tokens: expected dtype torch.int32"),
    ("ex", torch.zeros(R - 1, H, dtype=torch.bfloat16), f"out_expert_x: expected [>= {R}, 256]"),
    ("exs", torch.zeros(L, C, 2), f"out_expert_x_scale: expected [>= {R}, 1] or [4, 8, 1], got (4, 8, 2)"),
    ("exs", torch.zeros(R - 1, 1), f"out_expert_x_scale: expected [>= {R}, 1] or [4, 8, 1], got ({R - 1}, 1)"),
    ("exs", torch.zeros(L, C, 1, dtype=torch.float16), "out_expert_x_scale: expected dtype torch.float32"),
    ("qs", torch.zeros(L, C, 3), f"out_quantized_scale: expected [{R}, 2] (out_expert_x's rows) or [4, 8, 2], "
                                 f"got (4, 8, 3)"),
    ("qs", torch.zeros(L, C, 2, dtype=torch.float16), "out_quantized_scale: expected dtype torch.float32 or "
                                                      "torch.int32"),
    ("qs", torch.zeros(L, C, 2, device="meta"), "out_quantized_scale: expected device cpu, got meta"),
    ("expert_y", torch.zeros(R, H), "expert_y: expected dtype torch.bfloat16, got torch.float32"),
    ("expert_y", torch.zeros(R - 1, H, dtype=torch.bfloat16), f"expert_y: needs >= {R} rows"),
    ("expert_y", torch.zeros(H, R, dtype=torch.bfloat16).t(), "expert_y: last dimension must be contiguous"),
    ("expert_y", torch.zeros(L, C + 1, H, dtype=torch.bfloat16), f"expert_y: expected [rows, {H}] or [{L}, {C}, {H}]"),
    ("expert_y", torch.zeros(L, C + 1, H, dtype=torch.bfloat16)[:, :C], "expert_y: a [4, 8, 256] tensor needs rows"),
    ("out", torch.zeros(T, H), "out_tokens: expected dtype torch.bfloat16, got torch.float32"),
    ("out", torch.zeros(T + 1, H, dtype=torch.bfloat16), "out_tokens: expected shape (4, 256), got (5, 256)"),
    ("out", torch.zeros(H, T, dtype=torch.bfloat16).t(), "out_tokens: last dimension must be contiguous"),
    ("weights", torch.zeros(T, K + 1), "weights: expected shape (4, 2), got (4, 3)"),
    ("weights", torch.zeros(K, T).t(), "weights: last dimension must be contiguous"),
    ("weights", torch.zeros(T, K, device="meta"), "weights: expected device cpu, got meta"),
])
def test_each_refusal_keeps_its_message(name, bad, message):
    t = _good()
    t[name] = bad
    got = _run(t)
    assert got is not None and got.startswith(message), (message, got)


def test_scale_outputs_follow_the_calls_quantize():
    assert _run(_good(), quantize=None).startswith("out_quantized_scale: expected None (the call has no quantize)")
    t = _good()
    t["qs"] = column_major_scales(L, C, 1, torch.int32, CPU)  # UE8M0: one word of four codes a row
    assert _run(t, quantize=Q).startswith("out_quantized_scale: expected")
    assert _run(t, quantize=Fp8Quantize(scale_offset_bytes=H, block=128, round_scale=True, ue8m0=True)) is None
    assert _run(_good(), quantize=Q) is None  # the first quantize again (its words were remembered per quantize)


def test_a_3d_expert_y_is_taken_only_with_rows_by_expert_of_a_capacity():
    from moe_a2a.config import A2AConfig

    y = torch.zeros(L, C, H, dtype=torch.bfloat16)
    no_capacity = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H,
                            in_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a 3-D one is not taken without A2AConfig.expert_capacity"):
        checks.check_combine_send(no_capacity, no_capacity.layout(W), CPU, y)
    by_rank = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                        out_dtype=torch.bfloat16, expert_capacity=C, dispatch_rows="rank")
    checks.check_combine_send(by_rank, by_rank.layout(W), CPU, y)  # per-rank rows too (their reduce views it 2-D)
    with pytest.raises(ValueError, match="needs rows of stride 1 whose experts follow each other"):
        checks.check_combine_send(by_rank, by_rank.layout(W), CPU,
                                  torch.zeros(L, C + 1, H, dtype=torch.bfloat16)[:, 1:])
