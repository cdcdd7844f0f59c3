"""The proxy's engine for its spec: over libfabric (`fabric.py`, the engines' default carrier), or for
transport "emulated" over the emulated NIC (`emulated.py`)."""
from __future__ import annotations

from .engine import EMULATED, TransferEngine


def make_engine(spec, on_gpu: bool) -> TransferEngine:
    """The proxy's engine for `spec` (`protocol.proxy_spec.ProxySpec`): over libfabric, or for transport
    "emulated" over the emulated NIC (its CUDA carrier when the buffers are GPU memory)."""
    if spec.provider != EMULATED:
        return TransferEngine(spec.provider, domains=spec.domains, timeout_s=spec.timeout_s,
                              idle_yield=spec.idle_yield, hmem=on_gpu, local_only=spec.local_only)
    from .emulated import EmulatedCarrier  # only a run over the emulated NIC loads it
    from .nic_settings import parse_nic_settings

    # Every engine that connects to us claims a ring: every proxy of every rank (ourselves included).
    senders = spec.layout.world_size * max(1, spec.shards) + 1
    carrier = EmulatedCarrier(cuda_device=spec.fd_buffers[1] if on_gpu else None,
                              nic=parse_nic_settings(spec.emulated_nic), max_senders=senders)
    return TransferEngine(carrier=carrier, timeout_s=spec.timeout_s, idle_yield=spec.idle_yield)
