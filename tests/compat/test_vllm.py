"""`moe_a2a.compat.vllm.MoeA2APrepareAndFinalize` against vLLM's interface as written down below (without
vLLM: CI does not install it; `tests/engines/` runs the adapter inside vLLM 0.33 itself), and between real
processes against `reference.py`.

The interface, from vLLM's source (`vllm/model_executor/layers/fused_moe/modular_kernel.py`, read
2026-12-02; the calls are those of `FusedMoEKernelModularImpl`, which `FusedMoEKernel` builds only for a
`FusedMoEPrepareAndFinalizeModular`):

- `prepare(a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
  quant_config, defer_input_quant)` -> `(a1q, a1q_scale, ExpertTokensMetadata | None, topk_ids | None,
  topk_weights | None)`; `prepare_async(...)` (same arguments, `defer_input_quant=` by keyword) ->
  `(hook, receiver)` or a receiver; `_launch_prepare` calls it after `dbo_maybe_run_recv_hook()`.
- `finalize(output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
  weight_and_reduce_impl)` -> None; `finalize_async(...)` -> `(hook, receiver)` or a callable;
  `_launch_finalize` unpacks it and `_complete_finalize` runs the hook (through DBO) and then the receiver.
- `post_init_setup(fused_experts)` once at kernel construction; `supports_async()`; `activation_format`
  (property); `topk_indices_dtype()`, `max_num_tokens_per_rank()`, `num_dispatchers()`, `output_is_reduced()`.
- vLLM's DeepEP low-latency backend (`prepare_finalize/deepep_ll.py`) keeps handles per
  `dbo_current_ubatch_id()`, maps routes through `global_to_physical` for the dispatch and the combine,
  dispatches fp8 only for 128 x 128 blocks, and asserts that finalize's `weight_and_reduce_impl` is a
  `TopKWeightAndReduceDelegate`; `all2all_utils.maybe_make_prepare_finalize` constructs it as
  `(handle, max_tokens_per_rank=, num_dispatchers=, use_fp8_dispatch=, global_to_physical=, ...)`, and
  `maybe_roundup_layer_hidden_size` calls its static `maybe_roundup_layer_hidden_size(hidden_size)`.
"""
from __future__ import annotations

import inspect
import types

import pytest
import torch

from moe_a2a import A2AConfig, LocalCluster, reference
from moe_a2a.oracle import combine_problems, default_max_ulps

from ..conftest import TEST_DEVICE
from .test_deep_ep import E, H, K, T_MAX, _inputs

pytestmark = [pytest.mark.slow]

W = 2
L = E // W
# vLLM's round-robin placement: global expert e lives on rank e % W as its (e // W)-th local expert, so
# its physical slot (experts contiguous per rank) is (e % W) * L + e // W.
G2P = torch.tensor([(e % W) * L + e // W for e in range(E)], dtype=torch.int64)
P2G = torch.argsort(G2P)


def _expert_map(rank: int) -> torch.Tensor:
    return torch.tensor([e // W if e % W == rank else -1 for e in range(E)], dtype=torch.int32)


def _quant(dtype=None, block_shape=None, per_act_token_quant=False, a1_scale=None):
    return types.SimpleNamespace(quant_dtype=dtype, block_shape=block_shape, per_act_token_quant=per_act_token_quant,
                                 a1_scale=a1_scale)


FP8 = torch.float8_e4m3fn
QUANTS = {"bf16": _quant(), "block128": _quant(FP8, [128, 128]), "token": _quant(FP8, per_act_token_quant=True),
          "tensor": _quant(FP8)}

VLLM_SIGNATURES = {
    "prepare": ["a1", "topk_weights", "topk_ids", "num_experts", "expert_map", "apply_router_weight_on_input",
                "quant_config", "defer_input_quant"],
    "finalize": ["output", "fused_expert_output", "topk_weights", "topk_ids", "apply_router_weight_on_input",
                 "weight_and_reduce_impl"],
    "post_init_setup": ["fused_experts"],
}
VLLM_SIGNATURES["prepare_async"] = VLLM_SIGNATURES["prepare"]
VLLM_SIGNATURES["finalize_async"] = VLLM_SIGNATURES["finalize"]


def test_interface_and_refusals_without_vllm():
    from moe_a2a.compat import vllm as adapter

    cls = adapter.MoeA2APrepareAndFinalize
    assert issubclass(cls, adapter.FusedMoEPrepareAndFinalizeModular)
    assert adapter.FusedMoEPrepareAndFinalizeModular.__name__ == "FusedMoEPrepareAndFinalizeModular"
    for name, params in VLLM_SIGNATURES.items():
        assert list(inspect.signature(getattr(cls, name)).parameters)[1:] == params, name
    assert isinstance(inspect.getattr_static(cls, "activation_format"), property)
    assert adapter.FusedMoEActivationFormat.BatchedExperts.value == ("batched_experts",)
    meta = adapter.ExpertTokensMetadata(expert_num_tokens=torch.zeros(2, dtype=torch.int32), expert_num_tokens_cpu=None)
    assert meta.expert_num_tokens.shape == (2,)
    # The quantisation rule: fp8 in the dispatch only for 128 x 128 blocks.
    assert [adapter.quant_mode(q) for q in QUANTS.values()] == ["bf16", "fp8_dispatch", "fp8_token", "fp8_tensor"]
    assert adapter.quant_mode(_quant(FP8, [128, 128]), use_fp8_dispatch=False) == "fp8_block"
    assert adapter.quant_mode(_quant(FP8, [1, 64])) == "fp8_block"
    with pytest.raises(ValueError, match="only 128 x 128"):
        adapter.quant_mode(_quant(FP8, per_act_token_quant=True), use_fp8_dispatch=True)
    for refused in (torch.int8, "nvfp4", "mxfp4", "mxfp8"):
        with pytest.raises(ValueError, match=r"not supported .*int8, nvfp4, mxfp4 and mxfp8 are not.*128, 128"):
            adapter.quant_mode(_quant(refused))
    # What vLLM's all2all_utils asks of its DeepEP low-latency class, and its constructor's keyword for T.
    assert isinstance(inspect.getattr_static(cls, "maybe_roundup_layer_hidden_size"), staticmethod)
    assert [cls.maybe_roundup_layer_hidden_size(h) for h in (1000, 2048, 7168)] == [1000, 2048, 7168]
    with pytest.raises(ValueError, match="hidden_size"):
        cls.maybe_roundup_layer_hidden_size(0)
    params = inspect.signature(cls).parameters
    assert params["max_tokens_per_rank"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(params)[:7] == ["buffer", "max_num_tokens_per_rank", "num_dispatchers", "use_fp8_dispatch",
                                "global_to_physical", "physical_to_global", "local_expert_global_ids"]
    # install_as_deepep_low_latency on a stand-in of vLLM's all2all_utils module (without vLLM's CUDA names).
    a2a = types.ModuleType("all2all_utils")
    adapter.install_as_deepep_low_latency(a2a)
    assert a2a.DeepEPLLPrepareAndFinalize is cls and a2a.DEEPEP_QUANT_BLOCK_SHAPE == [128, 128]


def _kernel_call(pf, mb: int, x, w, idx, expert_map, quant, ubatch):
    """FusedMoEKernelModularImpl._launch_prepare for micro-batch `mb`: prepare_async under that id, which
    returns `(hook, receiver)` (run later, in the order the test chooses)."""
    ubatch[0] = mb
    ret = pf.prepare_async(x, w, idx, E, expert_map, False, quant, defer_input_quant=False)
    assert isinstance(ret, tuple) and len(ret) == 2
    return ret


def _experts(pf, ex, exs, rank):
    """A deterministic per-expert function of the received rows: expert l (global id g) scales by g % 3 + 1."""
    gids = pf.local_expert_global_ids
    assert torch.equal(gids.cpu(), P2G[rank * L:(rank + 1) * L])
    f = (gids % 3 + 1).to(torch.float32).view(-1, 1, 1).to(ex.device)
    x = ex.float() if exs is None else _dequant(ex, exs)
    return (x * f).to(torch.bfloat16)


def _dequant(q, s):
    H_ = q.shape[-1]
    reps = -(-H_ // s.shape[-1]) if s.shape[-1] > 1 else H_
    return q.float() * s.float().repeat_interleave(reps, dim=-1)[..., :H_]


def _adapter_rank(a2a, rank):
    from moe_a2a.compat import Buffer
    from moe_a2a.compat.vllm import MoeA2APrepareAndFinalize, TopKWeightAndReduceDelegate

    dev = a2a.device
    ubatch = [0]
    results = {}
    emap = _expert_map(rank).to(dev)
    with Buffer(transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size) as buf:
        # Constructed as vLLM's all2all_utils constructs its DeepEP low-latency class (T as max_tokens_per_rank=).
        pf = MoeA2APrepareAndFinalize(buf, max_tokens_per_rank=T_MAX, num_dispatchers=W, use_fp8_dispatch=None,
                                      global_to_physical=G2P, physical_to_global=P2G,
                                      local_expert_global_ids=P2G[rank * L:(rank + 1) * L],
                                      ubatch_id=lambda: ubatch[0])
        for both_or_neither in (dict(max_num_tokens_per_rank=T_MAX, max_tokens_per_rank=T_MAX), {}):
            try:
                MoeA2APrepareAndFinalize(buf, num_dispatchers=W, **both_or_neither)
                raise AssertionError(f"accepted {both_or_neither}")
            except ValueError as exc:
                assert "give one of max_num_tokens_per_rank" in str(exc)
        pf.post_init_setup(types.SimpleNamespace(quant_config=None))
        assert pf.supports_async() and pf.output_is_reduced() and pf.topk_indices_dtype() == torch.int64
        assert pf.max_num_tokens_per_rank() == T_MAX and pf.num_dispatchers() == W
        assert pf.activation_format.name == "BatchedExperts"
        ins = [tuple(t.to(dev) for t in _inputs(rank, 40 + mb, T_MAX, "random")) for mb in range(2)]
        # Two micro-batches (bf16) interleaved out of order: dispatch 0, dispatch 1, receive 1, receive 0,
        # combine 1, combine 0, receive combine 0, then 1.
        hooks = [_kernel_call(pf, mb, x, w, idx, emap, QUANTS["bf16"], ubatch) for mb, (x, idx, w) in enumerate(ins)]
        prepared = {}
        for mb in (1, 0):
            hook, receiver = hooks[mb]
            hook()
            prepared[mb] = receiver()
        fin = {}
        for mb in (1, 0):
            ubatch[0] = mb
            ex, exs, meta, tids, tws = prepared[mb]
            assert exs is None and tids is None and tws is None and ex.shape == (L, T_MAX * W, H)
            x, idx, w = ins[mb]
            out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=dev)
            ret = pf.finalize_async(out, _experts(pf, ex, exs, rank), w, idx, False, None)
            assert isinstance(ret, tuple) and len(ret) == 2 and all(callable(f) for f in ret)
            fin[mb] = (ret, out, meta.expert_num_tokens.clone())
        for mb in (0, 1):
            (hook, receiver), out, count = fin[mb]
            hook()
            assert receiver() is None
            results[("bf16", mb)] = {"count": count, "out": out}
        # Each quantisation mode, synchronously (prepare / finalize), on the same Buffer.
        x, idx, w = ins[0]
        for name in ("block128", "token", "tensor"):
            ex, exs, meta, _, _ = pf.prepare(x, w, idx, E, emap, False, QUANTS[name], False)
            assert ex.dtype == FP8 and exs.dtype == torch.float32
            count = meta.expert_num_tokens.clone()
            out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=dev)
            results[(name, 0)] = {"count": count, "scale_shape": tuple(exs.shape),
                                  "deq": _dequant(ex, exs).cpu()}
            y = _experts(pf, ex, exs, rank)
            # Experts that would weight and reduce themselves are refused before anything is sent (as vLLM's
            # DeepEP backend asserts); the prepared call stays, and the delegate marker is accepted.
            try:
                pf.finalize(out, y, w, idx, False, object())
                raise AssertionError("finalize accepted a weight_and_reduce_impl other than the delegate")
            except ValueError as exc:
                assert "TopKWeightAndReduceDelegate" in str(exc)
            pf.finalize(out, y, w, idx, False, TopKWeightAndReduceDelegate())
            results[(name, 0)]["out"] = out
        # Refusals: each rank refuses alike before any transfer, and the next call works.
        refusals = []
        for bad in ("nvfp4", torch.int8):
            try:
                pf.prepare(x, w, idx, E, emap, False, _quant(bad), False)
            except ValueError as exc:
                refusals.append(str(exc))
        try:
            pf.finalize(torch.empty_like(x), torch.empty(L, T_MAX * W, H, dtype=torch.bfloat16, device=dev), w, idx,
                        False, None)
        except ValueError as exc:
            refusals.append(str(exc))
        # The contiguous map is refused where round-robin placement was asked for (no mapping given).
        plain = MoeA2APrepareAndFinalize(buf, T_MAX, W)
        try:
            plain.prepare(x, w, idx, E, emap, False, QUANTS["bf16"], False)
        except ValueError as exc:
            refusals.append(str(exc))
        results["refusals"] = refusals
    return results


def _reference(ins_by_rank):
    cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                    expert_capacity=T_MAX * W)
    phys = [torch.where(i >= 0, G2P[i.clamp(min=0)], i) for _, i, _ in ins_by_rank]
    want = reference.dispatch(cfg, [x for x, _, _ in ins_by_rank], None, phys)
    # (counts [L], rows [L, C, H]) per rank; `reference.combine` takes the expert outputs as [L * C, H]
    return cfg, phys, [(c, x.reshape(L, T_MAX * W, H)) for c, x, _ in want]


@pytest.mark.timeout(600)
def test_prepare_finalize_round_robin_microbatches_and_quant():
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=W, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        got = cl.run(_adapter_rank)
    from moe_a2a.compat.vllm import quantize_received

    f = [(P2G[r * L:(r + 1) * L] % 3 + 1).float().view(-1, 1, 1) for r in range(W)]
    for mb in range(2):
        ins = [_inputs(r, 40 + mb, T_MAX, "random") for r in range(W)]
        cfg, phys, want = _reference(ins)
        ys = [(want[r][1].float() * f[r]).to(torch.bfloat16).reshape(-1, H) for r in range(W)]
        outs = reference.combine(cfg, phys, [w for _, _, w in ins], ys)
        for r in range(W):
            assert torch.equal(got[r][("bf16", mb)]["count"].cpu(), want[r][0]), (mb, r)
            assert combine_problems(got[r][("bf16", mb)]["out"].cpu(), outs[r], default_max_ulps(TEST_DEVICE)) == [], \
                (mb, r)
    # Quantised calls: the received rows, quantised by the rule, equal the reference's rows quantised the same
    # way (block128: the dispatch's per-128 scales; token / tensor: quantize_received on the bf16 rows).
    ins = [_inputs(r, 40, T_MAX, "random") for r in range(W)]
    cfg, phys, want = _reference(ins)
    shapes = {"block128": (L, T_MAX * W, 1), "token": (L, T_MAX * W, 1), "tensor": (L, 1, 1)}
    for name in ("block128", "token", "tensor"):
        for r in range(W):
            res, count = got[r][(name, 0)], want[r][0]
            assert torch.equal(res["count"].cpu(), count), (name, r)
            assert res["scale_shape"] == shapes[name], (name, res["scale_shape"])
            mode = {"block128": "fp8_block", "token": "fp8_token", "tensor": "fp8_tensor"}[name]
            q, s = quantize_received(want[r][1], count, mode, QUANTS[name] if name != "block128"
                                     else _quant(FP8, [1, 128]))
            rows = torch.arange(T_MAX * W)[None, :] < count[:, None]  # rows past the count are stale
            assert torch.equal(res["deq"][rows], _dequant(q, s)[rows]), (name, r)
            ys = [(_dequant(*quantize_received(want[rr][1], want[rr][0], mode, QUANTS[name] if name != "block128"
                                               else _quant(FP8, [1, 128]))) * f[rr]).to(torch.bfloat16)
                  .reshape(-1, H) for rr in range(W)]
            outs = reference.combine(cfg, phys, [w for _, _, w in ins], ys)
            assert combine_problems(res["out"].cpu(), outs[r], default_max_ulps(TEST_DEVICE)) == [], (name, r)
    for r in range(W):
        ref = got[r]["refusals"]
        assert len(ref) == 4, ref
        assert "nvfp4" in ref[0] and "int8" in ref[1] and "supported" in ref[0]
        assert "no prepared call for micro-batch 0" in ref[2]
        assert "expert_map on rank" in ref[3] and "global_to_physical" in ref[3]
