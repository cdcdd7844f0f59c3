"""Bootstrap exchange over torch.distributed: gather engine addresses and region descriptors, and refuse
ranks whose fabrics cannot talk to each other.

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


def check_same_fabric(addresses_by_rank) -> None:
    """Refuse mixed nodes: ``ValueError`` naming the ranks of each kind when the engines' fabrics differ
    (`EngineAddress.fabric`: on efa the libfabric version and the EFA device generation). Ranks that differ
    there make EFA emulate writes with sends, whose large-message protocol reads our source buffer, which is
    registered for local writes only: the proxy would die at the first call. ``addresses_by_rank``: per rank,
    the addresses of its proxies (every rank passes the same exchanged table, so every rank raises alike).
    Addresses without a fabric (tcp, shm, verbs, the emulated NIC) are not compared."""
    kinds: dict[str, list[int]] = {}
    for rank, addresses in enumerate(addresses_by_rank):
        for fabric in sorted({getattr(a, "fabric", "") for a in addresses} - {""}):
            kinds.setdefault(fabric, []).append(rank)
    if len(kinds) > 1:
        groups = "; ".join(f"ranks {_ranks(r)}: {k}" for k, r in sorted(kinds.items(), key=lambda kv: kv[1][0]))
        raise ValueError(f"mixed nodes: every rank must run the same libfabric version on the same EFA device "
                         f"generation ({groups}): EFA would emulate writes between them with sends, which read "
                         f"our unregistered buffers; run all ranks on one instance type with one EFA installer")


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)
