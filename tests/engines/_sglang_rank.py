"""One rank of SGLang's own DeepEP dispatcher over the facade, on the CPU: `python -m
tests.engines._sglang_rank MODE RANK WORLD PORT OUT_JSON` (started by tests/engines/test_sglang.py, twice,
with MOE_A2A_AS_DEEP_EP=1, TRITON_INTERPRET=1 and SGLANG_DEEPEP_BF16_DISPATCH=1 in the environment).

As in an SGLang scheduler process: the dispatcher module (`token_dispatcher/deepep.py`) is imported first,
then `sglang.srt.plugins.load_plugins()` runs our entry point, which aliases `deep_ep` and patches that
already-imported module. Then `DeepEPDispatcher(deepep_mode=MODE)` (`low_latency`, `normal` or `auto`) on a
gloo group, its `dispatch` / `combine` for two calls (`auto`: a prefill batch, normal mode, then a decode
batch, low-latency mode, as SGLang's forward batches set `is_extend_in_batch`), with toy SwiGLU experts
(`_toy.py`) on what it receives, checked against the dense reference.

CPU stand-ins, each for something SGLang reads from a GPU (the only changes to SGLang's path):
- `torch.cuda.get_device_properties(...).multi_processor_count`, read when the buffer is made (a warning's
  threshold): 132.
- `deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True` for `normal` / `auto`: SGLang's normal-mode combine runs
  only with its DeepGEMM runner (else `NotImplementedError`), which it turns on for GPUs that have it; here it
  also makes the normal dispatch align each expert's rows to 128 (`expert_alignment`), as on such a GPU.
"""
from __future__ import annotations

import sys
import types

import torch

from tests.engines import _launch, _toy

H = 1024
T = 6  # tokens per rank and call (SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK is set to 8)


def _experts_ll(out, w1, w2) -> torch.Tensor:
    """Low-latency output `[L, C, H]` with `masked_m [L]` rows each -> the experts' `[L, C, H]` bf16."""
    y = torch.zeros_like(out.hidden_states)
    for e, m in enumerate(out.masked_m.tolist()):
        if m:
            y[e, :m] = _toy.swiglu(out.hidden_states[e, :m], w1[e], w2[e]).to(y.dtype)
    return y


def _experts_normal(out, w1, w2) -> torch.Tensor:
    """Normal-mode output: received rows `[R, H]`, their local top-k ids (-1: another rank's) and weights ->
    `[R, H]` bf16, each row's weighted sum over its local experts (what SGLang's DeepGEMM runner returns)."""
    x, ids, w = out.hidden_states, out.topk_ids, out.topk_weights
    y = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[r, k])
            if e >= 0:
                y[r] += float(w[r, k]) * _toy.swiglu(x[r:r + 1], w1[e], w2[e])[0]
    return y.to(torch.bfloat16)


def run(mode: str, rank: int, world: int, port: int) -> dict:
    from sglang.srt.layers.moe.token_dispatcher import deepep  # imported before the plugins, as in SGLang
    from sglang.srt.plugins import load_plugins

    result = {"use_deepep_before_plugins": deepep.use_deepep}
    load_plugins()  # SGLang's plugin hook, in every process: our entry point
    result.update(use_deepep=deepep.use_deepep, buffer_class=f"{deepep.Buffer.__module__}.{deepep.Buffer.__name__}")
    import torch.distributed as dist
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import DeepEPMode

    from sglang.srt.runtime_context import get_context

    # The server's arguments, as `python -m sglang.launch_server ... --moe-a2a-backend deepep --deepep-mode MODE
    # --deepep-dispatcher-output-dtype bf16` publishes them (SGLang's own override for tests).
    get_context().override_server_args(moe_a2a_backend="deepep", deepep_mode=mode,
                                       deepep_dispatcher_output_dtype="bf16").install()
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=132)
    if mode != "low_latency":
        deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    E, L = _toy.E, _toy.E // world
    dispatcher = deepep.DeepEPDispatcher(group=dist.group.WORLD, router_topk=_toy.K, permute_fusion=True,
                                         num_experts=E, num_local_experts=L, hidden_size=H,
                                         params_dtype=torch.bfloat16, deepep_mode=DeepEPMode(mode),
                                         async_finish=mode != "low_latency", return_recv_hook=mode != "normal")
    w1, w2 = _toy.weights(H)
    w1, w2 = w1[rank * L:(rank + 1) * L], w2[rank * L:(rank + 1) * L]
    errors, formats = [], []
    for call in range(2):
        set_is_extend_in_batch(call == 0)  # auto: a prefill (extend) batch, then a decode batch
        x, ids, w = _toy.tokens(rank, T - call, H, call=call)
        out = dispatcher.dispatch(x, StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=None))
        formats.append(out.format.name)
        if out.format.name == "DEEPEP_LL":
            combine_input = deepep.DeepEPLLCombineInput(_experts_ll(out, w1, w2), out.topk_ids, out.topk_weights)
        else:
            combine_input = deepep.DeepEPNormalCombineInput(_experts_normal(out, w1, w2), out.topk_ids,
                                                            out.topk_weights)
        y = dispatcher.combine(combine_input)
        full_w1, full_w2 = _toy.weights(H)
        errors.append(_toy.error(y, _toy.dense(x, ids, w, full_w1, full_w2)))
    result.update(errors=errors, formats=formats,
                  buffer=type(deepep.DeepEPBuffer._state().buffer).__module__)
    return result


if __name__ == "__main__":
    sys.exit(_launch.rank_main(run, sys.argv[1:]))
