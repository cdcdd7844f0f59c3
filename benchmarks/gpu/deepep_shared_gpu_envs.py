"""`deep_ep.utils.envs` for DeepEP's own tests with more processes than GPUs (assembled by
`deepep_low_latency.sh --shared-gpu`; DeepEP's `init_dist` says it is meant to be rewritten per cluster).

Everything is DeepEP's module (loaded from the checkout, never copied) except `init_dist`, which
- maps local rank r to GPU `r % torch.cuda.device_count()` (several ranks share a GPU; under MPS their
  kernels run side by side),
- uses gloo for the test's own collectives (NCCL refuses two ranks on one GPU),
- passes gloo's `all_gather_into_tensor` a flat output (gloo refuses the test's stacked `[W, T, K]` one).
The facade does its own bootstrap and never uses the test's group for tokens.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.distributed as dist

_UPSTREAM = os.environ["MOE_A2A_DEEPEP_ENVS"]  # DeepEP's deep_ep/utils/envs.py, set by the script
_spec = importlib.util.spec_from_file_location(f"{__package__}._upstream_envs", _UPSTREAM)
_upstream = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _upstream
_spec.loader.exec_module(_upstream)  # its relative imports (.comm) resolve in this package
globals().update({k: v for k, v in vars(_upstream).items() if not k.startswith("__") and k != "init_dist"})


def _all_gather_flat(all_gather):
    def gather(output, input, group=None, async_op=False):
        return all_gather(output.view(-1), input.reshape(-1), group=group, async_op=async_op)
    return gather


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0):
    """DeepEP's `init_dist` for ranks that share GPUs: same environment variables, same return value."""
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", 1))
    node_rank = int(os.getenv("RANK", 0))
    _upstream._local_rank = local_rank  # dist_print reads it there
    device = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dist.init_process_group(backend="gloo", init_method=f"tcp://{ip}:{port}",
                            world_size=num_nodes * num_local_ranks, rank=node_rank * num_local_ranks + local_rank)
    if not getattr(dist.all_gather_into_tensor, "_flat", False):
        dist.all_gather_into_tensor = _all_gather_flat(dist.all_gather_into_tensor)
        dist.all_gather_into_tensor._flat = True
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    _upstream.init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks * num_nodes)))
