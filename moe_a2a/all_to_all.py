"""`AllToAll`: buffers, Triton kernels and the proxy process wired together.

Data flows one way: model -> kernels -> (same node: peers' mapped memory; other nodes: proxy -> wire
-> proxy) -> kernels -> model. This module owns the buffers and the order of operations of one call;
the kernels know nothing of the network and the proxy knows nothing of tokens.

Same-node peers never go through the proxy: dispatch_recv *pulls* their tokens from their send
buffers, combine_send *pushes* expert outputs into their recv buffers (both mapped here), and the
kernels synchronise through epoch words they write into each other's sync areas. The proxy carries
only what crosses nodes, and is idle when every rank is on one node. docs/protocol.md has the steps.
"""
from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import torch

from . import fingerprint
from .config import A2AConfig, Layout
from .protocol import host_atomics
from .protocol.segment import Flags, ShardWords, read_error, write_error
from .protocol.words import (ERROR_FAILED, ERROR_TIMEOUT, HALF_FLAGS, MAX_PROXY_SHARDS, MODEL_TRACE_EVENTS, TRACE_EVENTS,
                             Flag, ShardWord, decode_abort, decode_bad_index, decode_capacity, decode_wait_status,
                             flag_word)
from .proxy import bootstrap, topology
from .proxy import libfabric as lf
from .proxy.engine import auto_provider
from .proxy.memory import (SHAREABLE_BUFFERS, DeviceBuffer, SharedSegment, check_fits_in_memory, close_ipc_handle,
                           device_view, fd_from_process, open_ipc_handle, unique_name)
from .proxy.handle import ProxyHandle, ProxySpec
from .triton_kernels import combine as combine_kernels
from .triton_kernels import dispatch as dispatch_kernels
from .triton_kernels import routing, sync
from .triton_kernels.node_sync import NodeSync

log = logging.getLogger("moe_a2a")

_IDLE, _DISPATCH_SENT, _DISPATCH_DONE, _COMBINE_SENT = range(4)
_STATE_NAMES = ("idle (next: dispatch send)", "dispatch sent (next: dispatch recv)",
                "dispatch received (next: combine send)", "combine sent (next: combine recv)")


# How often a rank looks at its own proxy process: a dead proxy is reported within this (and a kernel
# waiting for one of its flags stops at once, through the ERROR flag). A sleeping thread costs the
# model's launches nothing measurable; a busy-polling one cost 5 ms per launch (GIL).
PROXY_WATCH_S = 0.25


class CallAborted(RuntimeError):
    """A call was aborted on every rank because one rank's input was rejected (that rank raised a
    ValueError). The outputs of that call are void; the instance stays usable and the next call
    proceeds normally on every rank."""


def _watch_proxy(ref) -> None:
    """Daemon thread: raise the ERROR flag, with the reason, when one of this rank's proxy processes dies."""
    while True:
        time.sleep(PROXY_WATCH_S)
        a2a = ref()
        if a2a is None:
            return
        with a2a._watch_lock:  # close() takes it before unmapping the segment
            if a2a._closed or not a2a._proxies:
                return
            flags = a2a._flags_np
            dead = a2a._dead_proxy()
            if dead is not None and not flags[flag_word(Flag.SHUTDOWN)]:
                if not flags[flag_word(Flag.ERROR)]:
                    write_error(a2a.segment, a2a.layout, ERROR_FAILED, f"rank {a2a.rank}: its {dead}")
                return
        del a2a


def _check(name: str, t: Any, shape: tuple | None, dtype, device: torch.device, last_contig: bool = True) -> None:
    """Tensor contract at the API boundary: a ValueError naming the argument, expected vs actual."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if last_contig and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got strides {t.stride()}")


class AllToAll:
    """Expert-parallel dispatch and combine over this rank's group (docs/design.md, API).

    Args:
        cfg: the sizes.
        group: torch.distributed process group used only for bootstrap (default WORLD).
        node_group: ranks that share memory with this one: "auto"/None (same hostname), an int
            (node size; ranks `[k*n, (k+1)*n)` form node k) or a process group (its size).
        transport: "auto" (efa if present, else shm on one host, tcp across hosts), "efa", "shm",
            "tcp" or "verbs" (libfabric's verbs;ofi_rxm: ConnectX; untested, no RDMA device here).
        device: where the model's tensors live (default: current CUDA device, else CPU).
        timeout_s: every wait ends in a TimeoutError naming what was missing after this long.
        gpu_wait: on a GPU, how the receive halves wait for the proxy: "kernel" (a spinning kernel on
            the stream: asynchronous, CUDA-graph safe), "host" (the CPU polls, then launches: for
            ranks that share one GPU, where a spinning kernel would block its time-sliced peers),
            or "auto" (host when another rank of this node uses the same GPU, else kernel).
        buffers: where the send/recv buffers live. "staged": rows between ranks of this node stay in
            their buffers (GPU memory, CUDA IPC; on a CPU a shared file of their own), and only rows to
            and from other nodes are staged in pinned shared host memory that the kernels reach over
            PCIe and the proxy's NIC reads and writes. "host": all rows host-staged, this node's too.
            "gpu": GPU memory — CUDA IPC when every peer is on this node, else cuMem allocations
            exported as POSIX FDs that the proxy maps and registers with the NIC (FI_HMEM_CUDA: EFA)
            and same-node peers map; raises if that is impossible. "auto" (default): with remote peers
            over efa or verbs, "gpu" where it works, else "staged" with one log line saying why; over
            tcp and shm "staged" (they stage through host memory; "gpu" tries anyway); on a CPU "host".
            "memfd": host memory of its own (memfd) shared and registered exactly as "gpu" buffers
            with remote peers are: that path without a GPU (CI runs it).
        nics: the NICs (libfabric domains, `moe_a2a.proxy.libfabric.list_domains(provider)`) this
            rank's proxy drives; peers are sharded over them. "auto": on EFA this rank's equal share of
            the node's NICs (`proxy.topology.nics_for_rank`), elsewhere the provider's first domain.
            A list of names: exactly those.
        proxies: how many proxy processes this rank runs, each posting the writes of its share of the
            remote peers (peer p goes to proxy p % k) in parallel: a positive int, at most the number of
            remote peers (and `config.MAX_PROXY_SHARDS`), or "auto": one per NIC on EFA
            (`len(nics)`, capped by the number of remote peers), else 1. Every rank must use the same k
            (checked at bootstrap: ValueError otherwise).

    Experts are contiguous per rank: rank r hosts experts [r*L, (r+1)*L), L = E / world_size.
    Not thread-safe; one call in flight per instance; every dispatch is followed by one combine.
    """

    def __init__(self, cfg: A2AConfig, group=None, node_group="auto", transport: str = "auto",
                 device=None, timeout_s: float = 30.0, gpu_wait: str = "auto", buffers: str = "auto",
                 nics="auto", proxies="auto") -> None:
        import torch.distributed as dist

        if not isinstance(cfg, A2AConfig):
            raise ValueError(f"cfg: expected A2AConfig, got {type(cfg).__name__}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        if transport not in ("auto", "efa", "shm", "tcp", "verbs"):
            raise ValueError(f"transport must be 'auto', 'efa', 'shm', 'tcp' or 'verbs', got {transport!r}")
        if gpu_wait not in ("auto", "kernel", "host"):
            raise ValueError(f"gpu_wait must be 'auto', 'kernel' or 'host', got {gpu_wait!r}")
        if buffers not in ("auto", "staged", "host", "gpu", "memfd"):
            raise ValueError(f"buffers must be 'auto', 'staged', 'host', 'gpu' or 'memfd', got {buffers!r}")
        if nics != "auto" and (isinstance(nics, str) or not isinstance(nics, (list, tuple)) or not nics
                               or not all(isinstance(n, str) and n for n in nics)):
            raise ValueError(f"nics must be 'auto' or a non-empty list of domain names, got {nics!r}")
        if proxies != "auto" and (isinstance(proxies, bool) or not isinstance(proxies, int) or proxies < 1
                                  or proxies > MAX_PROXY_SHARDS):
            raise ValueError(f"proxies must be 'auto' or an int in [1, {MAX_PROXY_SHARDS}], got {proxies!r}")
        self._gpu_wait = gpu_wait
        if transport != "auto":  # before anything collective: every rank refuses alike
            name, available = lf.PROVIDER_NAMES[transport], lf.list_providers()
            if name not in available:
                raise ValueError(f"transport {transport!r} needs libfabric's {name!r} provider, which is not "
                                 f"available here (available: {available}; efa and verbs need their "
                                 f"devices, MOE_A2A_LIBFABRIC may point at another libfabric.so)")
        if group is None:
            if not dist.is_initialized():
                raise ValueError("AllToAll needs torch.distributed initialised (or pass group=)")
            group = dist.group.WORLD
        self.cfg, self.group, self.timeout_s = cfg, group, float(timeout_s)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        if buffers == "gpu" and self.device.type != "cuda":
            raise ValueError(f"buffers='gpu' needs a CUDA device, got device {self.device}")
        if buffers == "memfd" and self.device.type != "cpu":
            raise ValueError(f"buffers='memfd' is for CPU tensors, got device {self.device}")
        # With the host names, every rank's configuration: a difference raises ValueError on every rank, here.
        hosts = fingerprint.exchange(self.group, cfg, node_group=node_group, transport=transport, buffers=buffers,
                                     proxies=proxies, device=self.device)
        # Every rank on this host: the proxies listen on loopback only (docs/threat-model.md), unless the
        # caller named the NICs to use (then those, as asked).
        self._local_only = len(set(hosts)) == 1 and nics == "auto"
        node_size = self._node_size(node_group, hosts)
        self.layout: Layout = cfg.layout(self.world_size, node_size)
        check_fits_in_memory(self.layout, ranks=1, host_staged=self.device.type != "cuda")
        lay, r = self.layout, self.rank
        self.transport = transport
        if transport == "auto":
            # shm reaches only this host: between hosts without EFA, tcp is the provider that works.
            self.transport = auto_provider()
            if self.transport == "shm" and len(set(hosts)) > 1:
                self.transport = "tcp"
        self.nics = self._choose_nics(nics)
        # Proxy shards: the same on every rank when the arguments are (every rank has W - node_size
        # remote peers); _start checks the bootstrap table anyway.
        remote = len(lay.remote_peers(r))
        if proxies == "auto":
            proxies = max(1, min(len(self.nics) if self.transport == "efa" and self.nics else 1, remote))
        elif proxies > max(1, remote):
            raise ValueError(f"proxies={proxies}: more proxies than remote peers ({remote}) per rank")
        self.num_proxies = proxies
        self._proxies: list[ProxyHandle] = []
        self._error: BaseException | None = None
        self._state, self.epoch = _IDLE, 0
        self._abort_seen = 0  # the last epoch whose abort this rank has reported (or made)
        self._abort_scratch = None
        self._closed = True
        self._watch_lock = threading.Lock()
        self._peer_segments: list[SharedSegment] = []
        self.host_waits = False
        self._tracing, self._clock_offset_ns = False, None
        self._ipc_ptrs: list[int] = []
        self._fd_mem: list = []  # FD-shared send/recv ("nic"): own two, then same-node peers' imports
        self._send_buf = self._recv_buf = None
        self._node_seg = None  # "staged" on a CPU: this node's send/recv buffers in a file of their own
        self.node_slots = None  # "staged": [first, end) of the send slots of this node's experts
        self.proxy = None
        self.placement_reason: str | None = None  # why GPU buffers were given up for host-staged ones

        # Placement of the send/recv buffers (the same on every rank: it depends only on the
        # arguments, the device type and the layout). "ipc": GPU memory, every peer on this node, no
        # token on the wire. "nic": GPU memory registered with the NIC, tried and, unless forced,
        # given up for "staged" when any rank cannot (tcp has no FI_HMEM; shm as built on our GPU host
        # fails registration with -FI_ENOSYS). "staged": this node's rows in "ipc" buffers, the other
        # nodes' staged in the shared segment. "host": all buffers in the shared segment.
        on_gpu = self.device.type == "cuda"
        if buffers == "memfd":
            self.placement = "nic"
        elif buffers in ("host", "staged"):
            self.placement = buffers
        elif not on_gpu:
            self.placement = "host"
        elif not lay.remote_peers(r):
            self.placement = "ipc"
        elif buffers == "gpu" or self.transport in ("efa", "verbs"):
            self.placement = "nic"
        else:  # the software providers copy through host memory anyway
            self.placement = "staged"
            self.placement_reason = (f"transport {self.transport!r} stages GPU data through host memory "
                                     f"(buffers='gpu' tries GPU memory anyway)")
        self._closed = False
        try:
            if self.placement == "nic":
                self._try_nic(strict=buffers != "auto")
            else:
                self._launch()
            self._start(on_gpu)
        except BaseException:
            self.close()
            raise
        if self.with_proxy:
            threading.Thread(target=_watch_proxy, args=(weakref.ref(self),), daemon=True,
                             name=f"moe_a2a-proxy-watch-{self.rank}").start()

    @property
    def node_local(self) -> bool:
        """True when every rank is on this node: the proxy takes no part in the calls."""
        return not self.with_proxy

    @property
    def host_staged(self) -> bool:
        """True when rows to and from other nodes go through send/recv buffers in the shared segment."""
        return self.placement in ("host", "staged")

    # ---- construction ---------------------------------------------------------------------------
    def _node_size(self, node_group, hosts: list[str]) -> int:
        import torch.distributed as dist

        W = self.world_size
        if isinstance(node_group, int) and not isinstance(node_group, bool):
            n = node_group
        elif node_group is None or node_group == "auto":
            n = hosts.count(hosts[0])
            if any(hosts[i] != hosts[i // n * n] for i in range(W)) or W % n:
                raise ValueError(f"node_group='auto': ranks must be grouped contiguously by host in equal "
                                 f"numbers, got hosts {hosts}")
        else:
            n = dist.get_world_size(node_group)
        if n < 1 or W % n:
            raise ValueError(f"node_group: node size {n} must divide world size {W}")
        return n

    def _choose_nics(self, nics) -> tuple[str, ...] | None:
        """The domains this rank's proxy opens (None: the provider's first)."""
        if nics != "auto":
            return tuple(nics)
        if self.transport != "efa":
            return None
        lay = self.layout
        return tuple(topology.nics_for_rank(lf.list_domains("efa"), self.rank % lay.node_size, lay.node_size))

    def _launch(self) -> None:
        """This rank's part for `self.placement`: the segment, GPU buffers, the proxy up to its address."""
        lay, r = self.layout, self.rank
        self.segment = SharedSegment(unique_name(), lay.segment_bytes(self.host_staged), create=True)
        fd_buffers, fds = None, ()
        if self.placement == "ipc" or (self.placement == "staged" and self.device.type == "cuda"):
            self._send_buf = DeviceBuffer(lay.send_bytes, self.device)
            self._recv_buf = DeviceBuffer(lay.recv_bytes, self.device)
        elif self.placement == "staged":  # a CPU: the same addressing, in a file the node peers map
            self._node_seg = SharedSegment(unique_name(), lay.send_bytes + lay.recv_bytes, create=True)
        elif self.placement == "nic":
            kind = self.device.type if self.device.type == "cuda" else "host"
            ordinal = 0 if kind == "host" else (
                self.device.index if self.device.index is not None else torch.cuda.current_device())
            self._fd_mem = [SHAREABLE_BUFFERS[kind](n, ordinal) for n in (lay.send_bytes, lay.recv_bytes)]
            fd_buffers = (kind, ordinal, self._fd_mem[0].size, self._fd_mem[1].size)
            fds = (self._fd_mem[0].fd, self._fd_mem[1].fd)
        # The proxy gives up a little before the model does, so the model reports the proxy's
        # message (which names the missing peers) rather than a bare timeout of its own.
        # With fewer cores than busy processes (CI: 2 cores, 2 processes per rank) spinning
        # starves the peers that must make progress: yield instead (measured 16 ms -> 0.3 ms).
        # k proxies: each opens its share of the NICs (one each when k = len(nics)).
        k = self.num_proxies
        for j in range(k):
            domains = self.nics
            if domains is not None and k > 1:
                domains = domains[j::k] or (domains[j % len(domains)],)
            spec = ProxySpec(lay, r, self.segment.name, self.host_staged, self.transport, 0.8 * self.timeout_s,
                             parent_pid=os.getpid(), idle_yield=(os.cpu_count() or 1) < 2 * lay.node_size * (1 + k),
                             fd_buffers=fd_buffers, domains=domains, local_only=self._local_only, shard=j, shards=k)
            self._proxies.append(ProxyHandle(spec, fds))
        self.proxy = self._proxies[0]  # the primary: it raises the flags the kernels read
        self._proxy_address = [h.address(self.timeout_s) for h in self._proxies]

    def _try_nic(self, strict: bool) -> None:
        """Launch with GPU buffers registered with the NIC; if any rank cannot, every rank falls back
        to host-staged buffers (collective: one exchange, whatever happened locally)."""
        reason = None
        try:
            self._launch()
        except Exception as exc:  # cuMem, FD passing, FI_HMEM missing, registration refused
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            self._release()
        reasons = bootstrap.exchange(self.group, reason)
        failed = {i: m for i, m in enumerate(reasons) if m}
        if not failed:
            return
        if reason is None:
            self._release()
        first = min(failed)
        what = "GPU send/recv buffers" if self.device.type == "cuda" else "send/recv buffers"
        why = (f"{what} cannot be registered with the NIC over {self.transport!r} "
               f"(rank {first}: {failed[first]}; {len(failed)} of {self.world_size} ranks failed)")
        if strict:
            raise RuntimeError(f"buffers={'gpu' if self.device.type == 'cuda' else 'memfd'!r}: {why}")
        log.warning("moe_a2a rank %d: %s: rows to and from other nodes are staged in pinned shared memory "
                    "reached over PCIe", self.rank, why)
        self.placement = "staged" if self.device.type == "cuda" else "host"
        self.placement_reason = why
        self._launch()

    def _start(self, on_gpu: bool) -> None:
        lay, r, seg = self.layout, self.rank, self.segment
        k = self.num_proxies
        addresses, regions, gpu_regions = (list(t) for t in zip(*self._proxy_address))
        if on_gpu:
            seg.register_cuda()
        if self._send_buf is not None:  # "ipc", "staged" on a GPU
            share = (self._send_buf.ipc_handle(), self._recv_buf.ipc_handle())
        elif self._node_seg is not None:
            share = self._node_seg.name
        elif self.placement == "nic":
            share = (os.getpid(), self._fd_mem[0].fd, self._fd_mem[1].fd, self._fd_mem[0].size,
                     self._fd_mem[1].size)
        else:
            share = None
        gpu = (socket.gethostname(), str(torch.cuda.get_device_properties(self.device).uuid)) if on_gpu else None
        table = bootstrap.exchange(self.group, (addresses, regions, seg.name, share, gpu, gpu_regions,
                                                self._gpu_wait, k))
        if any(t[7] != k for t in table):  # every rank sees the same table: every rank raises
            raise ValueError(f"proxies: every rank must run the same number of proxy processes, got "
                             f"{[t[7] for t in table]} (per rank)")

        # Ranks sharing one GPU (several processes on one device) are time-sliced, not concurrent: a
        # kernel spinning on a flag would hold the GPU while the peer it waits for cannot run
        # (measured: 9 ms per phase with 4 ranks on one H200). Such ranks wait on the host instead.
        def waits_on_host(i: int) -> bool:
            gpu_i, wait_i = table[i][4], table[i][6]
            shared = gpu_i is not None and any(t[4] == gpu_i for j, t in enumerate(table) if j != i)
            return gpu_i is not None and (wait_i == "host" or (wait_i == "auto" and shared))

        self.host_waits = waits_on_host(r)
        # Every rank decides alike (from the table). Same-node peers always synchronise through mapped
        # memory, in the kernels (triton_kernels/node_sync.py, docs/protocol.md); the proxy only ever
        # carries what goes to or comes from other nodes, and takes no part without remote peers. The
        # sync area is at the end of the recv buffers (device memory: fastest) when every rank is on
        # one node and waits in kernels; else in the segments, where the host and the proxy see it too.
        W = lay.world_size
        self.with_proxy = lay.node_size < W
        self.device_sync = not self.with_proxy and not any(map(waits_on_host, range(W)))
        # Kernel-side waits and signals read the epoch from the device, so a captured CUDA graph
        # publishes and awaits the epoch of each replay, not the one seen at capture.
        self.epoch_dev = torch.zeros(1, dtype=torch.int64, device=self.device) if on_gpu else None
        # Our proxy p % k carries peer p, and p's proxy r % k carries us: every one of our proxies gets
        # entry r % k of each peer (its address and region descriptors), and uses only its share.
        mine = [(t[0][r % k], t[1][r % k], t[2], t[5][r % k]) for t in table]
        for h in self._proxies:
            h.finish(mine, self.timeout_s, not self.with_proxy)

        # Addresses of every buffer this rank's kernels touch: own and same-node peers' send/recv,
        # and the sync areas.
        if self.placement == "host":
            send_at = {r: seg.addr + lay.send_offset_bytes}
            recv_at = {r: seg.addr + lay.recv_offset_bytes}
        elif self._send_buf is not None:
            send_at, recv_at = {r: self._send_buf.addr}, {r: self._recv_buf.addr}
        elif self._node_seg is not None:
            send_at = {r: self._node_seg.addr}
            recv_at = {r: self._node_seg.addr + lay.send_bytes}
        else:
            send_at, recv_at = {r: self._fd_mem[0].addr}, {r: self._fd_mem[1].addr}
        seg_at = {r: seg.addr}
        for p in lay.node_peers(r):
            if p == r:
                continue
            if self.placement == "host" or not self.device_sync:
                other = SharedSegment(table[p][2])
                self._peer_segments.append(other)
                if on_gpu:
                    other.register_cuda()
                seg_at[p] = other.addr
            if self.placement == "host":
                send_at[p] = seg_at[p] + lay.send_offset_bytes
                recv_at[p] = seg_at[p] + lay.recv_offset_bytes
            elif self._node_seg is not None:
                other = SharedSegment(table[p][3])
                self._peer_segments.append(other)
                send_at[p], recv_at[p] = other.addr, other.addr + lay.send_bytes
            elif self.placement == "nic":
                # Same-node peers' buffers: their FDs pulled with pidfd_getfd, mapped here.
                pid, send_fd, recv_fd, send_size, recv_size = table[p][3]
                own = self._fd_mem[0]
                for fd, size, at in ((send_fd, send_size, send_at), (recv_fd, recv_size, recv_at)):
                    mem = type(own)(size, own.ordinal, fd=fd_from_process(pid, fd))
                    self._fd_mem.append(mem)
                    at[p] = mem.addr
            else:
                send_at[p], _ = open_ipc_handle(table[p][3][0], lay.send_bytes, self.device)
                recv_at[p], _ = open_ipc_handle(table[p][3][1], lay.recv_bytes, self.device)
                self._ipc_ptrs += [send_at[p], recv_at[p]]
        sync_at = ({p: a + lay.recv_sync_offset_bytes for p, a in recv_at.items()} if self.device_sync
                   else {p: a + lay.segment_sync_offset_bytes for p, a in seg_at.items()})
        # The kernels address all of them as byte offsets from one base at the lowest address, so
        # every offset is >= 0 (a negative offset means "remote peer" in the peer tables).
        spans = [(a, seg.nbytes) for a in seg_at.values()] + [(a, lay.send_bytes) for a in send_at.values()] + \
                [(a, lay.recv_bytes) for a in recv_at.values()]
        if self.placement == "staged":
            # Rows to and from other nodes: in the segment, at the offsets "host" uses (the proxy's view).
            stage_send, stage_recv = seg.addr + lay.send_offset_bytes, seg.addr + lay.recv_offset_bytes
            self.node_slots = torch.zeros(2, dtype=torch.int32, device=self.device)
        else:
            stage_send, stage_recv = send_at[r], recv_at[r]
        lo = min(a for a, _ in spans)
        hi = max(a + n for a, n in spans)
        self.base = self._view(lo, hi - lo)
        self._base_addr = lo
        self.send_offset_bytes, self.recv_offset_bytes = send_at[r] - lo, recv_at[r] - lo
        self.stage_send_offset_bytes, self.stage_recv_offset_bytes = stage_send - lo, stage_recv - lo
        # "staged": the route kernel reports this node's slot range; pack and reduce choose the buffer of
        # each slot by it (docs/protocol.md, 3.6). Other placements: one buffer, no extra arguments.
        self._split = {"route": {}, "pack": {}, "reduce": {}}
        if self.node_slots is not None:
            self._split = {
                "route": {"out_node_slots": self.node_slots, "node_experts": lay.node_experts(r)},
                "pack": {"remote_send_offset_bytes": self.stage_send_offset_bytes, "node_slots": self.node_slots},
                "reduce": {"remote_recv_offset_bytes": self.stage_recv_offset_bytes + lay.combine_recv_offset_bytes,
                           "node_slots": self.node_slots}}
        tables = {name: torch.full((W,), -1, dtype=torch.int64) for name in ("send", "recv", "sync")}
        for p in send_at:
            tables["send"][p], tables["recv"][p], tables["sync"][p] = send_at[p] - lo, recv_at[p] - lo, sync_at[p] - lo
        self.peer_send_bytes = tables["send"].to(self.device)
        self.peer_recv_bytes = tables["recv"].to(self.device)

        nflags = flag_word(Flag.NUM_FLAGS)
        self.flags = self._view(seg.addr + lay.flags_offset_bytes, nflags * 8).view(torch.int64)
        self.flags_host = seg.tensor(lay.flags_offset_bytes, nflags, torch.int64)
        # What `_ready` looks at before every call, as one numpy gather (a torch index costs ~5 µs each).
        self._flags_np = seg.numpy(lay.flags_offset_bytes, nflags, "int64")
        self._alarm_words = [flag_word(f) for f in (Flag.ERROR, Flag.CAPACITY_EXCEEDED)
                             + tuple(h.status for h in HALF_FLAGS.values())]
        self._next_proxy_poll = 0.0
        ntrace = lay.model_trace_words
        self._model_trace = self._view(seg.addr + lay.model_trace_offset_bytes, ntrace * 8).view(torch.int64)
        self._model_trace_host = seg.numpy(lay.model_trace_offset_bytes, ntrace, "int64")
        # The routing matrix of the sync area: rows of same-node sources written by their kernels,
        # rows of remote sources by the proxy (then it is the segment's routing area).
        self.counts = self._view(sync_at[r] + lay.node_counts_offset_bytes, lay.routing_bytes).view(
            torch.int32).view(W, lay.num_experts)
        # Out-of-range expert indices, reported by the routing kernel (no host sync on a GPU).
        self._bad_index = self.flags[flag_word(Flag.BAD_INDEX): flag_word(Flag.BAD_INDEX) + 1]
        self._route_ready = self.flags[flag_word(Flag.ROUTE_READY): flag_word(Flag.ROUTE_READY) + 1]
        first = lay.node_of(r) * lay.node_size
        self._node = NodeSync(
            epoch=self.epoch_dev if on_gpu else torch.zeros(1, dtype=torch.int64),
            failed=torch.zeros(1, dtype=torch.int64, device=self.device),
            counter=torch.zeros(2, dtype=torch.int32, device=self.device),
            flags=self.flags, peer_sync_bytes=tables["sync"].to(self.device), sync_bytes=sync_at[r] - lo,
            rank=r, node_first=first, node_size=lay.node_size,
            dispatch_ready_bytes=lay.dispatch_ready_offset_bytes, combine_ready_bytes=lay.combine_ready_offset_bytes,
            counts_bytes=lay.node_counts_offset_bytes, num_experts=lay.num_experts, timeout_s=self.timeout_s,
            # Ranks sharing a GPU wait on the host; their kernels must not spin at all, not even for a
            # poll or two: the GPU time-slices between their contexts.
            with_proxy=self.with_proxy, kernel_waits=not self.host_waits,
            # Words in pinned host memory: one small kernel polls them, not every program of a data kernel.
            wait_apart=on_gpu and not self.host_waits and (not self.device_sync or self.placement == "host"))
        # Host waits (CPU, or ranks sharing a GPU): the host polls the same words before it launches a
        # kernel, whose own wait then passes at its first poll (the interpreter runs a kernel to the
        # end before returning, so a kernel cannot wait for a peer that is still being launched).
        self._ready_words = None
        if not on_gpu or self.host_waits:
            self._ready_words = {
                half: torch.frombuffer((ctypes.c_int64 * W).from_address(sync_at[r] + off), dtype=torch.int64).numpy()
                for half, off in (("dispatch", lay.dispatch_ready_offset_bytes),
                                  ("combine", lay.combine_ready_offset_bytes))}
            # The count rows, as the host sees them: a row of -1 is a source that aborted the call.
            self._counts_np = torch.frombuffer(
                (ctypes.c_int32 * (W * lay.num_experts)).from_address(sync_at[r] + lay.node_counts_offset_bytes),
                dtype=torch.int32).numpy().reshape(W, lay.num_experts)
        self.route_slot = torch.full((self.cfg.max_num_tokens, self.cfg.experts_per_token), -1,
                                     dtype=torch.int32, device=self.device)

    def _view(self, addr: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor over [addr, addr+nbytes) on this rank's device (memory is not touched)."""
        if self.device.type == "cuda":
            return device_view(addr, nbytes, self.device)
        base = getattr(self, "base", None)
        if base is not None and self._base_addr <= addr and addr + nbytes <= self._base_addr + base.numel():
            # One storage for every CPU view: the interpreter copies kernel arguments per storage, keyed by
            # address, and two storages starting at one address (the segment and its flags) collide.
            return base[addr - self._base_addr: addr - self._base_addr + nbytes]
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)

    # ---- public API ---------------------------------------------------------------------------
    def empty_dispatch_outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(out_expert_num_tokens int32[L], out_expert_x [max_rows, H] in_dtype,
        out_expert_x_scale [max_rows, num_scales] float32 | None)` on this rank's device, sized for
        the worst case (`Layout.max_dispatch_rows`)."""
        cfg, lay = self.cfg, self.layout
        rows = lay.max_dispatch_rows
        num = torch.zeros(lay.num_local_experts, dtype=torch.int32, device=self.device)
        x = torch.zeros(rows, cfg.hidden_dim, dtype=cfg.in_dtype, device=self.device)
        xs = (torch.zeros(rows, cfg.num_scales, dtype=torch.float32, device=self.device)
              if cfg.has_scales else None)
        return num, x, xs

    def dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, x, x_scale, indices,
                 bound_m=None, do_send: bool = True, do_recv: bool = True) -> None:
        """Send every token to the ranks hosting its experts; receive this rank's tokens expert-major.

        Args:
            out_expert_num_tokens: `[L]` int32, written by the receive half: routes per local expert.
            out_expert_x: `[>= max_dispatch_rows, H]` in_dtype; expert l's rows start at
                `sum_{j<l} round_up(n_j, expert_padding)`, ordered by (source rank, token, k);
                padding rows untouched. Valid after the receive half.
            out_expert_x_scale: `[>= max_dispatch_rows, num_scales]` float32, or None without scales.
            x: `[T, H]` in_dtype, T <= max_num_tokens.  x_scale: `[T, num_scales]` float32 or None.
            indices: `[T, K]` int32/int64 expert ids, `-1` = not routed.
            bound_m: optional 1-element int32 tensor on the device: live tokens (CUDA graphs).
            do_send / do_recv: run the send half, the receive half, or both (default).

        Bad input raises ValueError before anything of it is sent, and aborts the call on every rank:
        this rank still takes part, with no tokens and a count row of -1, so its peers finish the call
        and raise `CallAborted` naming it (ranks that wait on the host: from this dispatch, after
        finishing the combine half themselves; ranks that wait in kernels: from a later `combine` or
        `check()`, since their host never waits); the next call works on every rank. Bad receive
        outputs alone (`do_send=False`) raise ValueError and leave the call open for a corrected
        receive. On GPU the call is asynchronous and
        CUDA-graph safe with `bound_m`. Index values are checked without a host sync on a GPU (the routing
        kernel drops a bad route and the end of the following combine, or `check()`, raises a ValueError
        naming it, once; the instance stays usable), on the host on CPU (bad input, as above).
        """
        self._ready()
        if do_send:
            self._expect(_IDLE, "dispatch(do_send=True)")
            try:
                self._validate_dispatch(x, x_scale, indices, bound_m)
                if do_recv:
                    self._validate_dispatch_out(out_expert_num_tokens, out_expert_x, out_expert_x_scale)
            except ValueError as exc:
                self._abort_call(exc)  # raises exc, once the call is void on every rank
        elif do_recv:
            self._expect(_DISPATCH_SENT, "dispatch(do_recv=True)")
            # Nothing is lost: the send half is done, a corrected receive may follow.
            self._validate_dispatch_out(out_expert_num_tokens, out_expert_x, out_expert_x_scale)
        try:
            if do_send:
                self._traced("dispatch_send", self._dispatch_send, x, x_scale, indices, bound_m)
            if do_recv:
                self._traced("dispatch_recv", self._dispatch_recv, out_expert_num_tokens, out_expert_x,
                             out_expert_x_scale)
        except CallAborted:
            raise
        except BaseException as exc:
            self._fail(exc)

    def combine(self, out_tokens, indices, weights, expert_y, bound_m=None, do_send: bool = True,
                do_recv: bool = True, accumulate: bool = False) -> None:
        """Send expert outputs home; form `out_tokens[t] = sum_k weights[t,k] * y(t,k)`.

        Args:
            out_tokens: `[T, H]` out_dtype (T as in the dispatch); rows of tokens >= live count untouched.
            indices: `[T, K]` as given to `dispatch` (the routes are remembered from it).
            weights: `[T, K]` float32.
            expert_y: `[>= max_dispatch_rows, H]` out_dtype: row i is the expert output of row i
                of `out_expert_x` from `dispatch` (padding rows are never read).
            accumulate: add to the old `out_tokens` (in fp32, before the k terms) instead of overwriting.
        """
        self._ready()
        cfg = self.cfg
        if do_send:
            self._expect(_DISPATCH_DONE, "combine(do_send=True)")
            _check("expert_y", expert_y, None, cfg.out_dtype, self.device)
            if expert_y.dim() != 2 or expert_y.shape[1] != cfg.hidden_dim:
                raise ValueError(f"expert_y: expected [rows, {cfg.hidden_dim}], got {tuple(expert_y.shape)}")
            if expert_y.shape[0] < self.layout.max_dispatch_rows:
                raise ValueError(f"expert_y: needs >= {self.layout.max_dispatch_rows} rows (as out_expert_x), "
                                 f"got {expert_y.shape[0]}")
        if do_recv:
            self._expect(_COMBINE_SENT if not do_send else _DISPATCH_DONE, "combine(do_recv=True)")
            T = self._T
            _check("out_tokens", out_tokens, (T, cfg.hidden_dim), cfg.out_dtype, self.device)
            _check("weights", weights, (T, cfg.experts_per_token), torch.float32, self.device)
            _check("indices", indices, (T, cfg.experts_per_token), (torch.int32, torch.int64), self.device)
        try:
            if do_send:
                self._traced("combine_send", self._combine_send, expert_y)
            if do_recv:
                self._traced("combine_recv", self._combine_recv, out_tokens, weights, accumulate, bound_m)
        except BaseException as exc:
            self._fail(exc)
        if do_recv:
            # What kernels recorded of earlier calls (no sync): said once the call is issued, so raising
            # here never leaves this rank a call behind its peers.
            self._raise_recorded()

    def abort(self, reason: str) -> None:
        """Abort the next call on every rank, as bad input to `dispatch` does: this rank takes part in it
        with nothing (so its peers finish it and raise `CallAborted` naming it) and then raises
        `ValueError(reason)`. For layers above (`moe_a2a.compat`) that reject their own input before
        calling `dispatch`. Needs the instance idle (between calls)."""
        self._ready()
        self._expect(_IDLE, "abort()")
        self._abort_call(ValueError(reason))

    def check(self) -> None:
        """Raise what went wrong in calls already issued (for CUDA-graph users, whose replays make no host
        call): waits for the device, then raises the first failure recorded by a kernel wait or the proxy
        (eager calls do this at their start), then what is not fatal: a call aborted by a peer
        (`CallAborted`) or a bad index dropped on the device (ValueError), each once (eager calls say
        these at the end of `combine`)."""
        self._ready()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._raise_proxy_error_once()
        self._raise_recorded()

    def writes_posted(self, per_proxy: bool = False) -> dict[str, int] | list[dict[str, int]]:
        """RDMA writes this rank's proxies have posted so far, per phase: `{"dispatch": n, "combine": m}`
        (cumulative, summed over the proxies; zero when every rank is on one node). After the proxies
        finished a call's phase. `per_proxy=True`: one such dict per proxy (proxy j posts to the remote
        peers p with p % k == j)."""
        out = [{"dispatch": int(self._flags_np[flag_word(Flag.DISPATCH_WRITES_POSTED)]),
                "combine": int(self._flags_np[flag_word(Flag.COMBINE_WRITES_POSTED)])}]
        if self.num_proxies > 1:  # the primary counts in the flags, the others in their shard words
            words = ShardWords(self.segment, self.layout)
            out += [{"dispatch": words.get(j, ShardWord.DISPATCH_POSTED),
                     "combine": words.get(j, ShardWord.COMBINE_POSTED)} for j in range(1, self.num_proxies)]
        if per_proxy:
            return out
        return {phase: sum(d[phase] for d in out) for phase in ("dispatch", "combine")}

    def set_tracing(self, on: bool = True) -> None:
        """Record timestamps of every call (model halves and proxy steps) for `trace()`.

        Off by default and free when off. When on, each half of a call is stamped at its start and end
        on the stream (GPU: a one-program kernel reading %globaltimer, no synchronisation; CPU: the
        host clock), and the proxy stamps each of its steps."""
        self._tracing = bool(on)
        if self._tracing and self.device.type == "cuda" and self._clock_offset_ns is None:
            torch.cuda.synchronize(self.device)
            self._clock_offset_ns = sync.gpu_clock_offset_ns(self._model_trace, self._model_trace_host,
                                                             self.layout.clock_calibration_word)
        self.flags_host[flag_word(Flag.TRACE)] = int(on)

    def trace(self, latest: bool = False) -> dict:
        """The last traced call: `{"rank", "epoch", "node_local", "model": {half: (t0_ns, t1_ns)}, "proxy":
        {event: t_ns}}` (no proxy events when the calls are node-local: the proxy takes no part),
        CLOCK_MONOTONIC nanoseconds (one clock for every process of this machine). On a GPU the model's
        spans are when the stream reached the start and the end of each half (mapped from %globaltimer,
        within ~1 µs). `latest=True`: the last call the stream stamped, whatever the host's epoch (CUDA-graph
        replays advance the epoch on the device only). ValueError after `close()` (the stamps are gone)."""
        if getattr(self, "_closed", True):
            raise ValueError("AllToAll is closed: trace() reads the shared segment, released by close()")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the end stamps are written by the stream
        # The proxy's last step (its combine writes completing) may finish after combine returns.
        deadline = time.monotonic() + self.timeout_s
        while (self.with_proxy and self._state == _IDLE and self.epoch and time.monotonic() < deadline
               and int(self._flags_np[flag_word(Flag.COMBINE_WRITES_DONE)]) < self.epoch):
            time.sleep(1e-4)
        stamps = self._model_trace_host[: self.layout.clock_calibration_word].reshape(-1, 2, 2).tolist()
        epoch = max(e0 for (e0, _), _ in stamps) if latest else self.epoch
        raw = self.segment.numpy(self.layout.trace_offset_bytes, 2 * len(TRACE_EVENTS), "int64").reshape(-1, 2)
        proxy = {name: int(t) for name, (e, t) in zip(TRACE_EVENTS, raw) if e == epoch}
        offset = self._clock_offset_ns or 0
        model = {name: (t0 + offset, t1 + offset) for name, ((e0, t0), (e1, t1)) in zip(MODEL_TRACE_EVENTS, stamps)
                 if e0 == e1 == epoch}
        return {"rank": self.rank, "epoch": epoch, "node_local": self.node_local, "model": model, "proxy": proxy}

    def _traced(self, name: str, fn, *args) -> None:
        if not self._tracing:
            fn(*args)
            return
        index = 4 * MODEL_TRACE_EVENTS.index(name)
        # dispatch_send advances the call's epoch itself: its start stamp names the coming one.
        self._stamp(index, 1 if name == "dispatch_send" else 0)
        fn(*args)
        self._stamp(index + 2, 0)

    def _stamp(self, index: int, ahead: int) -> None:
        if self.device.type == "cuda":
            sync.stamp_time(self._model_trace, index, ahead, epoch=self.epoch_dev)
        else:
            sync.stamp_time(self._model_trace, index, self.epoch + ahead)

    def close(self) -> None:
        """Stop the proxy (and remove the files it left in /dev/shm, even if it was killed), release
        shared memory. Idempotent (also after a failed construction); also `with AllToAll(...) as a2a:`.
        After it, every call and `trace()` raise ValueError("AllToAll is closed")."""
        if getattr(self, "_closed", True):  # closed, or construction failed before anything existed
            return
        with self._watch_lock:  # the proxy watch thread writes into the segment: not once it is unmapped
            self._closed = True
        if self.device.type == "cuda":
            # Work already on the stream (a graph replay included) still reads and writes these buffers.
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - a broken context must not keep the files and proxy alive
                pass
        self._release()

    def _release(self) -> None:
        """Stop the proxy, unmap peers, free buffers and the segment (whatever exists so far). Every
        step runs even when an earlier one raises (the first error is raised at the end), so one
        failure never leaves the segment file or the proxy behind."""
        errors: list[BaseException] = []

        def step(fn, *args) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - collected, the first one re-raised below
                errors.append(exc)

        proxies, self._proxies, self.proxy = getattr(self, "_proxies", []), [], None
        seg = getattr(self, "segment", None)
        if seg is not None and seg._mmap is not None and proxies:
            Flags(seg, self.layout)[Flag.SHUTDOWN] = 1  # every proxy starts exiting now, not one by one
        for proxy in proxies:
            step(proxy.stop, seg, self.layout)
        ptrs, self._ipc_ptrs = getattr(self, "_ipc_ptrs", []), []
        for ptr in ptrs:
            step(close_ipc_handle, ptr)
        peers, self._peer_segments = getattr(self, "_peer_segments", []), []
        for seg in peers:
            step(seg.close)
        bufs = [getattr(self, "_send_buf", None), getattr(self, "_recv_buf", None), getattr(self, "_node_seg", None)] \
            + getattr(self, "_fd_mem", [])
        self._send_buf = self._recv_buf = self._node_seg = None
        self._fd_mem = []
        for buf in bufs:
            if buf is not None:
                step(buf.close)
        if getattr(self, "segment", None) is not None:
            step(self.segment.close)  # idempotent; the object stays for error messages after close
        if errors:
            raise errors[0]

    def __enter__(self) -> "AllToAll":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- the four halves ----------------------------------------------------------------------------
    # Each half is its kernels; they wait in their prologue and signal in their epilogue (node_sync.py):
    # dispatch send  route_tokens (epoch += 1 on the stream; with remote peers raises ROUTE_READY)
    #                -> pack: waits DISPATCH_WRITES_DONE >= e-1 (remote), then publishes the count row
    #                and dispatch_ready[me] = e to every node peer (and SEND_READY to the proxy)
    # dispatch recv  unpack: waits dispatch_ready >= e of every node peer (and DISPATCH_RECV_READY)
    # combine send   pack by source: waits COMBINE_WRITES_DONE >= e-1 (remote), pushes rows into node
    #                homes' recv buffers, stages remote ones, publishes combine_ready[me] = e (and
    #                COMBINE_SEND_READY)
    # combine recv   reduce: waits combine_ready >= e of every node peer (and COMBINE_RECV_READY)
    def _dispatch_send(self, x, x_scale, indices, bound_m, abort: bool = False) -> None:
        self.epoch += 1
        self._T, self._bound_m = x.shape[0], bound_m
        self._host_wait("dispatch_send")
        slot = self.route_slot[: x.shape[0]]
        on_gpu = self.device.type == "cuda"
        routing.route_tokens(indices, self.cfg.num_experts, out_counts=self.counts[self.rank], out_route_slot=slot,
                             bound_m=bound_m, epoch=self._node.epoch, bad_index=self._bad_index if on_gpu else None,
                             ready=self._route_ready if self.with_proxy else None, abort=abort,
                             **self._split["route"])
        dispatch_kernels.pack_tokens_by_expert(x, x_scale, slot, self.base, self.send_offset_bytes, self.cfg,
                                               bound_m=bound_m, node=self._node, **self._split["pack"])
        self._state = _DISPATCH_SENT

    def _dispatch_recv(self, out_num, out_x, out_x_scale, aborting: bool = False) -> None:
        self._host_wait("dispatch_recv")
        aborted = self._aborted_sources()
        dispatch_kernels.unpack_tokens_by_expert(
            out_num, out_x, out_x_scale, self.counts, self.rank, self.base, self.peer_send_bytes,
            self.stage_recv_offset_bytes, self.cfg, self.layout, node=self._node)  # remote sources' rows
        self._state = _DISPATCH_DONE
        if self.device.type != "cuda" and self.layout.expert_capacity:
            self._raise_capacity_exceeded()  # CPU kernels have run: say it now (a GPU says it at the next call)
        if aborted and not aborting:
            # A host that waits knows now: finish the call's combine half here (it moves nothing that
            # counts), so every rank ends the call together and the next one starts clean.
            scratch = self._scratch()
            self._combine_send(scratch["y"])
            self._combine_recv(scratch["out"][: self._T], scratch["w"][: self._T], False, self._bound_m)
            self._abort_seen = self.epoch
            raise CallAborted(self._aborted_message(self.epoch, aborted))

    # ---- aborted calls ------------------------------------------------------------------------------
    def _abort_call(self, exc: ValueError) -> None:
        """This rank's input was rejected: take part in the call with no tokens and a count row of -1
        (both halves, into scratch buffers), so every peer finishes it and reports the abort; then
        raise `exc`. Nothing of the rejected input is read."""
        scratch = self._scratch()
        try:
            self._dispatch_send(scratch["x"], scratch["xs"], scratch["idx"], None, abort=True)
            self._dispatch_recv(scratch["num"], scratch["ex"], scratch["exs"], aborting=True)
            self._combine_send(scratch["y"])
            self._combine_recv(scratch["out"][:0], scratch["w"][:0], False, None)
        except BaseException as inner:
            self._fail(inner)
        self._abort_seen = self.epoch
        raise ValueError(f"{exc} (rank {self.rank} aborted this call, epoch {self.epoch}, on every rank: it sent "
                         f"nothing; the next call proceeds normally)") from None

    def _scratch(self) -> dict:
        """Buffers of an aborted call (made on the first one): no tokens in; one row out, since the
        kernels never write or read past the rows they are given (the call's outputs are void)."""
        if self._abort_scratch is None:
            cfg, lay, dev = self.cfg, self.layout, self.device
            T, K = cfg.max_num_tokens, cfg.experts_per_token
            self._abort_scratch = {
                "x": torch.zeros(0, cfg.hidden_dim, dtype=cfg.in_dtype, device=dev),
                "xs": torch.zeros(0, cfg.num_scales, dtype=torch.float32, device=dev) if cfg.has_scales else None,
                "idx": torch.zeros(0, K, dtype=torch.int32, device=dev),
                "num": torch.zeros(lay.num_local_experts, dtype=torch.int32, device=dev),
                "ex": torch.zeros(1, cfg.hidden_dim, dtype=cfg.in_dtype, device=dev),
                "exs": torch.zeros(1, cfg.num_scales, dtype=torch.float32, device=dev) if cfg.has_scales else None,
                "y": torch.zeros(1, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev),
                "out": torch.zeros(T, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev),
                "w": torch.zeros(T, K, dtype=torch.float32, device=dev),
            }
        return self._abort_scratch

    def _aborted_sources(self) -> list[int]:
        """Host waits: the sources whose count row of this call is -1 (others than this rank)."""
        if self._ready_words is None:
            return []
        col = self._counts_np[:, 0]
        return [s for s in range(self.world_size) if s != self.rank and col[s] < 0]

    def _aborted_message(self, epoch: int, sources: list[int]) -> str:
        return (f"rank {self.rank}: call {epoch} was aborted by rank {', '.join(map(str, sources))}: its input was "
                f"rejected (a ValueError there says why); every output of that call is void; the next call "
                f"proceeds normally")

    def _raise_recorded(self) -> None:
        """Raise, once each, what kernels recorded that leaves the instance usable: a peer's abort
        (CallAborted) and an out-of-range index dropped on the GPU (ValueError)."""
        aborted = decode_abort(self._flags_np[flag_word(Flag.ABORTED)])
        if aborted and aborted[0] > self._abort_seen:
            self._abort_seen = aborted[0]
            raise CallAborted(self._aborted_message(aborted[0], [aborted[1]]))
        bad = decode_bad_index(self._flags_np[flag_word(Flag.BAD_INDEX)], self.cfg.experts_per_token)
        if bad:
            self._flags_np[flag_word(Flag.BAD_INDEX)] = 0
            raise ValueError(f"indices[{bad[0]}, {bad[1]}] of an earlier dispatch (epoch <= "
                             f"{self.epoch}): expected -1 (not routed) or a value in [0, {self.cfg.num_experts}) "
                             f"(checked on the GPU without a host sync; that route was not sent; the instance "
                             f"stays usable)")

    def _combine_send(self, expert_y) -> None:
        self._host_wait("combine_send")
        combine_kernels.pack_combine_by_source(
            expert_y, self.counts, self.rank, self.base, self.peer_recv_bytes,
            self.stage_send_offset_bytes + self.layout.combine_stage_offset_bytes, self.cfg, self.layout, node=self._node)
        self._state = _COMBINE_SENT

    def _combine_recv(self, out_tokens, weights, accumulate, bound_m) -> None:
        self._host_wait("combine_recv")
        combine_kernels.reduce_combined_tokens(
            out_tokens, self.route_slot[: self._T], weights, self.base,
            self.recv_offset_bytes + self.layout.combine_recv_offset_bytes, self.cfg, accumulate=accumulate,
            bound_m=bound_m if bound_m is not None else self._bound_m, node=self._node, **self._split["reduce"])
        self._state = _IDLE

    def _host_wait(self, half: str) -> None:
        """Host waits only (CPU, ranks sharing a GPU): poll what the half's kernel would wait for."""
        if self._ready_words is None:
            return
        flag, delta, _, _, what = HALF_FLAGS[half]
        words = self._ready_words[half.split("_")[0]] if half.endswith("recv") else None
        first, n = self._node.node_first, self._node.node_size
        target = self.epoch
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while True:
            missing = [p for p in range(first, first + n) if int(words[p]) < target] if words is not None else []
            proxy_late = self.with_proxy and int(self._flags_np[flag_word(flag)]) < target + delta
            if not missing and not proxy_late:
                # Re-read what passed with acquire loads: the data the kernel reads next is ordered after
                # them (plain loads are enough on x86, not on Arm; host_atomics keeps them plain there).
                if words is not None:
                    at = words.ctypes.data
                    for p in range(first, first + n):
                        host_atomics.load_acquire(at + 8 * p)
                if self.with_proxy:
                    host_atomics.load_acquire(self._flags_np.ctypes.data + 8 * flag_word(flag))
                return
            if self._flags_np[flag_word(Flag.ERROR)]:
                self._raise_proxy_error(force=True)
            if time.monotonic() > deadline:
                self._raise_proxy_error(force=True)
                raise TimeoutError(f"rank {self.rank}: {what}: timed out after "
                                   f"{self.timeout_s:g}s (epoch {target}); missing peers {missing}"
                                   + (" and the proxy (remote peers)" if proxy_late else ""))
            spins += 1
            time.sleep(0 if spins < 100 else 1e-4)  # yield: the peers and the proxy need the cores (2 on CI)

    # ---- errors, validation ------------------------------------------------------------------------
    def _raise_proxy_error(self, force: bool = False) -> None:
        if not force and not self._flags_np[self._alarm_words].any():
            # Nothing raised: only a dead proxy is left to find, and it matters only when calls use it
            # (polled at most every 20 ms: waitpid is a system call).
            if not self.with_proxy or not self._proxies or time.monotonic() < self._next_proxy_poll:
                return
            self._next_proxy_poll = time.monotonic() + 0.02
            dead = self._dead_proxy()
            if dead is not None:
                raise RuntimeError(f"rank {self.rank}: {dead}")
            return
        self._raise_capacity_exceeded()
        code = int(self._flags_np[flag_word(Flag.ERROR)])
        if code:  # the proxy's message names the remote peers it missed
            msg = read_error(self.segment, self.layout)
            raise (TimeoutError if code == ERROR_TIMEOUT else RuntimeError)(msg)
        for _, _, _, status, what in HALF_FLAGS.values():
            failed = decode_wait_status(self._flags_np[flag_word(status)], self._node.node_first)
            if failed:
                raise TimeoutError(f"rank {self.rank}: {what}: the GPU wait timed out after {self.timeout_s:g}s; "
                                   f"missing peers {failed[0]}" + (" and the proxy (remote peers)" if failed[1] else ""))
        dead = self._dead_proxy()
        if dead is not None:
            raise RuntimeError(f"rank {self.rank}: {dead}")

    def _dead_proxy(self) -> str | None:
        """What to say about the first of this rank's proxy processes that has exited, or None."""
        for j, h in enumerate(getattr(self, "_proxies", [])):
            if h.proc.poll() is not None:
                which = f" (proxy {j} of {len(self._proxies)}, pid {h.proc.pid})" if len(self._proxies) > 1 else ""
                return f"proxy process exited with code {h.proc.returncode}{which}"
        return None

    def _raise_capacity_exceeded(self) -> None:
        over = decode_capacity(self._flags_np[flag_word(Flag.CAPACITY_EXCEEDED)], self.layout.num_local_experts)
        if over:
            cap = self.layout.expert_capacity
            raise RuntimeError(f"rank {self.rank}: local expert {over[0]} received {over[1]} rows in "
                               f"one dispatch (epoch <= {self.epoch}), more than expert_capacity={cap}: the rows "
                               f"past it were not written and their combine is wrong; raise expert_capacity "
                               f"(at most world_size * max_num_tokens * experts_per_token rows can arrive)")

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        raise exc

    def _ready(self) -> None:
        if self._closed:
            raise ValueError("AllToAll is closed")
        if self._error is not None:
            raise RuntimeError(f"AllToAll is unusable after an earlier error: {self._error!r}") from self._error
        if self.device.type == "cuda":
            self._raise_proxy_error_once()
            if self.host_waits and torch.cuda.is_current_stream_capturing():
                raise ValueError("this rank waits on the host (gpu_wait='host', or another rank shares its GPU), "
                                 "and a host wait cannot be captured in a CUDA graph: use one GPU per rank and "
                                 "gpu_wait='kernel' or 'auto'")

    def _raise_proxy_error_once(self) -> None:
        try:
            self._raise_proxy_error()
        except BaseException as exc:
            self._error = exc
            raise

    def _expect(self, state: int, call: str) -> None:
        if self._state != state:
            raise ValueError(f"{call}: called out of order; the instance is {_STATE_NAMES[self._state]}")

    def _validate_dispatch(self, x, x_scale, indices, bound_m) -> None:
        cfg = self.cfg
        _check("x", x, None, cfg.in_dtype, self.device)
        if x.dim() != 2 or x.shape[1] != cfg.hidden_dim:
            raise ValueError(f"x: expected [T, {cfg.hidden_dim}], got {tuple(x.shape)}")
        T = x.shape[0]
        if T > cfg.max_num_tokens:
            raise ValueError(f"x: {T} tokens > max_num_tokens ({cfg.max_num_tokens})")
        if cfg.has_scales:
            if x_scale is None:
                raise ValueError(f"x_scale: this config has scales (scale_block={cfg.block_size}); got None")
            _check("x_scale", x_scale, (T, cfg.num_scales), torch.float32, self.device)
        elif x_scale is not None:
            raise ValueError("x_scale: this config has no scales; pass None")
        _check("indices", indices, (T, cfg.experts_per_token), (torch.int32, torch.int64), self.device)
        if not indices.is_contiguous():
            raise ValueError("indices: must be contiguous")
        if bound_m is not None:
            _check("bound_m", bound_m, (1,), torch.int32, self.device)
        if self.device.type != "cuda":
            # CPU: the check costs no device sync, so bad input is refused before anything is sent.
            # GPU: the routing kernel checks on the device; the combine's end says it (no host sync).
            routing.validate_indices(indices if bound_m is None else indices[: int(bound_m[0])], cfg.num_experts)

    def _validate_dispatch_out(self, num, x, xs) -> None:
        cfg, lay = self.cfg, self.layout
        _check("out_expert_num_tokens", num, (lay.num_local_experts,), torch.int32, self.device)
        _check("out_expert_x", x, None, cfg.in_dtype, self.device)
        if x.dim() != 2 or x.shape[1] != cfg.hidden_dim or x.shape[0] < lay.max_dispatch_rows:
            raise ValueError(f"out_expert_x: expected [>= {lay.max_dispatch_rows}, {cfg.hidden_dim}], "
                             f"got {tuple(x.shape)} (use empty_dispatch_outputs())")
        if cfg.has_scales:
            _check("out_expert_x_scale", xs, None, torch.float32, self.device, last_contig=False)
            if xs.dim() != 2 or xs.shape[1] != cfg.num_scales or xs.shape[0] < lay.max_dispatch_rows:
                raise ValueError(f"out_expert_x_scale: expected [>= {lay.max_dispatch_rows}, {cfg.num_scales}], "
                                 f"got {tuple(xs.shape)}")
        elif xs is not None:
            raise ValueError("out_expert_x_scale: this config has no scales; pass None")


__all__ = ["AllToAll", "CallAborted"]
