"""One rank of vLLM's own DeepEP backends over the facade, on the CPU: `python -m tests.engines._vllm_rank
SCENARIO RANK WORLD PORT OUT_JSON` (started by tests/engines/test_vllm.py, twice, with MOE_A2A_AS_DEEP_EP=1
and TRITON_INTERPRET=1 in the environment).

What vLLM does in a worker, as far as a CPU allows: `load_general_plugins()` (our entry point aliases
`deep_ep`), the distributed state over gloo, vLLM's `DeepEPLLAll2AllManager` / `DeepEPHTAll2AllManager` on
that group (they build `deep_ep.Buffer`, the facade), `all2all_utils.maybe_make_prepare_finalize` for a
`FusedMoEConfig` with expert parallelism, and `FusedMoEKernel(prepare_finalize, experts).apply(...)` with toy
SwiGLU experts (vLLM's expert interface; `_toy.py`). Two calls a scenario, checked against the dense
reference. Scenarios:

- `ll`: `--all2all-backend deepep_low_latency`, vLLM's own `DeepEPLLPrepareAndFinalize`. vLLM imports its
  DeepEP classes into `all2all_utils` only on CUDA-like platforms (this one is not), so this script makes
  those two imports itself, as that branch does.
- `ll_adapter`: the same, with `MOE_A2A_VLLM_PREPARE_FINALIZE=1`: our plugin puts
  `moe_a2a.compat.vllm.MoeA2APrepareAndFinalize` in that name; nothing is imported by hand.
- `ht`: `--all2all-backend deepep_high_throughput`, vLLM's own `DeepEPHTPrepareAndFinalize` (normal mode),
  standard-format experts.
"""
from __future__ import annotations

import sys

import torch

from tests.engines import _launch, _toy

# The layer's hidden size before vLLM's `maybe_roundup_layer_hidden_size`: vLLM's DeepEP low-latency class
# takes eight sizes (2048 the smallest); ours any (1000 stays 1000).
HIDDEN = {"ll": 2048, "ll_adapter": 1000, "ht": 1024}
T = 6  # tokens per rank and call


def _experts_classes():
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate, TopKWeightAndReduceNoOP)

    class _Toy(mk.FusedMoEExpertsModular):
        """Toy SwiGLU experts in vLLM's expert interface (not one of vLLM's: its own call C++ ops that a
        CPU build of this wheel lacks); weights `w1 [L, 2N, H]`, `w2 [L, H, N]` of the local experts."""

        @staticmethod
        def _supports_current_device() -> bool:
            return True

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return weight_key is None and activation_key is None

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation.value == "silu"

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return True

    class ToyBatched(_Toy):
        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.BatchedExperts

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceDelegate()

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            C = self.max_num_tokens * self.num_dispatchers
            return (local_num_experts, C, max(N, K)), (local_num_experts, C, N), (local_num_experts, C, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            assert a1q_scale is None, "bf16 dispatch expected"
            counts = expert_tokens_meta.expert_num_tokens.tolist()
            output.zero_()
            for e, n in enumerate(counts):
                if n:
                    output[e, :n] = _toy.swiglu(hidden_states[e, :n], w1[e], w2[e]).to(output.dtype)
            return None

    class ToyStandard(_Toy):
        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.Standard

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceNoOP()  # apply() weights and reduces over top-k itself

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (M, topk, max(N, K)), (M, topk, N), (M, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            assert a1q_scale is None, "bf16 dispatch expected"
            out = torch.zeros(output.shape, dtype=torch.float32)
            local = expert_map[topk_ids.clamp(min=0)] if expert_map is not None else topk_ids
            for t in range(hidden_states.shape[0]):
                for k in range(topk_ids.shape[1]):
                    e = int(local[t, k])
                    if int(topk_ids[t, k]) >= 0 and e >= 0:
                        out[t] += float(topk_weights[t, k]) * _toy.swiglu(hidden_states[t:t + 1], w1[e], w2[e])[0]
            output.copy_(out.to(output.dtype))
            return None

    return ToyBatched, ToyStandard


def run(scenario: str, rank: int, world: int, port: int) -> dict:
    import vllm.plugins

    vllm.plugins.load_general_plugins()  # as every vLLM process does: our entry point aliases deep_ep
    import deep_ep
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import get_ep_group, init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig,
                                                             FusedMoEParallelConfig, RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.utils.import_utils import has_deep_ep

    result = {"has_deep_ep": has_deep_ep(), "deep_ep": deep_ep.__name__}
    backend = "deepep_high_throughput" if scenario == "ht" else "deepep_low_latency"
    # `--data-parallel-size WORLD --enable-expert-parallel --all2all-backend BACKEND`, this process DP rank `rank`
    parallel_config = ParallelConfig(data_parallel_size=world, data_parallel_rank=rank, data_parallel_size_local=world,
                                     data_parallel_master_ip="127.0.0.1", data_parallel_master_port=port,
                                     enable_expert_parallel=True, all2all_backend=backend)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=parallel_config)
    # The DP process groups' ports: from `port` on, the same in both processes (vLLM's engine core draws
    # free ports and hands them to its workers; constructed here, each process would draw its own).
    config.parallel_config._data_parallel_master_port_list = []
    config.parallel_config.data_parallel_master_port = port
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, "env://", 0, "gloo")  # one worker per DP rank (TP = PP = 1)
        initialize_model_parallel(1, 1)
        from vllm.v1.worker.workspace import init_workspace_manager

        init_workspace_manager(torch.device("cpu"))  # as the model runner does
        cpu_group = get_ep_group().cpu_group  # what vLLM's CUDA communicator gives its all2all manager
        from vllm.distributed.device_communicators import all2all

        if scenario == "ht":
            manager = all2all.DeepEPHTAll2AllManager(cpu_group)
        else:
            manager = all2all.DeepEPLLAll2AllManager(cpu_group)
        if scenario in ("ll", "ht"):  # what all2all_utils imports on CUDA-like platforms when has_deep_ep()
            from vllm.model_executor.layers.fused_moe.prepare_finalize import deepep_ht, deepep_ll

            all2all_utils.DeepEPHTPrepareAndFinalize = deepep_ht.DeepEPHTPrepareAndFinalize
            all2all_utils.DeepEPLLPrepareAndFinalize = deepep_ll.DeepEPLLPrepareAndFinalize
            all2all_utils.DEEPEP_QUANT_BLOCK_SHAPE = deepep_ll.DEEPEP_QUANT_BLOCK_SHAPE
        E, L = _toy.E, _toy.E // world
        parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0, pcp_rank=0,
                                          dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True, all2all_backend=backend,
                                          enable_eplb=False)
        hidden = all2all_utils.maybe_roundup_layer_hidden_size(HIDDEN[scenario], torch.bfloat16, parallel)
        moe = FusedMoEConfig(num_experts=E, experts_per_token=_toy.K, hidden_dim=hidden, intermediate_size=_toy.N,
                             num_local_experts=L, num_logical_experts=E, activation=MoEActivation.SILU,
                             device="cpu", routing_method=RoutingMethodType.Renormalize,
                             moe_parallel_config=parallel, in_dtype=torch.bfloat16, max_num_tokens=T)
        pf = all2all_utils.maybe_make_prepare_finalize(moe, FUSED_MOE_UNQUANTIZED_CONFIG, all2all_manager=manager)
        result.update(hidden=hidden, prepare_finalize=f"{type(pf).__module__}.{type(pf).__name__}",
                      buffer=f"{type(pf.buffer).__module__}.{type(pf.buffer).__name__}" if hasattr(pf, "buffer")
                      else None)
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk

        # vLLM's platform on a host without GPUs ("unspecified") claims pinned memory, which needs a GPU
        # driver; the HT prepare pins its per-expert counts. The one CPU workaround here.
        mk.PIN_MEMORY = False
        ToyBatched, ToyStandard = _experts_classes()
        if scenario == "ht":
            experts = ToyStandard(moe, FUSED_MOE_UNQUANTIZED_CONFIG)
        else:
            experts = ToyBatched(moe, FUSED_MOE_UNQUANTIZED_CONFIG, max_num_tokens=T, num_dispatchers=world)
        kernel = FusedMoEKernel(pf, experts)
        w1, w2 = _toy.weights(hidden)
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32)
        errors = []
        for call in range(2):
            x, ids, w = _toy.tokens(rank, T - call, hidden, call=call)  # T varies per call, as in serving
            out = kernel.apply(x, w1[rank * L:(rank + 1) * L], w2[rank * L:(rank + 1) * L], w, ids,
                               MoEActivation.SILU, E, expert_map, False)
            errors.append(_toy.error(out, _toy.dense(x, ids, w, w1, w2)))
        result["errors"] = errors
        manager.destroy()
    return result


if __name__ == "__main__":
    sys.exit(_launch.rank_main(run, sys.argv[1:]))
