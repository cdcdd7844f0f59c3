"""Which NICs a rank's proxy drives.

EFA hosts give each GPU several NICs (p5: 32 for 8 GPUs), each a libfabric domain; the proxy opens
its rank's share and the engine shards peers over them. The share is by listing order: the node's
NICs split into equal contiguous runs, one per rank of the node (libfabric lists EFA devices in PCI
order, which on the hosts we know follows GPU order). Matching NICs to GPUs by PCIe switch through
NVML is the refinement to make once an EFA host is at hand to check it on.
"""
from __future__ import annotations


def nics_for_rank(domains: list[str], local_rank: int, ranks_per_node: int) -> list[str]:
    """The domains local rank `local_rank` of `ranks_per_node` opens: an equal contiguous share of
    `domains` (the first `len // ranks_per_node * ranks_per_node` of them), or with fewer domains than
    ranks, domain `local_rank % len(domains)` shared with other ranks."""
    if not domains:
        raise ValueError("no NIC (libfabric domain) to choose from")
    if not 0 <= local_rank < ranks_per_node:
        raise ValueError(f"local_rank {local_rank} outside [0, {ranks_per_node})")
    share = len(domains) // ranks_per_node
    if share == 0:
        return [domains[local_rank % len(domains)]]
    return list(domains[local_rank * share:(local_rank + 1) * share])
