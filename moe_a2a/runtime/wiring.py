"""One rank's construction, done collectively: the shared segment, the proxy processes, the buffers (a
`Placement`), the bootstrap exchange, and the addresses and views the kernels take.

`Wiring` holds what the four halves of `AllToAll` touch; it knows nothing of tokens. Every rank derives
the same decisions from the same bootstrap table, so any refusal is raised on every rank alike.
"""
from __future__ import annotations

import ctypes
import logging
import os
import socket
from typing import Any, NamedTuple

import torch

from ..config import Layout
from ..protocol.memory import SharedSegment, device_view, unique_name
from ..protocol.proxy_spec import ProxySpec
from ..protocol.segment import Flags
from ..protocol.words import HALF_FLAGS, MAX_PROXY_SHARDS, WRITE_TABLE_COLUMNS, Flag, WriteTable, flag_word
from ..proxy import topology
from ..proxy.fabric import auto_provider
from ..triton_kernels.node_sync import NodeSync
from . import bootstrap
from . import placement as placements
from .checks import canonical_device
from .proxy_handle import ProxyHandle

log = logging.getLogger("moe_a2a")

# The least a start-up wait (a proxy's address, its registration) is given, whatever the call timeout.
STARTUP_S = 60.0


# ---- decisions from the arguments and the hosts (the same on every rank) --------------------------
def mps_enabled(device: torch.device) -> bool:
    """Whether this process's contexts on `device` run under MPS (clients' kernels then run side by side,
    so ranks sharing the GPU may wait in kernels). False when the driver cannot say."""
    try:
        from cuda.bindings import runtime as rt

        index = device.index if device.index is not None else torch.cuda.current_device()
        err, value = rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMpsEnabled, index)
        return err == rt.cudaError_t.cudaSuccess and bool(value)
    except Exception:  # an older cuda-python or driver: no MPS assumed (host waits, the safe side)
        return False


def node_size(node_group, hosts: list[str], world_size: int) -> int:
    """Ranks per node: an int, "auto"/None (ranks of one hostname, grouped contiguously) or a group."""
    W = world_size
    if isinstance(node_group, int) and not isinstance(node_group, bool):
        n = node_group
    elif node_group is None or node_group == "auto":
        n = hosts.count(hosts[0])
        if any(hosts[i] != hosts[i // n * n] for i in range(W)) or W % n:
            raise ValueError(f"node_group='auto': ranks must be grouped contiguously by host in equal "
                             f"numbers, got hosts {hosts}")
    else:
        import torch.distributed as dist

        n = dist.get_world_size(node_group)
    if n < 1 or W % n:
        raise ValueError(f"node_group: node size {n} must divide world size {W}")
    return n


def choose_transport(transport: str, hosts: list[str]) -> str:
    """"auto": efa if present, else shm on one host and tcp between hosts (shm reaches only this host)."""
    if transport != "auto":
        return transport
    chosen = auto_provider()
    return "tcp" if chosen == "shm" and len(set(hosts)) > 1 else chosen


def choose_nics(nics, transport: str, rank: int, layout: Layout, device=None) -> tuple[str, ...] | None:
    """The domains this rank's proxies open (None: the provider's first). "auto" over efa or verbs:
    the NICs by PCIe topology next to this rank's GPU (`device`, default the current CUDA device;
    `proxy.topology.choose_nics`), a `NicChoice` whose `rule` and `reason` say why (logged)."""
    if nics != "auto":
        return tuple(nics)
    if transport not in ("efa", "verbs"):
        return None
    ordinal = uuid = None
    try:
        dev = canonical_device(device)
        if dev.type == "cuda":
            ordinal = dev.index
            uuid = f"GPU-{torch.cuda.get_device_properties(ordinal).uuid}"  # NVML's form
    except Exception as exc:  # noqa: BLE001 - without the UUID, the ordinal (if any) still finds the GPU
        log.debug("moe_a2a rank %d: no GPU UUID for the NIC choice: %s", rank, exc)
    choice = topology.choose_nics(transport, rank % layout.node_size, layout.node_size, ordinal, uuid)
    log.info("moe_a2a rank %d: NICs %s by %s: %s", rank, ",".join(choice), choice.rule, choice.reason)
    return choice


def choose_proxies(proxies, transport: str, nics, remote_peers: int, pieces: bool = False) -> int:
    """Proxy processes per rank: "auto" is one per NIC on EFA (at most one per remote peer, unless each write
    goes in pieces, one per proxy: `pieces`, the relay's few rail writes), else 1."""
    most = MAX_PROXY_SHARDS if pieces and remote_peers else remote_peers
    if proxies == "auto":
        return max(1, min(len(nics) if transport == "efa" and nics else 1, most))
    if proxies > max(1, most):
        raise ValueError(f"proxies={proxies}: more proxies than remote peers ({remote_peers}) per rank")
    return proxies


class RankEntry(NamedTuple):
    """One rank's row of the bootstrap table (`Wiring._start` all-gathers one per rank)."""

    addresses: list                 # per proxy shard: its engine's address
    regions: list                   # per proxy shard: its registered host regions
    segment: str                    # the shared segment's name (node peers map it)
    buffers: Any                    # the placement's `share()`: what node peers map of its buffers
    gpu: tuple[str, str] | None     # (host name, GPU UUID); None on a CPU
    gpu_regions: list               # per proxy shard: its registered GPU regions
    gpu_wait: str                   # the `gpu_wait` argument
    num_proxies: int                # proxy processes of the rank
    mps: bool                       # the rank's GPU contexts run under MPS


class Wiring:
    """Built by `AllToAll`; see its docstring for the arguments. Attributes the halves use:

    base: uint8 view from the lowest address any kernel touches; every offset below is from it.
    send_offset_bytes / recv_offset_bytes: this rank's buffers; stage_*: where rows to and from other
        nodes are (the same unless the placement splits by node).
    peer_send_bytes / peer_recv_bytes: `[W]` int64 offsets of node peers' buffers (-1: remote peer).
    peer_stage_recv_bytes: `[W]` int64, where each node peer receives other nodes' rows (-1: remote peer);
        relay_recv_bytes: the same for this node's ranks by local index; peer_partial_bytes: `[W]` the node
        peers' relay partial regions (the relay only, else None).
    node: the kernels' `NodeSync`.  counts: `[W, E]` int32 count matrix of the sync area (own_counts: this rank's row).
    rank_rows: `[W, W]` int32, row s = rows source s sends to each rank (per-rank dispatch rows; else None).
    row_plan: `[W * T, K]` int32, the expand's expert rows of each received row, which the reduce by source
        reads (rows reduced at the experts' rank; else None).
    flags / flags_host / flags_np: the flags area on the device, as a CPU tensor, as numpy.
    ready_words / counts_np: host views of the sync area, for ranks that wait on the host (else None).
    """

    def __init__(self, layout: Layout, group, rank: int, device, transport: str, nics, num_proxies: int,
                 buffers: str, gpu_wait: str, timeout_s: float, local_only: bool, emulated_nic: str | None = None,
                 shrink: bool = False, shrink_mask: torch.Tensor | None = None) -> None:
        self.layout, self.group, self.rank, self.device = layout, group, rank, device
        self.shrink = shrink  # shrink mode: the proxies mask the peers they time out on (runtime/shrink.py)
        self.shrink_mask = shrink_mask  # shrink mode: the `RankMask` tensor, for the kernels' own waits
        self.emulated_nic = emulated_nic or ""  # transport "emulated": its NIC settings, for the proxies
        self.transport, self.nics, self.num_proxies = transport, nics, num_proxies
        self.timeout_s, self.local_only, self._gpu_wait = timeout_s, local_only, gpu_wait
        self.proxies: list[ProxyHandle] = []
        self.peer_segments: list[SharedSegment] = []
        self.segment = self.buffers = None
        self.node_slots = None
        self.with_proxy = layout.node_size < layout.world_size
        # Read here, in the model process, and checked before any proxy starts (ValueError naming it).
        self.cpu_override = os.environ.get(topology.PROXY_CPUS_ENV) or None
        if self.cpu_override is not None:
            topology.parse_proxy_cpus(self.cpu_override)
        name, self.placement_reason = placements.choose(buffers, device, transport,
                                                        bool(layout.remote_peers(rank)))
        try:
            if name == "nic":
                self._try_nic(strict=buffers != "auto")
            else:
                self._launch(name)
            self._start()
        except BaseException:
            self.release()
            raise

    # ---- construction ---------------------------------------------------------------------------
    def _launch(self, name: str) -> None:
        """This rank's part: the segment, the placement's buffers, the proxies up to their address."""
        lay, r = self.layout, self.rank
        cls = placements.PLACEMENTS[name]
        self.segment = SharedSegment(unique_name(), lay.segment_bytes(cls.host_staged), create=True)
        self.buffers = cls(lay, r, self.device, self.segment)
        self.placement = cls.name
        self.buffers.allocate()
        fd_buffers, fds = self.buffers.proxy_buffers()
        # The proxy gives up a little before the model does, so the model reports the proxy's message
        # (which names the missing peers) rather than a bare timeout of its own. With fewer cores than
        # busy processes (CI: 2 cores) spinning starves the peers that must make progress: yield instead.
        k = self.num_proxies
        on_gpu = self.device.type == "cuda"
        ordinal = (torch.cuda.current_device() if self.device.index is None else self.device.index) if on_gpu else None
        gpu_uuid = f"GPU-{torch.cuda.get_device_properties(ordinal).uuid}" if on_gpu else None  # NVML's form
        for j in range(k):
            domains = self.nics
            if domains is not None and k > 1:
                domains = domains[j::k] or (domains[j % len(domains)],)
            spec = ProxySpec(lay, r, self.segment.name, cls.host_staged, self.transport, 0.8 * self.timeout_s,
                             parent_pid=os.getpid(), idle_yield=(os.cpu_count() or 1) < 2 * lay.node_size * (1 + k),
                             fd_buffers=fd_buffers, domains=domains, local_only=self.local_only, shard=j, shards=k,
                             cpu_override=self.cpu_override, gpu_ordinal=ordinal, gpu_uuid=gpu_uuid,
                             emulated_nic=self.emulated_nic, shrink=self.shrink)
            self.proxies.append(ProxyHandle(spec, fds))
        # Start-up, not a call: a proxy imports and opens its endpoint, slower with many ranks on few cores.
        self.proxy_address = [h.address(max(self.timeout_s, STARTUP_S)) for h in self.proxies]

    def _try_nic(self, strict: bool) -> None:
        """Launch with buffers registered with the NIC; if any rank cannot, every rank falls back to
        staged ones (collective: one exchange, whatever happened locally)."""
        reason = None
        try:
            self._launch("nic")
        except Exception as exc:  # cuMem, FD passing, FI_HMEM missing, registration refused
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            self.release()
        reasons = bootstrap.exchange(self.group, reason)
        failed = {i: m for i, m in enumerate(reasons) if m}
        if not failed:
            return
        if reason is None:
            self.release()
        first = min(failed)
        on_gpu = self.device.type == "cuda"
        what = "GPU send/recv buffers" if on_gpu else "send/recv buffers"
        why = (f"{what} cannot be registered with the NIC over {self.transport!r} "
               f"(rank {first}: {failed[first]}; {len(failed)} of {self.layout.world_size} ranks failed)")
        if strict:
            raise RuntimeError(f"buffers={'gpu' if on_gpu else 'memfd'!r}: {why}")
        log.warning("moe_a2a rank %d: %s: rows to and from other nodes are staged in pinned shared memory "
                    "reached over PCIe", self.rank, why)
        self.placement_reason = why
        self._launch("staged" if on_gpu else "host")

    def _start(self) -> None:
        lay, r, seg, dev = self.layout, self.rank, self.segment, self.device
        on_gpu, k, W = dev.type == "cuda", self.num_proxies, lay.world_size
        addresses, regions, gpu_regions = (list(t) for t in zip(*self.proxy_address))
        if on_gpu:
            seg.register_cuda()
        gpu = (socket.gethostname(), str(torch.cuda.get_device_properties(dev).uuid)) if on_gpu else None
        table: list[RankEntry] = bootstrap.exchange(self.group, RankEntry(
            addresses, regions, seg.name, self.buffers.share(), gpu, gpu_regions, self._gpu_wait, k,
            on_gpu and mps_enabled(dev)))
        bootstrap.check_same_fabric([t.addresses for t in table])  # mixed EFA nodes: every rank raises
        if any(t.num_proxies != k for t in table):  # every rank sees the same table: every rank raises
            raise ValueError(f"proxies: every rank must run the same number of proxy processes, got "
                             f"{[t.num_proxies for t in table]} (per rank)")

        # Ranks sharing one GPU without MPS are time-sliced, not concurrent: a kernel spinning on a flag would
        # hold the GPU while the peer it waits for cannot run. Such ranks wait on the host instead.
        def waits_on_host(i: int) -> bool:
            t = table[i]
            shared = t.gpu is not None and any(o.gpu == t.gpu for j, o in enumerate(table) if j != i)
            return t.gpu is not None and (t.gpu_wait == "host" or (t.gpu_wait == "auto" and shared and not t.mps))

        self.host_waits = waits_on_host(r)
        # Under MPS ranks sharing a GPU run side by side, but a waiting grid of one program per SM may hold
        # every SM while the peer's producer waits for one: such ranks spin in one single-warp kernel instead.
        self.shares_gpu = gpu is not None and any(t.gpu == gpu for j, t in enumerate(table) if j != r)
        # Shrink mode decided by the kernels' own waits (every rank on one node, kernel waits: graph-safe).
        self.device_shrink = self.shrink_mask is not None and on_gpu and not self.host_waits
        # The sync area is in device memory (end of the recv buffers) when every rank is on one node and
        # waits in kernels; else in the segments, where the host and the proxy see it too.
        self.device_sync = not self.with_proxy and not any(map(waits_on_host, range(W)))
        # Kernel waits read the epoch from the device, so a replayed CUDA graph uses the replay's epoch.
        self.epoch_dev = torch.zeros(1, dtype=torch.int64, device=dev) if on_gpu else None
        # Our proxy j talks to proxy `peer_proxy(r, p, j)` of each peer p: the one carrying us (p's proxy
        # proxy_shard(p, r) carries r, ours proxy_shard(r, p) carries p), or with the writes in pieces its own index.
        for j, h in enumerate(self.proxies):
            at = [lay.peer_proxy(r, p, j, k) for p in range(W)]
            mine = [(t.addresses[i], t.regions[i], t.segment, t.gpu_regions[i]) for t, i in zip(table, at)]
            h.finish(mine, max(self.timeout_s, STARTUP_S), not self.with_proxy)

        send, recv = self.buffers.own()
        send_at, recv_at, seg_at = {r: send}, {r: recv}, {r: seg.addr}
        stage_recv_at = {r: self.buffers.staging()[1]}
        for p in lay.node_peers(r):
            if p == r:
                continue
            other = None
            if self.buffers.needs_peer_segments or not self.device_sync:
                other = SharedSegment(table[p].segment)
                self.peer_segments.append(other)
                if on_gpu:
                    other.register_cuda()
                seg_at[p] = other.addr
            send_at[p], recv_at[p] = self.buffers.map_peer(table[p].buffers, other)
            if self.with_proxy:  # (the peers' segments are mapped then)
                stage_recv_at[p] = self.buffers.peer_staging_recv(recv_at[p], other)
        sync_at = ({p: a + lay.recv_sync_offset_bytes for p, a in recv_at.items()} if self.device_sync
                   else {p: a + lay.segment_sync_offset_bytes for p, a in seg_at.items()})
        # Kernels address everything as byte offsets >= 0 from the lowest address (a negative offset
        # means "remote peer" in the peer tables).
        spans = [(a, seg.nbytes) for a in seg_at.values()] + [(a, lay.send_bytes) for a in send_at.values()] + \
                [(a, lay.recv_bytes) for a in recv_at.values()]
        lo = min(a for a, _ in spans)
        self.base = self.view(lo, max(a + n for a, n in spans) - lo)
        self._base_addr = lo
        stage_send, stage_recv = self.buffers.staging()
        self.send_offset_bytes, self.recv_offset_bytes = send_at[r] - lo, recv_at[r] - lo
        self.stage_send_offset_bytes, self.stage_recv_offset_bytes = stage_send - lo, stage_recv - lo
        # Split by node: the route kernel reports this node's slot range; pack and reduce choose the
        # buffer of each slot by it (docs/protocol.md, 3.6). Other placements: no extra arguments.
        self.split = {"route": {}, "pack": {}, "reduce": {}}
        if self.buffers.split_by_node:
            self.node_slots = torch.zeros(2, dtype=torch.int32, device=dev)
            self.split = {
                "route": {"out_node_slots": self.node_slots, "node_experts": lay.node_experts(r)},
                "pack": {"remote_send_offset_bytes": self.stage_send_offset_bytes, "node_slots": self.node_slots},
                "reduce": {"remote_recv_offset_bytes": self.stage_recv_offset_bytes + lay.combine_recv_offset_bytes,
                           "node_slots": self.node_slots}}
        # Per-rank rows: their own node range (rows of this node's ranks), for the pack and, with rows reduced
        # at the sender, the reduce; the route slots' range above still serves a route-row combine.
        self.rank_split = {"route": {}, "pack": {}, "reduce": {}}
        if self.buffers.split_by_node and lay.rank_rows:
            first = lay.node_of(r) * lay.node_size
            self.rank_node_slots = torch.zeros(2, dtype=torch.int32, device=dev)
            self.rank_split = {
                "route": {"out_node_slots": self.rank_node_slots, "node_experts": (first, first + lay.node_size)},
                "pack": {**self.split["pack"], "node_slots": self.rank_node_slots},
                "reduce": {**self.split["reduce"], "node_slots": self.rank_node_slots}}
        tables = {name: torch.full((W,), -1, dtype=torch.int64) for name in ("send", "recv", "sync")}
        for p in send_at:
            tables["send"][p], tables["recv"][p], tables["sync"][p] = send_at[p] - lo, recv_at[p] - lo, sync_at[p] - lo
        self.peer_send_bytes = tables["send"].to(dev)
        self.peer_recv_bytes = tables["recv"].to(dev)
        # The relay (docs/protocol.md, 3.8): where each node peer receives the network's rows (its relayed rows
        # and their count rows), and its partial region (the node's fp32 partials of relayed rows).
        stage_recv = torch.full((W,), -1, dtype=torch.int64)
        for p, a in stage_recv_at.items():
            stage_recv[p] = a - lo
        first = lay.node_of(r) * lay.node_size
        self.peer_stage_recv_bytes = stage_recv.to(dev)
        self.relay_recv_bytes = stage_recv[first:first + lay.node_size].to(dev)
        self.peer_partial_bytes = torch.where(tables["send"] >= 0, tables["send"] + lay.relay_partial_offset_bytes,
                                              tables["send"]).to(dev) if lay.relay else None
        self._views(sync_at[r], tables["sync"].to(dev))
        # Every process that maps our files (node peers, our proxies) has now done so: unlink them, so that
        # nothing outlives the processes whoever kills them (torchrun, SIGKILL, a segfault).
        bootstrap.exchange(self.group, None)
        seg.unlink()
        self.buffers.unlink()

    def _views(self, sync_addr: int, peer_sync_bytes: torch.Tensor) -> None:
        """The flags, trace and sync-area views, and the kernels' `NodeSync`."""
        lay, r, seg, dev = self.layout, self.rank, self.segment, self.device
        on_gpu, W, lo = dev.type == "cuda", lay.world_size, self._base_addr
        nflags = flag_word(Flag.NUM_FLAGS)
        self.flags = self.view(seg.addr + lay.flags_offset_bytes, nflags * 8).view(torch.int64)
        self.flags_host = seg.tensor(lay.flags_offset_bytes, nflags, torch.int64)
        # What the host reads before every call, as one numpy gather (a torch index costs ~5 µs each).
        self.flags_np = seg.numpy(lay.flags_offset_bytes, nflags, "int64")
        self.segment_flags = Flags(seg, lay)  # release stores, for words kernels and proxies read
        self.alarm_words = [flag_word(f) for f in (Flag.ERROR, Flag.BAD_COUNTS)
                            + tuple(h.status for h in HALF_FLAGS.values())]
        ntrace = lay.model_trace_words
        self.model_trace = self.view(seg.addr + lay.model_trace_offset_bytes, ntrace * 8).view(torch.int64)
        self.model_trace_host = seg.numpy(lay.model_trace_offset_bytes, ntrace, "int64")
        # Rows of same-node sources are written by their kernels, rows of remote sources by the proxy.
        rows = self.view(sync_addr + lay.node_counts_offset_bytes, lay.routing_bytes).view(
            torch.int32).view(W, lay.count_row_ints)
        self.counts = rows[:, :lay.num_experts]
        self.own_counts = self.counts[r]  # this rank's count row, which its routing kernel writes
        # Per-rank dispatch rows: each count row also says how many rows its source sends to each rank.
        self.rank_rows = rows[:, lay.num_experts:] if lay.rank_rows else None
        # Rows reduced at the experts' rank: the expand's expert rows of each received row, for the reduce.
        self.row_plan = (torch.empty(lay.max_recv_rank_rows, lay.experts_per_token, dtype=torch.int32, device=dev)
                         if lay.combine_rank_rows else None)
        self.bad_index = self.flags[flag_word(Flag.BAD_INDEX): flag_word(Flag.BAD_INDEX) + 1]
        self.bad_bound_m = self.flags[flag_word(Flag.BAD_BOUND_M): flag_word(Flag.BAD_BOUND_M) + 1]
        self.route_ready = self.flags[flag_word(Flag.ROUTE_READY): flag_word(Flag.ROUTE_READY) + 1]
        # The writes the kernels plan for the proxy (triton_kernels/write_plan.py), read by the proxy.
        self.write_tables = self.view(seg.addr + lay.write_table_offset_bytes, lay.write_table_bytes).view(
            torch.int64).view(int(WriteTable.NUM_TABLES), lay.wire_pieces, W, WRITE_TABLE_COLUMNS)
        self.peer_mask_np = seg.numpy(lay.peer_mask_offset_bytes, W, "int64")  # shrink mode's masked peers
        self.node = NodeSync(
            epoch=self.epoch_dev if on_gpu else torch.zeros(1, dtype=torch.int64),
            failed=torch.zeros(1, dtype=torch.int64, device=dev),
            counter=torch.zeros(2, dtype=torch.int32, device=dev),
            flags=self.flags, peer_sync_bytes=peer_sync_bytes, sync_bytes=sync_addr - lo,
            rank=r, node_first=lay.node_of(r) * lay.node_size, node_size=lay.node_size,
            dispatch_ready_bytes=lay.dispatch_ready_offset_bytes, combine_ready_bytes=lay.combine_ready_offset_bytes,
            counts_bytes=lay.node_counts_offset_bytes, num_experts=lay.count_row_ints, timeout_s=self.timeout_s,
            aborted=torch.zeros(1, dtype=torch.int64, device=dev), combine_aborted_bytes=lay.combine_aborted_offset_bytes,
            # Ranks sharing a GPU wait on the host; their kernels must not spin at all.
            with_proxy=self.with_proxy, kernel_waits=not self.host_waits,
            # Words in pinned host memory: one small kernel polls them, not every program of a data kernel.
            # Shrink mode with kernel waits: that kernel also masks late peers (runtime/shrink.py).
            wait_apart=on_gpu and not self.host_waits and (not self.device_sync or self.placement == "host"
                                                           or self.shares_gpu or self.device_shrink),
            rank_mask=self.shrink_mask if self.device_shrink else None)
        # Host waits: the host polls the same words before it launches a kernel, whose own wait then
        # passes at its first poll (the interpreter runs a kernel to the end before returning).
        self.ready_words = self.counts_np = None
        if not on_gpu or self.host_waits:
            self.ready_words = {
                half: torch.frombuffer((ctypes.c_int64 * W).from_address(sync_addr + off), dtype=torch.int64).numpy()
                for half, off in (("dispatch", lay.dispatch_ready_offset_bytes),
                                  ("combine", lay.combine_ready_offset_bytes))}
            # A row of -1 is a source that aborted the call.
            self.counts_np = torch.frombuffer(
                (ctypes.c_int32 * (W * lay.count_row_ints)).from_address(sync_addr + lay.node_counts_offset_bytes),
                dtype=torch.int32).numpy().reshape(W, lay.count_row_ints)[:, :lay.num_experts]

    def view(self, addr: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor over [addr, addr+nbytes) on this rank's device (memory is not touched)."""
        if self.device.type == "cuda":
            return device_view(addr, nbytes, self.device)
        base = getattr(self, "base", None)
        if base is not None and self._base_addr <= addr and addr + nbytes <= self._base_addr + base.numel():
            # One storage for every CPU view: the interpreter copies kernel arguments per storage, keyed by
            # address, and two storages starting at one address (the segment and its flags) collide.
            return base[addr - self._base_addr: addr - self._base_addr + nbytes]
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)

    # ---- teardown ----------------------------------------------------------------------------------
    def release(self) -> None:
        """Stop the proxies, unmap peers, free buffers and the segment (whatever exists so far). Every step
        runs even when an earlier one raises (the first error is raised at the end)."""
        errors: list[BaseException] = []

        def step(fn, *args) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - collected, the first one re-raised below
                errors.append(exc)

        proxies, self.proxies = self.proxies, []
        seg = self.segment
        if seg is not None and seg._mmap is not None and proxies:
            Flags(seg, self.layout)[Flag.SHUTDOWN] = 1  # every proxy starts exiting now, not one by one
        for proxy in proxies:
            step(proxy.stop, seg, self.layout)
        buffers, self.buffers = self.buffers, None
        peers, self.peer_segments = self.peer_segments, []
        if buffers is not None:
            step(buffers.release)
        for other in peers:
            step(other.close)
        if seg is not None:
            step(seg.close)  # idempotent; the object stays for error messages after close
        if errors:
            raise errors[0]
