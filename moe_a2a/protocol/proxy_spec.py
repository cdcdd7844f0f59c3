"""What a proxy process needs to start (`ProxySpec`): made by the model process (`runtime.proxy_handle`),
pickled over the proxy's socket and read by the proxy process (`proxy.worker`). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Layout


@dataclass(frozen=True)
class ProxySpec:
    """Everything the proxy needs to start (picklable, torch-free)."""

    layout: Layout
    rank: int
    segment: str
    host_staged: bool      # send/recv buffers live in the segment (else: GPU memory)
    provider: str
    timeout_s: float
    parent_pid: int
    spin_s: float = 1e-3   # busy-poll this long before backing off to short sleeps
    # Between calls a proxy with a core of its own busy-polls this long before sleeping: a sleep there
    # delayed the next call's ROUTE_READY by up to 1.2 ms (2 x H200, graph replays back to back,
    # 2026-11-30). A model step longer than this pays one wake-up (<= 1 ms) per call instead.
    between_calls_spin_s: float = 0.2
    idle_yield: bool = False  # sched_yield in the engine's waits (more busy processes than cores)
    # (memory kind, device ordinal, send size, recv size) of the model's send/recv buffers when they
    # are not in the segment: "cuda" (cuMem) or "host" (memfd). Their POSIX FDs follow the spec on
    # the socket; the proxy maps them and registers them with the NIC ("cuda": FI_HMEM_CUDA).
    fd_buffers: tuple[str, int, int, int] | None = None
    domains: tuple[str, ...] | None = None  # the NICs (libfabric domains) to open; None: the first
    # Every rank runs on this host: a socket provider (tcp) listens on 127.0.0.1 only, so other hosts
    # cannot reach the proxy's endpoint (docs/threat-model.md). No effect on shm/efa/verbs.
    local_only: bool = False
    # This process is proxy `shard` of `shards` of its rank: it carries the remote peers
    # layout.shard_peers(rank, shard, shards) (its share, or under the relay its piece of every rail write).
    # Shard 0 (the primary) raises the flags the kernels read.
    shard: int = 0
    shards: int = 1
    # Where the proxy runs (topology.choose_proxy_cpus): MOE_A2A_PROXY_CPUS as the model process read
    # it (None: unset), and the rank's GPU (CUDA ordinal, UUID for NVML; None: a CPU run, not pinned).
    cpu_override: str | None = None
    gpu_ordinal: int | None = None
    gpu_uuid: str | None = None
    # Transport "emulated": its NIC settings as the model process read them (MOE_A2A_EMULATED_NIC; "": none).
    emulated_nic: str = ""
    # Shrink mode: a peer a wait times out on is masked (segment words), not an error (docs/protocol.md, section 6, shrink mode).
    shrink: bool = False
