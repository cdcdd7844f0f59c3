"""What `AllToAll`'s arguments decide, made once at construction by `plan()` as one frozen `Plan`.

`plan()` owns every refusal of the constructor's arguments, in this order: the local ones first (the
config, the timeout, the device, the transport and the emulated NIC's settings, the placement and wait
options, the proxies, the provider's presence), so that every rank refuses alike before anything
collective; then the group, the rank mask, and the configuration exchanged with every rank
(`fingerprint.exchange`, which also gives the host names); then the layout and what it forbids (memory,
shrink mode with remote peers). The choices that follow (transport, NICs, proxies, waits) are the same
on every rank, since they depend only on the arguments, the hosts and the layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import fingerprint
from ..config import A2AConfig, Layout
from ..protocol.memory import check_fits_in_memory
from ..protocol.words import MAX_PROXY_SHARDS
from ..proxy import libfabric as lf
from ..proxy import nic_settings
from . import placement, wiring
from .checks import canonical_device, check_rank_mask

TRANSPORTS = ("auto", "efa", "shm", "tcp", "verbs", "emulated")


@dataclass(frozen=True)
class Plan:
    """What one rank's `AllToAll` is built with (the same on every rank but `rank` and `nics`)."""

    group: Any                      # the torch.distributed group of the bootstrap (WORLD when None was given)
    rank: int
    world_size: int
    device: torch.device            # canonical (`checks.canonical_device`): every tensor is compared with it
    timeout_s: float
    hosts: tuple[str, ...]          # every rank's host name, from the exchanged fingerprint
    layout: Layout
    transport: str                  # the provider, "auto" resolved (`wiring.choose_transport`)
    nics: tuple[str, ...] | None    # the domains this rank's proxies open (None: the provider's first)
    num_proxies: int                # proxy processes per rank
    buffers: str                    # the `buffers` argument (the placement is chosen by the wiring)
    gpu_wait: str                   # the argument; "auto" made "host" in shrink mode with remote peers on a GPU
    local_only: bool                # every rank on this host and the NICs not named: proxies listen on loopback
    emulated_nic: Any = None        # transport "emulated": its `NicSettings` from MOE_A2A_EMULATED_NIC, else None
    rank_mask: Any = None           # shrink mode: the `runtime.shrink.RankMask`, else None


def check_local(cfg, transport, device, timeout_s, gpu_wait, buffers, nics, proxies):
    """The refusals that need no other rank: `(device, emulated NIC settings or None)`, or ValueError."""
    if not isinstance(cfg, A2AConfig):
        raise ValueError(f"cfg: expected A2AConfig, got {type(cfg).__name__}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    device = canonical_device(device)  # once, here: every tensor of every call is compared with it
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be 'auto', 'efa', 'shm', 'tcp', 'verbs' or 'emulated', got {transport!r}")
    # The emulated NIC's settings, read once here (ValueError naming the variable, before anything collective).
    emulated_nic = nic_settings.nic_settings_from_env() if transport == "emulated" else None
    placement.check_options(gpu_wait, buffers, nics)
    if proxies != "auto" and (isinstance(proxies, bool) or not isinstance(proxies, int) or proxies < 1
                              or proxies > MAX_PROXY_SHARDS):
        raise ValueError(f"proxies must be 'auto' or an int in [1, {MAX_PROXY_SHARDS}], got {proxies!r}")
    if transport not in ("auto", "emulated"):  # before anything collective: every rank refuses alike
        name, available = lf.PROVIDER_NAMES[transport], lf.list_providers()
        if name not in available:
            raise ValueError(f"transport {transport!r} needs libfabric's {name!r} provider, which is not "
                             f"available here (available: {available}; efa and verbs need their "
                             f"devices, MOE_A2A_LIBFABRIC may point at another libfabric.so)")
    return device, emulated_nic


def plan(cfg: A2AConfig, group, node_group, transport: str, device, timeout_s: float, gpu_wait: str,
         buffers: str, nics, proxies, rank_mask) -> Plan:
    """`AllToAll`'s arguments checked and decided (collective: every rank calls it; a refusal after the
    exchange is raised on every rank alike, since every rank holds the same hosts and layout)."""
    import torch.distributed as dist

    device, emulated_nic = check_local(cfg, transport, device, timeout_s, gpu_wait, buffers, nics, proxies)
    if group is None:
        if not dist.is_initialized():
            raise ValueError("AllToAll needs torch.distributed initialised (or pass group=)")
        group = dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank_mask is not None:
        check_rank_mask(rank_mask, rank, world_size)
    if buffers == "gpu" and device.type != "cuda":
        raise ValueError(f"buffers='gpu' needs a CUDA device, got device {device}")
    if buffers == "memfd" and device.type != "cpu":
        raise ValueError(f"buffers='memfd' is for CPU tensors, got device {device}")
    # With the host names, every rank's configuration: a difference raises ValueError on every rank, here.
    # The emulated NIC's settings are part of the transport: ranks that differ are refused alike.
    hosts = fingerprint.exchange(group, cfg, node_group=node_group, buffers=buffers,
                                 transport=(transport if emulated_nic is None else f"emulated({emulated_nic})")
                                 + (" in shrink mode" if rank_mask is not None else ""),
                                 proxies=proxies, device=device)
    if transport == "emulated" and len(set(hosts)) > 1:  # every rank holds the same hosts: all refuse
        raise ValueError(f"transport='emulated' connects simulated nodes of one host (node_group); these ranks "
                         f"run on {len(set(hosts))} hosts {sorted(set(hosts))}")
    layout = cfg.layout(world_size, wiring.node_size(node_group, hosts, world_size))
    check_fits_in_memory(layout, ranks=1, host_staged=device.type != "cuda")
    if cfg.rank_rows and rank_mask is not None:  # alike on every rank
        raise ValueError("cfg.dispatch_rows='rank' with rank_mask (shrink mode): the masks drop routes and the "
                         "rows of masked ranks, which per-rank rows do not follow yet; use dispatch_rows='route'")
    remote_shrink = rank_mask is not None and layout.node_size < world_size  # every rank has the same layout
    if remote_shrink and layout.private_rows < cfg.max_routes:
        raise ValueError(f"rank_mask (shrink mode) with remote peers needs cfg.max_private_tokens >= "
                         f"max_num_tokens * experts_per_token = {cfg.max_routes} (no shared remainder region), "
                         f"got {cfg.max_private_tokens}")
    if remote_shrink and device.type == "cuda":
        gpu_wait = "host" if gpu_wait == "auto" else gpu_wait  # the host takes in the proxies' masks
        if gpu_wait != "host":
            raise ValueError(f"rank_mask (shrink mode) with remote peers needs gpu_wait='host' on a GPU, got "
                             f"gpu_wait={gpu_wait!r}: the kernels' own waits mask node peers only (every rank on "
                             f"one node), the proxies' remote ones are taken in by the host")
    chosen = wiring.choose_transport(transport, hosts)
    chosen_nics = wiring.choose_nics(nics, chosen, rank, layout, device=device)
    num_proxies = wiring.choose_proxies(proxies, chosen, chosen_nics, len(layout.wire_peers(rank)), layout.relay)
    layout = layout.with_wire_pieces(num_proxies)  # the relay with several proxies: each write in pieces
    # Every rank on this host: the proxies listen on loopback only (docs/threat-model.md), unless the
    # caller named the NICs to use.
    return Plan(group=group, rank=rank, world_size=world_size, device=device, timeout_s=float(timeout_s),
                hosts=tuple(hosts), layout=layout, transport=chosen, nics=chosen_nics, num_proxies=num_proxies,
                buffers=buffers, gpu_wait=gpu_wait, local_only=len(set(hosts)) == 1 and nics == "auto",
                emulated_nic=emulated_nic, rank_mask=rank_mask)
