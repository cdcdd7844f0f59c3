"""TransferEngine: RDMA writes with 32-bit immediates, specialised for MoE all-to-all, over a carrier.

The engine knows nothing of tokens: only registered buffers, byte offsets, peers and immediates. It
exists once; what moves the bytes and the immediates is its **carrier**, of which there are two:

- `fabric.FabricCarrier`: libfabric (efa, verbs, tcp, shm): endpoints, memory registrations, one
  ``fi_writemsg`` per write, completions from the CQs. The default.
- `emulated.EmulatedCarrier`: the emulated NIC between processes of one host (`transport="emulated"`): a
  write is a copy into the peer's mapped buffer, its immediate a slot in the peer's inbox (an
  instrument: the same engine, peers and write tables as over a NIC; docs/transport.md).

What the engine does, whatever the carrier:

- ``register`` a buffer once, with the least access it needs (``ACCESS_SOURCE``: a local source of
  writes; ``ACCESS_TARGET``: peers write into it; never remote reads); its :class:`RemoteRegion`
  descriptor (picklable, it carries the keys) is exchanged at bootstrap and only there.
- ``connect`` peers (cached) and build a :class:`PeerGroup`: one remote region per peer, prepared by the
  carrier once (libfabric: one ``fi_msg_rma`` template per peer; emulated: the peer's buffer mapped).
- ``scatter`` / ``post``: one source region, one write per target (peer, src offset, length, dst
  offset), each with an immediate; zero-length targets carry only the immediate. ``post_table``: the
  writes of a write table the kernels planned. ``barrier``: a zero-length write with an immediate to
  every peer of a group. Every target is bounds-checked (``ValueError``).
- Completion by counting: every received immediate increments a counter keyed by its exact 32-bit
  value; ``wait_imms`` waits (progressing) until expected counts arrived and consumes them;
  ``wait_writes`` until every posted write completed locally.

The carrier interface (what `TransferEngine` calls; see either carrier for the details):
``attach(engine)``, ``provider``, ``provider_name``, ``num_domains``, ``address``, ``fabric_info``,
``max_write_bytes``, ``register(addr, nbytes, access, dmabuf_fd, cuda_device, max_write_bytes) ->
LocalRegion``, ``descriptor(region)``, ``connect(address) -> link``, ``check_region(position, peer,
region)``, ``prepare_group(group)``, ``scatter(group, src, targets, imm, imms)``, ``post_table(...)``,
``progress()``, ``pending``, ``waiting_for``, ``close(regions)``. A carrier keeps its own state (the
per-write hot loops live there) and counts into the engine's (``imm_counter``, the totals). Attributes
of the carrier the engine does not define are read through the engine (libfabric's ``info``,
``domain_names``; the emulated NIC's ``nic``, ``kind``).

Every wait progresses the carrier continuously (software providers move data only while the target
reads its CQ) and has a timeout. Threading: none; one engine is driven by one thread.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import libfabric as lf

EMULATED = "emulated"  # the provider name of the emulated NIC (transport="emulated")
# The carrier a TransferEngine made without one runs on: `fabric.FabricCarrier`, registered by fabric.py
# (imported with the package), so that this module needs none of its carriers (they all need it).
_DEFAULT_CARRIER: list = [None]


def use_default_carrier(factory) -> None:
    """Make `factory(provider, num_domains, **libfabric options)` the carrier of engines made without one."""
    _DEFAULT_CARRIER[0] = factory
_IMM_MASK = 0xFFFFFFFF
_sched_yield = os.sched_yield

# Memory-region access (least privilege, docs/threat-model.md). Nothing in the protocol does RDMA reads,
# so no region is ever registered with FI_REMOTE_READ (or FI_READ: we never read into local memory).
ACCESS_SOURCE = lf.FI_WRITE  # only a local source of our writes: peers cannot touch it
ACCESS_TARGET = lf.FI_REMOTE_WRITE  # only written by peers
ACCESS_SOURCE_AND_TARGET = ACCESS_SOURCE | ACCESS_TARGET
_ACCESS_ALLOWED = lf.FI_WRITE | lf.FI_READ | lf.FI_REMOTE_WRITE | lf.FI_REMOTE_READ


@dataclass(frozen=True)
class EngineAddress:
    """Picklable address of an engine: provider name and one endpoint name per domain (libfabric's
    ``fi_getname``; the emulated NIC's: its process, inbox and host, packed). ``label`` names it in
    messages when set (the emulated NIC: ``pid1234``); else the start of the first name, in hex."""

    provider: str
    names: tuple[bytes, ...]
    label: str = ""
    # What peers must agree on to talk at all (efa: the libfabric version and the EFA device generation,
    # `FabricCarrier`; "" elsewhere): compared across ranks at bootstrap (`runtime.bootstrap.check_same_fabric`).
    fabric: str = ""

    def __str__(self) -> str:
        return f"{self.provider}:{self.label or self.names[0][:24].hex()}"


@dataclass(frozen=True)
class RemoteRegion:
    """Picklable descriptor of a registered buffer, for peers to write into it.

    ``base`` is the remote address of byte 0 as the carrier wants it: over libfabric the virtual address
    when the provider's ``mr_mode`` has ``FI_MR_VIRT_ADDR`` (shm, efa), else 0 (tcp: offsets into the MR);
    over the emulated NIC the buffer's offset in its file. ``keys`` holds one key per domain of the owning
    engine (the emulated NIC: the owner's FD number of the file): capabilities (whoever can reach the
    engine and holds them may write the region), so they travel only in the bootstrap exchange and are
    left out of ``repr`` (tracebacks, logs).
    """

    provider: str
    nbytes: int
    base: int
    keys: tuple[int, ...] = field(repr=False)
    # Registered in chunks (`fabric.registration_chunks`; all empty / 0 for one registration, as `keys` then
    # say everything): chunk i covers [i * chunk_stride, min(i * chunk_stride + chunk_bytes, nbytes)), its
    # keys per domain are chunk_keys[i] (chunk_keys[0] == keys), chunk_bases[i] is the remote address of its
    # first byte (its virtual address with FI_MR_VIRT_ADDR, else 0: offsets into that chunk's MR).
    chunk_stride: int = 0
    chunk_bytes: int = 0
    chunk_bases: tuple[int, ...] = ()
    chunk_keys: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # The emulated NIC (peers map the owner's file to write into it): (kind "host" or "cuda", owner pid,
    # file size, CUDA ordinal or None, boot id). Empty over libfabric.
    file: tuple = ()

    @property
    def chunks(self) -> int:
        """Registrations the region is made of (1 unless registered in chunks)."""
        return max(1, len(self.chunk_keys))


class LocalRegion:
    """A buffer registered with an engine (source of writes and/or target of peers). ``reg`` is the
    carrier's registration (libfabric: the MRs of every domain; emulated: the backing file peers map);
    None once closed. Over libfabric's ``max_registration_bytes`` it is made of ``chunks`` overlapping
    registrations, chunk i at ``[i * chunk_stride, min(i * chunk_stride + chunk_bytes, nbytes))``."""

    def __init__(self, engine: "TransferEngine", addr: int, nbytes: int, access: int, reg,
                 chunks: int = 1, chunk_stride: int = 0, chunk_bytes: int | None = None):
        self.addr = addr
        self.nbytes = nbytes
        self.access = access  # the fi_mr_reg access bits
        self.reg = reg
        self.keys: tuple[int, ...] = reg.keys  # what its descriptor carries (one per domain; emulated: the FD)
        self.chunks = chunks
        self.chunk_stride = chunk_stride if chunks > 1 else 0
        self.chunk_bytes = chunk_bytes if chunks > 1 and chunk_bytes is not None else nbytes
        self._engine = engine

    def descriptor(self) -> RemoteRegion:
        """What a peer needs to write into this buffer (picklable). It holds the keys: hand it to peers
        only through the bootstrap exchange. Refused for a region peers may not write."""
        if not self.access & lf.FI_REMOTE_WRITE:
            raise ValueError("descriptor: this region was registered without FI_REMOTE_WRITE (a local "
                             "source only); peers cannot write into it")
        return self._engine.carrier.descriptor(self)

    def close(self) -> None:
        """Deregister (idempotent). No write from or into this buffer may be in flight."""
        reg, self.reg = self.reg, None
        if reg is not None:
            reg.close()
        if self in self._engine._regions:
            self._engine._regions.remove(self)


@dataclass(frozen=True)
class Peer:
    """A connected remote engine: its address and the carrier's link to it (libfabric: its ``fi_addr_t``
    in each local domain's AV; emulated: our ring in its inbox)."""

    index: int
    address: EngineAddress
    link: object = field(repr=False, compare=False)

    def __str__(self) -> str:
        return f"peer#{self.index}({self.address})"


class PeerGroup:
    """Peers with one remote region each (see ``TransferEngine.peer_group``); position ``i`` in the group
    is the ``peer_index`` of targets. The carrier adds what its posting loop needs per peer
    (``prepare_group``: libfabric's write templates, the emulated NIC's mapped destinations)."""

    def __init__(self, engine: "TransferEngine", peers: Sequence[Peer], regions: Sequence[RemoteRegion]):
        self.peers = tuple(peers)
        self.regions = tuple(regions)
        self.remote_nbytes = tuple(r.nbytes for r in regions)
        self.barrier_targets = tuple((i, 0, 0, 0) for i in range(len(peers)))
        self._engine = engine

    def __len__(self) -> int:
        return len(self.peers)


class PeerTimeout(TimeoutError):
    """A write to one peer could not be posted in time; ``position`` is the peer's index in its group.

    ``positions``: every peer of the call that timed out (``position`` first). ``posted``: None when the
    rows after ``position`` were not tried (the emulated NIC stops at the first); else every other row was
    posted, ``posted`` of them (libfabric sets a busy peer's rows aside and posts the rest first)."""

    def __init__(self, message: str, position: int, positions: Sequence[int] = (), posted: int | None = None):
        super().__init__(message)
        self.position = position
        self.positions = tuple(positions) or (position,)
        self.posted = posted


class TransferEngine:
    """RDMA-write engine (see the module docstring): libfabric unless ``carrier`` is given.

    Args:
        provider: ``"tcp"`` (tcp;ofi_rxm), ``"shm"``, ``"efa"`` or ``"auto"`` (efa if present, else shm,
            else tcp).
        num_domains: domains to open; peers of a group are sharded over them. Without ``domains``
            these are ``num_domains`` instances of the provider's first domain.
        domains: names of the domains (NICs: EFA gives several per GPU) to open, one each, from
            ``libfabric.list_domains(provider)``; overrides ``num_domains``.
        tx_size: transmit queue depth to ask for (None: provider default). Small values make the
            provider return ``-FI_EAGAIN``, which the engine absorbs by progressing and retrying.
        cq_size: entries per CQ.
        max_inflight: bound on writes posted and not yet completed (one ``fi_context`` each); posting
            beyond it progresses until a slot frees. Default ``min(cq_size // 2, 4096)`` per domain, so
            local completions can never overrun a CQ.
        hmem: ask for ``FI_HMEM`` (needed to register GPU memory).
        idle_yield: in wait loops, ``sched_yield()`` after a poll that found nothing. For machines with
            more busy-polling processes than cores (CI, tests); leave off on a dedicated proxy core.
        timeout_s: bound on any internal wait (posting against ``-FI_EAGAIN``, waiting for a slot).
        local_only: every peer runs on this host: socket providers (tcp) listen on 127.0.0.1 only, so
            no other host can reach the endpoint (docs/threat-model.md). No effect on shm, efa, verbs.
        max_registration_bytes: the most bytes one registration may span (whole pages); a larger buffer is
            registered in overlapping chunks (`register`). None: ``MOE_A2A_MAX_REGISTRATION_BYTES`` when
            set, else the provider's limit (efa: 2^20 pages; the others: none).
        carrier: another carrier than libfabric (`emulated.EmulatedCarrier`); the libfabric arguments
            above are then unused.
    """

    def __init__(self, provider: str = "auto", num_domains: int = 1, *, domains: Sequence[str] | None = None,
                 tx_size: int | None = None, cq_size: int = 4096, max_inflight: int | None = None,
                 hmem: bool = False, idle_yield: bool = False, timeout_s: float = 30.0, local_only: bool = False,
                 max_registration_bytes: int | None = None, carrier=None):
        if carrier is None:  # libfabric's (fabric.py registers it when the proxy package is imported)
            carrier = _DEFAULT_CARRIER[0](provider, num_domains, domains=domains, tx_size=tx_size, cq_size=cq_size,
                                          max_inflight=max_inflight, hmem=hmem, local_only=local_only,
                                          max_registration_bytes=max_registration_bytes)
        self.carrier = carrier
        self.provider, self.provider_name = carrier.provider, carrier.provider_name
        self.num_domains = carrier.num_domains
        self.address: EngineAddress = carrier.address
        self.fabric_info: dict | None = carrier.fabric_info  # what it runs on (None: the emulated NIC)
        self.max_write_bytes: int = carrier.max_write_bytes  # bytes one write may carry (one iovec)
        self.timeout_s = timeout_s
        self.post_timeout_s = timeout_s  # how long a post waits for the carrier (shrink mode: shorter)
        self.idle_yield = idle_yield
        self._closed = False
        self._regions: list[LocalRegion] = []
        self._peers: dict[EngineAddress, Peer] = {}
        self._imm_counts: dict[int, int] = {}
        self.writes_posted = 0  # totals, for tests and benchmarks
        self.writes_completed = 0
        self.imms_received = 0
        self.eagain_retries = 0  # posts retried after -FI_EAGAIN (back-pressure or lazy connect)
        # None: a failed write raises (the carrier's error). A dict (shrink mode, set by the proxy): a write
        # that fails naming its peer (an error completion, a refused post) is recorded here, peer -> the
        # error, and the call goes on; whoever set it takes the entries out and masks those peers.
        self.peer_errors: dict | None = None
        self.slot_waits = 0  # posts that waited for room (max_inflight writes in flight; a peer's full ring)
        try:
            carrier.attach(self)
            # A small buffer registered once: the source of zero-length writes (barriers); local only.
            import ctypes

            self._scratch = ctypes.create_string_buffer(64)
            self._scratch_region = self.register(ctypes.addressof(self._scratch), 64, ACCESS_SOURCE)
        except BaseException:
            self.close()
            raise

    def __getattr__(self, name: str):
        """What only one carrier has (libfabric's ``info``, ``domain_names``; the emulated NIC's ``nic``)."""
        if name == "carrier" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.carrier, name)

    # ------------------------------------------------------------------ memory

    def register(self, addr: int, nbytes: int, access: int = ACCESS_SOURCE_AND_TARGET, *,
                 dmabuf_fd: int | None = None, cuda_device: int | None = None,
                 max_write_bytes: int | None = None) -> LocalRegion:
        """Register ``[addr, addr+nbytes)`` with ``access`` (``fi_mr_reg`` access bits).

        Give the least access the buffer needs: :data:`ACCESS_SOURCE` (``FI_WRITE``: a local source of
        our writes, peers cannot write or read it), :data:`ACCESS_TARGET` (``FI_REMOTE_WRITE``: peers
        write into it) or :data:`ACCESS_SOURCE_AND_TARGET` (the default). ``FI_REMOTE_READ`` is refused:
        nothing in the protocol reads remotely, and it would let any key holder read the buffer.

        Host memory by default; GPU memory with ``cuda_device`` set (libfabric: ``FI_HMEM_CUDA``, or by
        DMA-BUF with ``dmabuf_fd``; the emulated NIC: a live ``CuMemBuffer``). ``max_write_bytes``: the
        caller's bound on its writes, for libfabric's registrations in chunks. The memory must stay
        valid until the region is closed. The carriers' rules: `FabricCarrier.register`,
        `EmulatedCarrier.register`.
        """
        self._check_open()
        if nbytes <= 0 or addr <= 0:
            raise ValueError(f"register: need addr > 0 and nbytes > 0, got addr={addr:#x} nbytes={nbytes}")
        if not isinstance(access, int) or not access or access & ~_ACCESS_ALLOWED:
            raise ValueError(f"register: access must be a nonzero combination of FI_WRITE, FI_READ and "
                             f"FI_REMOTE_WRITE, got {access!r}")
        if access & lf.FI_REMOTE_READ:
            raise ValueError("register: FI_REMOTE_READ is not allowed (no RDMA reads in the protocol; "
                             "it would expose the buffer to every key holder)")
        region = self.carrier.register(addr, nbytes, access, dmabuf_fd=dmabuf_fd, cuda_device=cuda_device,
                                       max_write_bytes=max_write_bytes)
        self._regions.append(region)
        return region

    # ------------------------------------------------------------------ peers

    def connect(self, addresses: Iterable[EngineAddress]) -> list[Peer]:
        """Connect remote engines (cached: connecting twice returns the same :class:`Peer`). Over
        libfabric the connections themselves are lazy (rxm connects on the first write; the engine
        retries ``-FI_EAGAIN`` meanwhile)."""
        self._check_open()
        out = []
        for a in addresses:
            if not isinstance(a, EngineAddress):
                raise ValueError(f"connect: expected EngineAddress, got {type(a).__name__}")
            if a.provider != self.provider_name:
                raise ValueError(f"connect: address of provider {a.provider!r}, this engine uses "
                                 f"{self.provider_name!r}")
            peer = self._peers.get(a)
            if peer is None:
                peer = Peer(len(self._peers), a, self.carrier.connect(a))
                self._peers[a] = peer
            out.append(peer)
        return out

    def peer_group(self, peers: Sequence[Peer], remote_regions: Sequence[RemoteRegion]) -> PeerGroup:
        """A group of peers, each with the remote region its writes land in. Raises ``ValueError`` for an
        unknown peer or a region of the wrong type/provider (or one the carrier cannot reach)."""
        self._check_open()
        if len(peers) != len(remote_regions) or not peers:
            raise ValueError(f"peer_group: need one remote region per peer and at least one peer, got "
                             f"{len(peers)} peers and {len(remote_regions)} regions")
        for i, (p, r) in enumerate(zip(peers, remote_regions)):
            if not isinstance(p, Peer) or self._peers.get(p.address) is not p:
                raise ValueError(f"peer_group: position {i}: {p!r} is not a peer of this engine "
                                 f"(use engine.connect)")
            if not isinstance(r, RemoteRegion):
                raise ValueError(f"peer_group: position {i}: expected RemoteRegion, got {type(r).__name__}")
            self.carrier.check_region(i, p, r)
        grp = PeerGroup(self, peers, remote_regions)
        self.carrier.prepare_group(grp)
        return grp

    # ------------------------------------------------------------------ posting

    def scatter(self, grp: PeerGroup, src: LocalRegion,
                targets: Sequence[tuple[int, int, int, int]] | np.ndarray, imm: int | Sequence[int]) -> None:
        """Post one RDMA write with immediate per target; returns once all are posted (not completed).

        Args:
            grp: the peer group (from :meth:`peer_group`).
            src: the local source region.
            targets: ``(peer_index, src_offset, length, dst_offset)`` tuples, byte units; ``peer_index``
                is the position in ``grp``, offsets are relative to ``src`` and to the peer's region.
                ``length == 0`` is allowed: the write carries only the immediate. An integer ``[n, 4]``
                array (what ``plan`` produces) is accepted too.
            imm: one 32-bit immediate for all targets, or one per target.

        Each write is one local iovec, at most ``max_write_bytes``. Every target is validated before
        anything is posted (``ValueError``). Back-pressure (libfabric's ``-FI_EAGAIN``, a peer's full
        ring) is absorbed by progressing and retrying, up to ``post_timeout_s``.
        """
        n_targets = len(targets)
        if isinstance(imm, int):
            if not 0 <= imm <= _IMM_MASK:
                raise ValueError(f"scatter: imm {imm} is not a 32-bit unsigned value")
            imms = None
        else:
            imms = imm
            if len(imms) != n_targets:
                raise ValueError(f"scatter: {len(imms)} imms for {n_targets} targets")
            for v in imms:
                if not 0 <= v <= _IMM_MASK:
                    raise ValueError(f"scatter: imm {v} is not a 32-bit unsigned value")
        if isinstance(targets, np.ndarray):
            if targets.ndim != 2 or targets.shape[1] != 4 or targets.dtype.kind not in "iu":
                raise ValueError(f"scatter targets: expected an integer [n, 4] array, got {targets.dtype} "
                                 f"{targets.shape}")
            # One by one from here: posting with numpy (patching every template in ~20 array operations,
            # then the calls through map) was measured no faster up to 255 targets (docs/perf-notes.md).
            targets = targets.tolist()
        self._validate(grp, src, targets)
        self.carrier.scatter(grp, src, targets, imm, imms)

    def post(self, grp: PeerGroup, src: LocalRegion, writes) -> None:
        """One write per ``(peer_index, src_offset, length, dst_offset, imm)`` (an integer ``[n, 5]`` array
        too): `scatter` with an immediate per write. Everything is validated before anything is posted."""
        if isinstance(writes, np.ndarray):
            if writes.ndim != 2 or writes.shape[1] != 5 or writes.dtype.kind not in "iu":
                raise ValueError(f"post writes: expected an integer [n, 5] array, got {writes.dtype} {writes.shape}")
            writes = writes.tolist()
        for w in writes:
            if len(w) != 5:
                raise ValueError(f"post: write {w!r}: expected (peer_index, src_offset, length, dst_offset, imm)")
        if writes:
            self.scatter(grp, src, [w[:4] for w in writes], [w[4] for w in writes])

    def post_table(self, grp: PeerGroup, src: LocalRegion, words, slots: Sequence[tuple[int, int]],
                   src_base: int = 0, dst_base: int = 0, imm: int | None = None, skip_empty: bool = False) -> int:
        """Post one write per slot of a write table, as the kernels planned it (`protocol.words.WriteTable`).

        Args:
            words: the table as int64 words (a memoryview of format 'q' over the shared segment): a row is
                ``(src_offset, length, dst_offset, imm)`` in bytes, offsets relative to the send buffer and
                to the peer's recv buffer.
            slots: ``(peer_index, word index of the row)`` for each write to post, in order. Keep the same
                object from call to call: what does not change per call is prepared once for it.
            src_base, dst_base: where those buffers start in ``src`` and in each peer's region.
            imm: one immediate for every write instead of the rows' (an aborted call's combine).
            skip_empty: rows of length 0 post nothing (the remainder table); else they carry the immediate.
        Returns the number of writes posted. Each row is bounds-checked, its length against
        ``max_write_bytes`` too (``ValueError``) since a corrupt count row of a peer shapes it. The hot
        path of the proxy: no allocation, no arithmetic beyond the bases (docs/protocol.md, "Write tables").
        """
        return self.carrier.post_table(grp, src, words, slots, src_base, dst_base, imm, skip_empty)

    def barrier(self, grp: PeerGroup, imm: int) -> None:
        """Post a zero-length write carrying ``imm`` to every peer of ``grp`` (the receivers count it)."""
        self.scatter(grp, self._scratch_region, grp.barrier_targets, imm)

    def check_source(self, src: LocalRegion) -> None:
        """``ValueError`` unless ``src`` is an open region of this engine."""
        if not isinstance(src, LocalRegion) or src._engine is not self or src.reg is None:
            raise ValueError(f"src must be an open LocalRegion of this engine, got {src!r}")

    def _validate(self, grp: PeerGroup, src: LocalRegion, targets) -> None:
        if not isinstance(grp, PeerGroup) or grp._engine is not self:
            raise ValueError(f"expected a PeerGroup of this engine, got {type(grp).__name__}")
        self.check_source(src)
        n_peers = len(grp.peers)
        src_n = src.nbytes
        rsize, max_len = grp.remote_nbytes, self.max_write_bytes
        for t in targets:
            p, so, length, do = t
            # (a | b | c | d) < 0 iff any is negative: one test instead of four (this pass is ~15% of
            # the posting cost).
            if (p | so | length | do) < 0 or p >= n_peers or so + length > src_n or do + length > rsize[p] \
                    or length > max_len:
                raise ValueError(self.bad_target(grp, src, (p, so, length, do)))

    def bad_target(self, grp: PeerGroup, src: LocalRegion, t) -> str:
        """Why a write ``(peer_index, src_offset, length, dst_offset)`` is refused (offsets from the regions'
        starts): out of the group, over ``max_write_bytes``, out of bounds, or across registration chunks."""
        p, so, length, do = t
        if not 0 <= p < len(grp.peers):
            return f"scatter target {t}: peer index {p} outside the group of {len(grp.peers)} peers"
        if length > self.max_write_bytes:
            return (f"scatter target {t}: {length} B is more than one write may carry over "
                    f"{self.provider_name!r} ({self.max_write_bytes} B, max_write_bytes)")
        if min(so, length, do) >= 0 and so + length <= src.nbytes and do + length <= grp.remote_nbytes[p]:
            # In bounds: it crosses from one registration chunk into the next on one side (never split).
            r = grp.regions[p]
            k = min(so // src.chunk_stride, src.chunks - 1) if src.chunks > 1 else 0
            side = (f"the source's {src.chunks} chunks of {src.chunk_bytes} B every {src.chunk_stride} B"
                    if src.chunks > 1 and so + length > k * src.chunk_stride + src.chunk_bytes
                    else f"the {r.chunks} chunks of {r.chunk_bytes} B every {r.chunk_stride} B at {grp.peers[p]}")
            return (f"scatter target {t} (peer_index, src_offset, length, dst_offset): crosses from one "
                    f"registration chunk into the next ({side}; the overlap of two chunks bounds a write); a "
                    f"write is never split (its immediate would arrive twice)")
        return (f"scatter target {t} (peer_index, src_offset, length, dst_offset): source range "
                f"[{so}, {so + length}) of {src.nbytes} B, destination range [{do}, {do + length}) of "
                f"{grp.remote_nbytes[p]} B at {grp.peers[p]}: out of bounds or negative")

    # ------------------------------------------------------------------ completions

    def progress(self) -> int:
        """Let the carrier deliver: count received immediates, retire local write completions. Returns
        the number of entries handled. Raises the carrier's error for a failed write (libfabric:
        :class:`~.libfabric.FabricError`, naming the peer of the failed write when it was ours)."""
        return self.carrier.progress()

    def _idle_progress(self) -> None:
        """progress() inside a wait loop: when nothing happened and ``idle_yield`` is set, give the
        core away (sched_yield). Measured on 2 cores with 3 busy-polling processes: without it a
        scatter+barrier round takes ~16 ms (time slices), with it well under 1 ms."""
        if not self.carrier.progress() and self.idle_yield:
            _sched_yield()

    @property
    def imm_counter(self) -> dict[int, int]:
        """The live counts of received immediates (value -> count; a value is absent at 0): read it, never
        write it (`take_imm` consumes). Set operations on its keys check many expected values at C speed."""
        return self._imm_counts

    def imm_count(self, imm: int) -> int:
        """Immediates ``imm`` received and not yet consumed (no progress is made)."""
        return self._imm_counts.get(imm, 0)

    def imm_counts(self) -> dict[int, int]:
        """Copy of all unconsumed immediate counts (for tests and debugging)."""
        return dict(self._imm_counts)

    def take_imm(self, imm: int, n: int) -> None:
        """Consume ``n`` received immediates ``imm``; ``ValueError`` if fewer arrived."""
        have = self._imm_counts.get(imm, 0)
        if have < n:
            raise ValueError(f"take_imm: {n} of imm {imm:#x} requested, {have} received")
        if have == n:
            del self._imm_counts[imm]
        else:
            self._imm_counts[imm] = have - n

    def wait_imms(self, expected: dict[int, int], timeout_s: float | None = None, what: str = "immediates",
                  names: dict[int, str] | None = None) -> None:
        """Progress until ``expected[imm]`` immediates of each ``imm`` arrived, then consume them.

        Immediates that arrived before the call count. On timeout raises ``TimeoutError`` naming
        ``what`` and every short immediate with received/expected counts (``names`` may map an imm to a
        readable label such as ``"rank 3"``; otherwise the caller's imm encoding identifies the peer).
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        counts = self._imm_counts
        deadline = None
        while True:
            for imm, n in expected.items():
                if counts.get(imm, 0) < n:
                    break
            else:
                break
            self._idle_progress()
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout_s
            elif now > deadline:
                short = [(imm, counts.get(imm, 0), n) for imm, n in expected.items() if counts.get(imm, 0) < n]
                label = names or {}
                detail = "; ".join(f"{label.get(i, f'imm {i:#x}')}: {got}/{n}" for i, got, n in short)
                raise TimeoutError(f"{what}: timed out after {timeout_s:g}s waiting for immediates: {detail}")
        for imm, n in expected.items():
            if n:
                self.take_imm(imm, n)

    @property
    def writes_pending(self) -> int:
        """Writes posted and not yet completed locally."""
        return self.carrier.pending if not self._closed else 0

    def wait_writes(self, timeout_s: float | None = None) -> None:
        """Progress until every posted write completed locally (its source buffer may be reused)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        carrier = self.carrier
        while carrier.pending:
            self._idle_progress()
            if carrier.pending and time.monotonic() > deadline:
                raise TimeoutError(f"wait_writes: {carrier.pending} writes still in flight after "
                                   f"{timeout_s:g}s{carrier.waiting_for}")

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Release the carrier and every region (idempotent). Writes still in flight are abandoned (call
        ``wait_writes`` first for a clean drain)."""
        if self._closed:
            return
        self._closed = True
        self.carrier.close(list(self._regions))

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("TransferEngine is closed")

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransferEngine({self.carrier!r}, pending={self.writes_pending})"

