"""Bootstrap exchange over torch.distributed: gather engine addresses and region descriptors.

Only used at setup (never on the data path); gloo is enough. torch is imported lazily so the proxy
process, which never bootstraps itself, does not pay for it.
"""
from __future__ import annotations


def exchange(group, obj) -> list:
    """All-gather a picklable ``obj`` (e.g. an ``EngineAddress`` or ``RemoteRegion``) over ``group``
    (a torch.distributed process group; ``None`` = WORLD). Returns the list indexed by group rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
