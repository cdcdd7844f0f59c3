"""TransferEngine: RDMA writes with 32-bit immediates over libfabric, specialised for MoE all-to-all.

The engine knows nothing of tokens: only registered buffers, byte offsets, peers and immediates.

- ``register`` a buffer once, with the least access it needs (``ACCESS_SOURCE``: a local source of
  writes; ``ACCESS_TARGET``: peers write into it; never remote reads); its :class:`RemoteRegion`
  descriptor (picklable, it carries the keys) is exchanged at bootstrap and only there. A buffer larger
  than the provider allows in one registration (``max_registration_bytes``; EFA: 2^20 pages) is
  registered in overlapping chunks (:func:`registration_chunks`): every write lies wholly in one chunk.
- Keys are random 64-bit values (or the provider's own, ``FI_MR_PROV_KEY``): a key is a capability
  (whoever reaches the endpoint and knows it may write the region), so it must not be guessable.
- ``connect`` peers (``fi_av_insert``, cached) and build a :class:`PeerGroup`: addresses resolved and one
  ``fi_msg_rma`` template per peer pre-built, so a posted write only patches five integers.
- ``scatter``: one source buffer, one write per target (peer, src offset, length, dst offset), each with
  an immediate; zero-length targets carry only the immediate. ``barrier``: a zero-length write with an
  immediate to every peer of a group.
- Completion by counting: every ``FI_REMOTE_WRITE`` completion increments a counter keyed by its exact
  32-bit immediate; ``wait_imms`` waits (progressing) until expected counts arrived and consumes them.

Software providers (tcp, shm) move data only while the *target* reads its CQ, so every wait here
progresses all CQs continuously, and every wait has a timeout.

Domains: with ``num_domains > 1`` (EFA: two or more NICs per GPU) the peers of a group are sharded over
domains in contiguous ranges; local domain ``d`` always talks to the remote engine's domain
``d % remote_num_domains``, so keys and addresses pair up.

Threading: none. One engine is driven by one thread (the proxy process's loop).
"""
from __future__ import annotations

import ctypes
import os
import secrets
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from . import libfabric as lf

# Python-side bound on the CQ entries read per fi_cq_read: large enough to drain a scatter's completions
# in one call, small enough that a 40 B * N buffer stays in L1.
CQ_BATCH = 32
_ENTRY_U64 = ctypes.sizeof(lf.fi_cq_data_entry) // 8  # 5: op_context, flags, len, buf, data
# fi_msg_rma template per peer, as 14 uint64 words: the message (8 words), its iovec (2), its fi_rma_iov
# (3) and the one-element desc array (1). This order makes the six words that change per write
# (context, data, iov_base, iov_len, rma addr, rma len = words 6..11) contiguous: one pack_into patches them.
_T_MSG_IOV, _T_DESC, _T_IOV_COUNT, _T_ADDR, _T_RMA_IOV, _T_RMA_IOV_COUNT, _T_CONTEXT, _T_DATA = range(8)
_T_IOV_BASE, _T_IOV_LEN, _T_RMA_ADDR, _T_RMA_LEN, _T_RMA_KEY, _T_DESC0 = range(8, 14)
_T_WORDS = 14
_PATCH = struct.Struct("<6Q")  # words _T_CONTEXT.._T_RMA_LEN
# A region registered in chunks: the key and the desc change with the write too, and follow the six words.
_PATCH_CHUNKED = struct.Struct("<8Q")  # words _T_CONTEXT.._T_DESC0
# Every write is one iovec and one fi_rma_iov: EFA writes in hardware only a single iovec (it emulates
# more with sends, reading a GPU source from the CPU), so a private write's count row sits in the
# source buffer in front of its rows (config.Layout, private staging) rather than in a second iovec.
# A write larger than EFA's bound is split by EFA, its immediate arriving more than once: refused.
EFA_MAX_WRITE_BYTES = 1 << 30
# EFA: one registration that allows remote write spans at most 2^20 pages (4 GiB at 4 KiB pages; libfabric
# PR #10402), -FI_ENOMEM past it. Larger buffers are registered in chunks (`registration_chunks`).
EFA_MAX_REGISTRATION_PAGES = 1 << 20
MAX_REGISTRATION_ENV = "MOE_A2A_MAX_REGISTRATION_BYTES"  # overrides the provider's limit (tests force it small)
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_CTX_WORDS = 4  # struct fi_context: 4 pointers; FI_CONTEXT mode needs one per outstanding op
_WRITE_FLAGS = lf.FI_REMOTE_CQ_DATA | lf.FI_COMPLETION
_IMM_MASK = 0xFFFFFFFF
_NEG_EAGAIN = -lf.FI_EAGAIN
_NEG_EAVAIL = -lf.FI_EAVAIL
_sched_yield = os.sched_yield

# Memory-region access (least privilege, docs/threat-model.md). Nothing in the protocol does RDMA reads,
# so no region is ever registered with FI_REMOTE_READ (or FI_READ: we never read into local memory).
ACCESS_SOURCE = lf.FI_WRITE  # only a local source of our writes: peers cannot touch it
ACCESS_TARGET = lf.FI_REMOTE_WRITE  # only written by peers
ACCESS_SOURCE_AND_TARGET = ACCESS_SOURCE | ACCESS_TARGET
_ACCESS_ALLOWED = lf.FI_WRITE | lf.FI_READ | lf.FI_REMOTE_WRITE | lf.FI_REMOTE_READ


def _u64_view(ctypes_array) -> memoryview:
    return memoryview(ctypes_array).cast("B").cast("Q")


_ONE_CHUNK = 1 << 62  # the stride of a region of one chunk: every offset is in chunk 0


def _chunk_ends(nbytes: int, chunks: int, stride: int, chunk_bytes: int) -> tuple[int, ...]:
    return tuple(min(i * stride + chunk_bytes, nbytes) for i in range(chunks)) if chunks > 1 else (nbytes,)


def default_max_registration_bytes(provider: str, page: int = PAGE_SIZE) -> int | None:
    """The most bytes one registration of ``provider`` may span (None: no limit known): 2^20 pages on efa."""
    return EFA_MAX_REGISTRATION_PAGES * page if provider == "efa" else None


def max_registration_from_env(environ=None) -> int | None:
    """``MOE_A2A_MAX_REGISTRATION_BYTES`` as an integer of bytes (None when unset or empty)."""
    raw = (os.environ if environ is None else environ).get(MAX_REGISTRATION_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw, 0)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{MAX_REGISTRATION_ENV}={raw!r}: expected a positive number of bytes")
    return value


def registration_chunks(nbytes: int, limit: int | None, max_write: int, lead: int = 0,
                        page: int = PAGE_SIZE) -> tuple[int, int, int]:
    """How ``nbytes`` starting ``lead`` bytes into a page are registered under ``limit`` bytes (whole pages)
    per registration, for writes of at most ``max_write`` bytes: ``(count, stride, chunk_bytes)``, chunk i
    covering ``[i * stride, min(i * stride + chunk_bytes, nbytes))``. ``(1, 0, nbytes)`` when it fits in one.

    Why the chunks overlap (by at least ``max_write``): a write of at most ``max_write`` bytes at offset
    ``o`` then lies wholly in chunk ``min(o // stride, count - 1)``, so no write is ever split over two
    registrations (a split write would carry its immediate twice, and the receiver counts immediates).
    Overlapping registrations of the same memory are legal (verbs / efa pin the pages once per MR; tcp and
    shm keep a key -> range map); the overlap costs ``(count - 1) * (chunk_bytes - stride)`` bytes pinned
    twice. The stride is a multiple of the page, so every chunk starts ``lead`` bytes into a page and spans
    at most ``limit // page`` pages. ``ValueError`` when the limit leaves no page of stride past the
    overlap."""
    if limit is None or lead + nbytes <= limit // page * page:
        return 1, 0, nbytes
    chunk = limit // page * page - lead
    stride = (chunk - max_write) // page * page if chunk > max_write else 0
    if stride <= 0:
        raise ValueError(f"register: {nbytes} B exceed one registration's limit ({limit} B, "
                         f"max_registration_bytes; {MAX_REGISTRATION_ENV} overrides it): chunks of at most {chunk} B "
                         f"that overlap by the largest write ({max_write} B) leave no stride of a {page} B page; "
                         f"raise the limit above {max_write + page + lead} B or lower the largest write")
    return 1 + -(-(nbytes - chunk) // stride), stride, chunk


@dataclass(frozen=True)
class EngineAddress:
    """Picklable address of an engine: provider name and one endpoint name per domain."""

    provider: str
    names: tuple[bytes, ...]

    def __str__(self) -> str:
        return f"{self.provider}:{self.names[0][:24].hex()}"


@dataclass(frozen=True)
class RemoteRegion:
    """Picklable descriptor of a registered buffer, for peers to write into it.

    ``base`` is the remote address of byte 0 as the provider wants it: the virtual address when the
    provider's ``mr_mode`` has ``FI_MR_VIRT_ADDR`` (shm, efa), else 0 (tcp: offsets into the MR).
    ``keys`` holds one key per domain of the owning engine: capabilities (whoever can reach the engine
    and holds them may write the region), so they travel only in the bootstrap exchange and are left
    out of ``repr`` (tracebacks, logs).
    """

    provider: str
    nbytes: int
    base: int
    keys: tuple[int, ...] = field(repr=False)
    # Registered in chunks (`registration_chunks`; all empty / 0 for one registration, as `keys` then say
    # everything): chunk i covers [i * chunk_stride, min(i * chunk_stride + chunk_bytes, nbytes)), its keys
    # per domain are chunk_keys[i] (chunk_keys[0] == keys), chunk_bases[i] is the remote address of its
    # first byte (its virtual address with FI_MR_VIRT_ADDR, else 0: offsets into that chunk's MR).
    chunk_stride: int = 0
    chunk_bytes: int = 0
    chunk_bases: tuple[int, ...] = ()
    chunk_keys: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    @property
    def chunks(self) -> int:
        """Registrations the region is made of (1 unless registered in chunks)."""
        return max(1, len(self.chunk_keys))


class LocalRegion:
    """A buffer registered in every domain of an engine (source of writes and/or target of peers), in one
    registration per domain or, over the engine's ``max_registration_bytes``, in ``chunks`` overlapping ones
    (chunk i at ``[i * chunk_stride, min(i * chunk_stride + chunk_bytes, nbytes))``, `registration_chunks`)."""

    def __init__(self, engine: "TransferEngine", addr: int, nbytes: int, mrs: list, access: int,
                 chunk_stride: int = 0, chunk_bytes: int = 0):
        self.addr = addr
        self.nbytes = nbytes
        self.access = access  # the fi_mr_reg access bits
        self._engine = engine
        # mrs: one list of MRs (one per domain) per chunk.
        self._mrs = [m for chunk in mrs for m in chunk]
        self.chunks = len(mrs)
        self.chunk_stride = chunk_stride if self.chunks > 1 else 0
        self.chunk_bytes = chunk_bytes if self.chunks > 1 else nbytes
        self.chunk_descs = tuple(tuple(m.desc for m in chunk) for chunk in mrs)
        self.chunk_keys = tuple(tuple(m.key for m in chunk) for chunk in mrs)
        self.descs = self.chunk_descs[0]  # fi_mr_desc per domain (may be 0 when not FI_MR_LOCAL); chunk 0's
        self.keys = self.chunk_keys[0]
        # What the chunked write path needs per domain d: (stride, last chunk, chunk ends, descs in d).
        ends = _chunk_ends(nbytes, self.chunks, self.chunk_stride, self.chunk_bytes)
        self._chunk_table = tuple((self.chunk_stride or _ONE_CHUNK, self.chunks - 1, ends,
                                   tuple(c[d] for c in self.chunk_descs)) for d in range(len(self.descs)))

    def descriptor(self) -> RemoteRegion:
        """What a peer needs to write into this buffer (picklable). It holds the keys: hand it to peers
        only through the bootstrap exchange. Refused for a region peers may not write."""
        if not self.access & lf.FI_REMOTE_WRITE:
            raise ValueError("descriptor: this region was registered without FI_REMOTE_WRITE (a local "
                             "source only); peers cannot write into it")
        virt = self._engine.info.virt_addr
        base = self.addr if virt else 0
        if self.chunks == 1:
            return RemoteRegion(self._engine.provider_name, self.nbytes, base, self.keys)
        bases = tuple(self.addr + i * self.chunk_stride if virt else 0 for i in range(self.chunks))
        return RemoteRegion(self._engine.provider_name, self.nbytes, base, self.keys, self.chunk_stride,
                            self.chunk_bytes, bases, self.chunk_keys)

    def close(self) -> None:
        """Deregister (idempotent). No write from or into this buffer may be in flight."""
        for m in self._mrs:
            m.close()
        self._mrs = []
        if self in self._engine._regions:
            self._engine._regions.remove(self)


@dataclass(frozen=True)
class Peer:
    """A connected remote engine: its address and its ``fi_addr_t`` in each local domain's AV."""

    index: int
    address: EngineAddress
    fi_addrs: tuple[int, ...]

    def __str__(self) -> str:
        return f"peer#{self.index}({self.address})"


class PeerGroup:
    """Peers with one remote region each, with pre-built write templates (see ``TransferEngine.peer_group``).

    ``len(group)`` peers; position ``i`` in the group is the ``peer_index`` used by ``scatter`` targets.
    """

    def __init__(self, engine: "TransferEngine", peers: Sequence[Peer], regions: Sequence[RemoteRegion]):
        n = len(peers)
        nd = engine.num_domains
        self.peers = tuple(peers)
        self.regions = tuple(regions)
        # Contiguous peer ranges per domain: position i -> domain i * nd // n.
        self.domain_of = tuple(i * nd // n for i in range(n))
        self._templates = (ctypes.c_uint64 * (_T_WORDS * n))()
        self._mv = _u64_view(self._templates)
        base_addr = ctypes.addressof(self._templates)
        mv = self._mv
        for i, (peer, region, d) in enumerate(zip(peers, regions, self.domain_of)):
            b = i * _T_WORDS
            addr0 = base_addr + 8 * b
            mv[b + _T_MSG_IOV] = addr0 + 8 * _T_IOV_BASE
            mv[b + _T_DESC] = addr0 + 8 * _T_DESC0
            mv[b + _T_IOV_COUNT] = 1
            mv[b + _T_ADDR] = peer.fi_addrs[d]
            mv[b + _T_RMA_IOV] = addr0 + 8 * _T_RMA_ADDR
            mv[b + _T_RMA_IOV_COUNT] = 1
            mv[b + _T_RMA_KEY] = region.keys[d % len(region.keys)]
        self.msg_addr = tuple(base_addr + 8 * _T_WORDS * i for i in range(n))
        self.remote_base = tuple(r.base for r in regions)
        # What the posting loop needs of peer i, in one tuple (one index and an unpack per write):
        # writemsg, endpoint, message address, byte offset of the words to patch, remote base, peer.
        self.post_info = tuple(
            (engine._eps[d].writemsg, engine._eps[d].ptr, self.msg_addr[i], 8 * (_T_WORDS * i + _T_CONTEXT),
             self.remote_base[i], peers[i]) for i, d in enumerate(self.domain_of))
        self.remote_nbytes = tuple(r.nbytes for r in regions)
        self.barrier_targets = tuple((i, 0, 0, 0) for i in range(n))
        # A peer's region in chunks: every write to this group patches its key too (`_post_table_chunked`).
        # Per peer: (stride, last chunk, chunk ends, chunk bases, chunk keys in the peer's domain).
        self.chunked = any(r.chunks > 1 for r in regions)
        self.remote_chunks = tuple(
            (r.chunk_stride, r.chunks - 1, _chunk_ends(r.nbytes, r.chunks, r.chunk_stride, r.chunk_bytes),
             r.chunk_bases, tuple(k[d % len(k)] for k in r.chunk_keys)) if r.chunks > 1 else
            (_ONE_CHUNK, 0, (r.nbytes,), (r.base,), (r.keys[d % len(r.keys)],))
            for r, d in zip(regions, self.domain_of))
        self._src = None  # LocalRegion whose descs are in the templates
        self._engine = engine

    def __len__(self) -> int:
        return len(self.peers)

    def _set_source(self, src: LocalRegion) -> None:
        # The desc (fi_mr_desc of the source MR in the peer's domain) changes only with the source.
        mv = self._mv
        for i, d in enumerate(self.domain_of):
            mv[i * _T_WORDS + _T_DESC0] = src.descs[d]
        self._src = src


class PeerTimeout(TimeoutError):
    """A write to one peer could not be posted in time; ``position`` is the peer's index in its group."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position


class ImmediateCounts:
    """Received immediates, counted by exact 32-bit value: the bookkeeping every engine shares
    (`TransferEngine`, the emulated NIC's `EmulatedEngine`). A subclass fills `_imm_counts` (value -> count,
    a value absent at 0) in its `progress()` and provides `_idle_progress()` and `timeout_s`."""

    _imm_counts: dict[int, int]
    timeout_s: float

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


class TransferEngine(ImmediateCounts):
    """RDMA-write engine over libfabric (see the module docstring).

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
    """

    def __init__(self, provider: str = "auto", num_domains: int = 1, *, domains: Sequence[str] | None = None,
                 tx_size: int | None = None,
                 cq_size: int = 4096, max_inflight: int | None = None, hmem: bool = False,
                 idle_yield: bool = False, timeout_s: float = 30.0, local_only: bool = False,
                 max_registration_bytes: int | None = None):
        if max_registration_bytes is None:
            max_registration_bytes = max_registration_from_env()
        if max_registration_bytes is not None and max_registration_bytes < 2 * PAGE_SIZE:
            raise ValueError(f"max_registration_bytes must be at least two pages ({2 * PAGE_SIZE} B), got "
                             f"{max_registration_bytes} (argument or {MAX_REGISTRATION_ENV})")
        if domains is not None:
            if isinstance(domains, str) or not domains or not all(isinstance(d, str) for d in domains):
                raise ValueError(f"domains must be a non-empty sequence of domain names, got {domains!r}")
            num_domains = len(domains)
        if num_domains < 1:
            raise ValueError(f"num_domains must be >= 1, got {num_domains}")
        if provider == "auto":
            provider = auto_provider()
        self.provider = provider
        self.num_domains = num_domains
        self.timeout_s = timeout_s
        self.post_timeout_s = timeout_s  # how long a post retries -FI_EAGAIN (shrink mode: shorter)
        self.idle_yield = idle_yield
        self.local_only = local_only
        self._closed = False
        self._regions: list[LocalRegion] = []
        self._peers: dict[EngineAddress, Peer] = {}
        self._domains: list = []
        self._cqs: list = []
        self._avs: list = []
        self._eps: list = []
        self._fabrics: list = []
        # One fi_info (and fabric) per named domain; unnamed: the first domain, opened num_domains times.
        self._infos: list = []
        try:
            for name in domains if domains is not None else [None]:
                self._infos.append(lf.getinfo(provider, hmem=hmem, tx_size=tx_size, domain=name,
                                              local_only=local_only))
        except BaseException:
            for info in self._infos:
                info.close()
            raise
        self.info = self._infos[0]
        self.provider_name = self.info.prov_name
        # Requested keys (used when the provider does not pick them, e.g. tcp, shm): random, of the
        # domain's mr_key_size bytes (at most 8), never reused within this engine.
        self._key_bits = 8 * min(max(int(self.info.mr_key_size), 1), 8)
        self._used_keys: set[int] = set()
        try:
            for info in self._infos:
                self._fabrics.append(lf.Fabric(info))
            for d in range(num_domains):
                dom = self._fabrics[d % len(self._fabrics)].domain()
                self._domains.append(dom)
                cq = dom.cq_open(cq_size)
                self._cqs.append(cq)
                av = dom.av_open(256)
                self._avs.append(av)
                ep = dom.endpoint()
                self._eps.append(ep)
                # One CQ for both directions: local write completions and remote-write immediates.
                ep.bind(cq.ptr, lf.FI_TRANSMIT | lf.FI_RECV, "cq")
                ep.bind(av.ptr, 0, "av")
                # Before fi_enable: the provider reads it when the endpoint starts (efa).
                cuda_api = ep.forbid_cuda_api()
                ep.enable()
            self.address = EngineAddress(self.provider_name, tuple(ep.getname() for ep in self._eps))
            self.domain_names = tuple(self._infos[d % len(self._infos)].domain_name for d in range(num_domains))
        except BaseException:
            self.close()
            raise
        lib = lf.library_info()
        # What this engine runs on, picklable (the proxy reports it to the model process with "ready").
        self.fabric_info = {
            "path": lib["path"], "source": lib["source"], "version": lib["version"],
            "api_version": lf.version_str(self.info.api_version), "provider": self.provider_name,
            "fabric": self.info.fabric_name, "domains": self.domain_names,
            "hmem": ("offered" if self.info.caps & lf.FI_HMEM else "not offered") if hmem else "not requested",
            "threading": lf.THREADING_NAMES.get(self.info.threading, str(self.info.threading)),
            "remote_only": self.info.remote_only, "cuda_api_permitted": cuda_api,
        }
        lf.log_fabric_once(self.fabric_info)
        # Completion bookkeeping.
        if max_inflight is None:
            max_inflight = min(cq_size // 2, 4096) * num_domains
        self.max_inflight = max_inflight
        self._ctx_pool = (ctypes.c_uint64 * (_CTX_WORDS * max_inflight))()
        self._ctx_base = ctypes.addressof(self._ctx_pool)
        # Free fi_context addresses (what a completion's op_context returns, so retiring a write is one
        # append), and the peer each posted context went to (for error messages).
        self._free_ctx = [self._ctx_base + 8 * _CTX_WORDS * i for i in range(max_inflight)]
        self._ctx_peer: dict[int, Peer] = {}
        self._cq_buf = (lf.fi_cq_data_entry * CQ_BATCH)()
        self._cq_buf_addr = ctypes.addressof(self._cq_buf)
        self._cq_mv = _u64_view(self._cq_buf)
        self._cq_calls = tuple((cq.read, cq.ptr, cq) for cq in self._cqs)
        self._imm_counts: dict[int, int] = {}
        self._prepared: dict = {}  # post_table's per-slot constants (`_prepared_table`)
        self.writes_posted = 0  # totals, for tests and benchmarks
        self.writes_completed = 0
        self.imms_received = 0
        self.eagain_retries = 0  # posts retried after -FI_EAGAIN (back-pressure or lazy connect)
        self.slot_waits = 0  # times posting waited for a free fi_context slot (max_inflight reached)
        # Bytes one write may carry (one iovec): the endpoint's max_msg_size, and EFA's bound on it.
        self.max_write_bytes = int(self.info.max_msg_size) or (1 << 63) - 1
        if self.provider_name == "efa":
            self.max_write_bytes = min(self.max_write_bytes, EFA_MAX_WRITE_BYTES)
        # Bytes one registration may span (None: no limit); over it `register` registers in chunks.
        self.max_registration_bytes = (default_max_registration_bytes(self.provider_name)
                                       if max_registration_bytes is None else max_registration_bytes)
        # A small buffer registered once: the source of zero-length writes (barriers); local only.
        self._scratch = ctypes.create_string_buffer(64)
        self._scratch_region = self.register(ctypes.addressof(self._scratch), 64, ACCESS_SOURCE)

    # ------------------------------------------------------------------ memory

    def register(self, addr: int, nbytes: int, access: int = ACCESS_SOURCE_AND_TARGET, *,
                 dmabuf_fd: int | None = None, cuda_device: int | None = None,
                 max_write_bytes: int | None = None) -> LocalRegion:
        """Register ``[addr, addr+nbytes)`` in every domain with ``access`` (``fi_mr_reg`` access bits).

        Give the least access the buffer needs: :data:`ACCESS_SOURCE` (``FI_WRITE``: a local source of
        our writes, peers cannot write or read it), :data:`ACCESS_TARGET` (``FI_REMOTE_WRITE``: peers
        write into it) or :data:`ACCESS_SOURCE_AND_TARGET` (the default). ``FI_REMOTE_READ`` is refused:
        nothing in the protocol reads remotely, and it would let any key holder read the buffer.
        Each MR gets a random 64-bit key (the provider's when it picks them, ``FI_MR_PROV_KEY``).

        Host memory by default. GPU memory with ``cuda_device`` set (``FI_HMEM_CUDA`` by virtual address;
        with ``dmabuf_fd`` by DMA-BUF, libfabric >= 1.20): raises :class:`~.libfabric.HmemUnsupported`
        when the provider/build cannot, so the caller can fall back to host-staged buffers.
        The memory must stay valid until the region is closed.

        Over ``max_registration_bytes`` (host and GPU memory alike) the buffer is registered in overlapping
        chunks, each within the limit, consecutive ones overlapping by at least the largest write
        (``max_write_bytes``: the engine's, or the caller's own bound on its writes if smaller), so every
        write of at most that size lies wholly in one chunk and is posted with that chunk's desc / key
        (`registration_chunks`). ``ValueError`` when the limit leaves no room for that overlap. A write
        into or from such a region that is larger and would cross chunks is refused when posted.
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
        bound = self.max_write_bytes if max_write_bytes is None else min(max_write_bytes, self.max_write_bytes)
        count, stride, chunk = registration_chunks(nbytes, self.max_registration_bytes, bound, addr % PAGE_SIZE)
        if count > 1 and dmabuf_fd is not None:
            # One DMA-BUF FD at offset 0 per registration: chunks would need fi_mr_dmabuf offsets (not wired).
            raise ValueError(f"register: {nbytes} B over max_registration_bytes ({self.max_registration_bytes} B) "
                             f"need {count} registrations; DMA-BUF registrations are not registered in chunks")
        chunks: list[list] = []
        try:
            for i in range(count):
                at, size = addr + i * stride, min(chunk, nbytes - i * stride)
                mrs: list = []
                chunks.append(mrs)
                for dom in self._domains:
                    key = 0 if self.info.prov_key else self._new_key()
                    if cuda_device is None and dmabuf_fd is None:
                        mr = dom.mr_reg(at, size, access, key)
                    else:
                        mr = dom.mr_regattr_cuda(at, size, access, key, cuda_device or 0, dmabuf_fd)
                    mrs.append(mr)
                    self._used_keys.add(mr.key)
        except BaseException:
            for m in (m for c in chunks for m in c):
                m.close()
            raise
        region = LocalRegion(self, addr, nbytes, chunks, access, stride, chunk)
        self._regions.append(region)
        return region

    def _new_key(self) -> int:
        """A random requested key of the domain's key size: nonzero, not used by this engine before
        (a collision would make fi_mr_reg fail with -FI_ENOKEY; at 64 bits it does not happen)."""
        while True:
            key = secrets.randbits(self._key_bits)
            if key and key not in self._used_keys:
                return key

    # ------------------------------------------------------------------ peers

    def connect(self, addresses: Iterable[EngineAddress]) -> list[Peer]:
        """Insert remote engines into the AVs (cached: connecting twice returns the same :class:`Peer`).

        Connections themselves are lazy (rxm connects on the first write; the engine retries
        ``-FI_EAGAIN`` meanwhile)."""
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
                fi_addrs = tuple(av.insert(a.names[d % len(a.names)]) for d, av in enumerate(self._avs))
                peer = Peer(len(self._peers), a, fi_addrs)
                self._peers[a] = peer
            out.append(peer)
        return out

    def peer_group(self, peers: Sequence[Peer], remote_regions: Sequence[RemoteRegion]) -> PeerGroup:
        """A group of peers, each with the remote region its writes land in. Raises ``ValueError`` for an
        unknown peer or a region of the wrong type/provider/domain count."""
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
            if r.provider != self.provider_name or len(r.keys) != len(p.address.names):
                raise ValueError(f"peer_group: position {i}: region of provider {r.provider!r} with "
                                 f"{len(r.keys)} keys does not match {p} ({len(p.address.names)} domains)")
            n = len(r.chunk_keys)
            if (r.chunk_keys or r.chunk_bases or r.chunk_stride) and not (
                    n > 1 and len(r.chunk_bases) == n and r.chunk_keys[0] == r.keys
                    and all(len(k) == len(r.keys) for k in r.chunk_keys)
                    and 0 < r.chunk_stride <= r.chunk_bytes < r.nbytes <= (n - 1) * r.chunk_stride + r.chunk_bytes):
                raise ValueError(f"peer_group: position {i}: region of {r.nbytes} B in {n} chunks of "
                                 f"{r.chunk_bytes} B every {r.chunk_stride} B with {len(r.chunk_bases)} bases: "
                                 f"the chunks do not describe it")
        return PeerGroup(self, peers, remote_regions)

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
        anything is posted (``ValueError``). ``-FI_EAGAIN`` (queue full,
        rxm not yet connected) is absorbed by progressing the CQs and retrying, up to ``timeout_s``.
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
        if grp.chunked or src.chunks > 1:
            self._scatter_chunked(grp, src, targets, imm, imms)
            return
        if grp._src is not src:
            grp._set_source(src)
        # Hot loop. Measured on the 2-core CI VM (interleaved minimum, null C function in place of
        # fi_writemsg): 0.41 µs for the bare ctypes call; the whole loop per write is in
        # docs/transport.md. Hence: locals only, one tuple per peer, one struct.pack_into for the six
        # contiguous words of the peer's template that change per write, free contexts as addresses.
        pack = _PATCH.pack_into
        templates = grp._templates
        info = grp.post_info
        pop = self._free_ctx.pop
        ctx_peer = self._ctx_peer
        src_addr = src.addr
        flags = _WRITE_FLAGS
        for (p, so, length, do), v in zip(targets, repeat(imm) if imms is None else imms):
            writemsg, ep, msg, off, rbase, peer = info[p]
            try:
                ctx = pop()
            except IndexError:  # max_inflight writes in flight: progress until one completes
                ctx = self._wait_ctx()
            ctx_peer[ctx] = peer
            # context (this op's fi_context), data (the immediate), iov_base, iov_len, rma addr, rma len
            pack(templates, off, ctx, v, src_addr + so, length, rbase + do, length)
            rc = writemsg(ep, msg, flags)
            if rc:
                self._post_failed(rc, grp, p, ctx, v)
        self.writes_posted += n_targets

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
        ``max_write_bytes`` too (``ValueError``, nothing of it posted) since a corrupt count row of a peer
        shapes it. The hot path of the proxy: no allocation,
        no arithmetic beyond the bases (docs/protocol.md, "Write tables").
        """
        if grp.chunked or getattr(src, "chunks", 1) > 1:
            return self._post_table_chunked(grp, src, words, slots, src_base, dst_base, imm, skip_empty)
        rows, templates, src_addr, src_lim = self._prepared_table(grp, src, slots, src_base, dst_base)
        pack, max_len = _PATCH.pack_into, self.max_write_bytes
        pop, ctx_peer = self._free_ctx.pop, self._ctx_peer
        posted = 0
        for b, p, writemsg, ep, msg, off, rbase, peer, dst_lim in rows:
            so, length, do, v = words[b], words[b + 1], words[b + 2], words[b + 3]
            if skip_empty and not length:
                continue
            if imm is not None:
                v = imm
            if (so | length | do) < 0 or so + length > src_lim or do + length > dst_lim or length > max_len:
                raise ValueError(self._bad_target(grp, src, (p, so + src_base, length, do + dst_base)))
            try:
                ctx = pop()
            except IndexError:  # max_inflight writes in flight: progress until one completes
                ctx = self._wait_ctx()
            ctx_peer[ctx] = peer
            pack(templates, off, ctx, v, src_addr + so, length, rbase + do, length)
            rc = writemsg(ep, msg, _WRITE_FLAGS)
            if rc:
                self._post_failed(rc, grp, p, ctx, v)
            posted += 1
        self.writes_posted += posted
        return posted

    def _prepared_table(self, grp: PeerGroup, src: LocalRegion, slots, src_base: int, dst_base: int):
        """What `post_table` needs per slot that does not change per call (the peer's post info, the
        bases, the bounds), remembered per (slots, group, source, bases): one lookup per call."""
        if grp._src is not src:
            if not isinstance(src, LocalRegion) or src._engine is not self or not src._mrs:
                raise ValueError(f"src must be an open LocalRegion of this engine, got {src!r}")
            grp._set_source(src)
        key = (id(slots), id(grp), id(src), src_base, dst_base)
        hit = self._prepared.get(key)
        if hit is not None and hit[0] is slots:
            return hit[1]
        if not isinstance(src, LocalRegion) or src._engine is not self or not src._mrs:
            raise ValueError(f"src must be an open LocalRegion of this engine, got {src!r}")
        info, n = grp.post_info, len(grp.peers)
        rows = []
        for p, b in slots:
            if not 0 <= p < n:
                raise ValueError(f"post_table slot {(p, b)}: peer index {p} outside the group of {n} peers")
            writemsg, ep, msg, off, rbase, peer = info[p]
            rows.append((b, p, writemsg, ep, msg, off, rbase + dst_base, peer, grp.remote_nbytes[p] - dst_base))
        prep = (tuple(rows), grp._templates, src.addr + src_base, src.nbytes - src_base)
        self._prepared[key] = (slots, prep)
        return prep

    # ---- regions in chunks (over max_registration_bytes): the key, desc and address follow each write

    def _post_table_chunked(self, grp: PeerGroup, src: LocalRegion, words, slots, src_base: int, dst_base: int,
                            imm: int | None, skip_empty: bool) -> int:
        """`post_table` where the source or a peer's region is registered in chunks: per write, the chunk
        that holds it on each side (`registration_chunks`: a write no larger than the regions' bound lies
        wholly in one) gives the source desc, the remote key and the remote address (relative to the chunk
        without FI_MR_VIRT_ADDR); the eight words are patched together. A write that would cross chunks is
        refused (``ValueError``), never split: its immediate would arrive twice."""
        rows, templates, src_addr = self._prepared_chunked(grp, src, slots)
        grp._src = None  # the templates' descs now change per write: the fast path sets its own again
        pack, max_len = _PATCH_CHUNKED.pack_into, self.max_write_bytes
        pop, ctx_peer = self._free_ctx.pop, self._ctx_peer
        posted = 0
        for b, p, writemsg, ep, msg, off, peer, (d_stride, d_last, d_ends, d_bases, d_keys), \
                (s_stride, s_last, s_ends, s_descs) in rows:
            so, length, do, v = words[b], words[b + 1], words[b + 2], words[b + 3]
            if skip_empty and not length:
                continue
            if imm is not None:
                v = imm
            if (so | length | do) < 0 or length > max_len:
                raise ValueError(self._bad_target(grp, src, (p, so + src_base, length, do + dst_base)))
            so += src_base
            do += dst_base
            ks, kd = so // s_stride, do // d_stride
            if ks > s_last:
                ks = s_last
            if kd > d_last:
                kd = d_last
            if so + length > s_ends[ks] or do + length > d_ends[kd]:
                raise ValueError(self._bad_target(grp, src, (p, so, length, do)))
            try:
                ctx = pop()
            except IndexError:
                ctx = self._wait_ctx()
            ctx_peer[ctx] = peer
            pack(templates, off, ctx, v, src_addr + so, length, d_bases[kd] + do - kd * d_stride, length,
                 d_keys[kd], s_descs[ks])
            rc = writemsg(ep, msg, _WRITE_FLAGS)
            if rc:
                self._post_failed(rc, grp, p, ctx, v)
            posted += 1
        self.writes_posted += posted
        return posted

    def _prepared_chunked(self, grp: PeerGroup, src: LocalRegion, slots):
        """`_prepared_table` for `_post_table_chunked`: per slot its post info and both chunk tables."""
        if not isinstance(src, LocalRegion) or src._engine is not self or not src._mrs:
            raise ValueError(f"src must be an open LocalRegion of this engine, got {src!r}")
        key = (id(slots), id(grp), id(src), "chunked")
        hit = self._prepared.get(key)
        if hit is not None and hit[0] is slots:
            return hit[1]
        info, n = grp.post_info, len(grp.peers)
        rows = []
        for p, b in slots:
            if not 0 <= p < n:
                raise ValueError(f"post_table slot {(p, b)}: peer index {p} outside the group of {n} peers")
            writemsg, ep, msg, off, _, peer = info[p]
            rows.append((b, p, writemsg, ep, msg, off, peer, grp.remote_chunks[p],
                         src._chunk_table[grp.domain_of[p]]))
        prep = (tuple(rows), grp._templates, src.addr)
        self._prepared[key] = (slots, prep)
        return prep

    def _scatter_chunked(self, grp: PeerGroup, src: LocalRegion, targets, imm, imms) -> None:
        """`scatter` where the source or a peer's region is registered in chunks (see `_post_table_chunked`):
        every target is placed in its chunks, and refused if it would cross them, before any is posted."""
        words = []
        for p, so, length, do in targets:
            words += (so, length, do, 0)
        slots = tuple((t[0], 4 * i) for i, t in enumerate(targets))
        for p, b in slots:  # bounds were checked (_validate): only the chunks are left to check
            so, length, do = words[b:b + 3]
            d_stride, d_last, d_ends = grp.remote_chunks[p][:3]
            s_stride, s_last, s_ends = src._chunk_table[grp.domain_of[p]][:3]
            if so + length > s_ends[min(so // s_stride, s_last)] or do + length > d_ends[min(do // d_stride, d_last)]:
                raise ValueError(self._bad_target(grp, src, (p, so, length, do)))
        if imms is not None:
            for i, v in enumerate(imms):
                words[4 * i + 3] = v
        try:
            self._post_table_chunked(grp, src, words, slots, 0, 0, imm if imms is None else None, False)
        finally:  # these slots are this call's only: nothing to keep prepared
            self._prepared.pop((id(slots), id(grp), id(src), "chunked"), None)

    def barrier(self, grp: PeerGroup, imm: int) -> None:
        """Post a zero-length write carrying ``imm`` to every peer of ``grp`` (the receivers count it)."""
        self.scatter(grp, self._scratch_region, grp.barrier_targets, imm)

    def _validate(self, grp: PeerGroup, src: LocalRegion, targets) -> None:
        if not isinstance(grp, PeerGroup):
            raise ValueError(f"expected a PeerGroup, got {type(grp).__name__}")
        if not isinstance(src, LocalRegion) or src._engine is not self or not src._mrs:
            raise ValueError(f"src must be an open LocalRegion of this engine, got {src!r}")
        n_peers = len(grp.peers)
        src_n = src.nbytes
        rsize, max_len = grp.remote_nbytes, self.max_write_bytes
        for t in targets:
            p, so, length, do = t
            # (a | b | c | d) < 0 iff any is negative: one test instead of four (this pass is ~15% of
            # the posting cost).
            if (p | so | length | do) < 0 or p >= n_peers or so + length > src_n or do + length > rsize[p] \
                    or length > max_len:
                raise ValueError(self._bad_target(grp, src, (p, so, length, do)))

    @staticmethod
    def _bad_target(grp: PeerGroup, src: LocalRegion, t) -> str:
        p, so, length, do = t
        if not 0 <= p < len(grp.peers):
            return f"scatter target {t}: peer index {p} outside the group of {len(grp.peers)} peers"
        if length > grp._engine.max_write_bytes:
            return (f"scatter target {t}: {length} B is more than one write may carry over "
                    f"{grp._engine.provider_name!r} ({grp._engine.max_write_bytes} B, max_write_bytes)")
        if min(so, length, do) >= 0 and so + length <= src.nbytes and do + length <= grp.remote_nbytes[p]:
            # In bounds: it crosses from one registration chunk into the next on one side (never split).
            r, s_ends = grp.regions[p], src._chunk_table[0][2]
            side = (f"the source's {src.chunks} chunks of {src.chunk_bytes} B every {src.chunk_stride} B"
                    if src.chunks > 1 and so + length > s_ends[min(so // src.chunk_stride, src.chunks - 1)]
                    else f"the {r.chunks} chunks of {r.chunk_bytes} B every {r.chunk_stride} B at {grp.peers[p]}")
            return (f"scatter target {t} (peer_index, src_offset, length, dst_offset): crosses from one "
                    f"registration chunk into the next ({side}; the overlap of two chunks bounds a write); a "
                    f"write is never split (its immediate would arrive twice)")
        return (f"scatter target {t} (peer_index, src_offset, length, dst_offset): source range "
                f"[{so}, {so + length}) of {src.nbytes} B, destination range [{do}, {do + length}) of "
                f"{grp.remote_nbytes[p]} B at {grp.peers[p]}: out of bounds or negative")

    def _post_failed(self, rc: int, grp: PeerGroup, p: int, ctx: int, imm: int) -> None:
        """Slow path of a post: retry ``-FI_EAGAIN`` while progressing; raise anything else."""
        deadline = time.monotonic() + self.post_timeout_s
        writemsg, ep, msg = grp.post_info[p][:3]
        while rc == _NEG_EAGAIN:
            self.eagain_retries += 1
            self._idle_progress()
            if time.monotonic() > deadline:
                break
            rc = writemsg(ep, msg, _WRITE_FLAGS)
        if rc:
            self._free_ctx.append(ctx)
            if rc == _NEG_EAGAIN:
                raise PeerTimeout(f"fi_writemsg to {grp.peers[p]} returned -FI_EAGAIN for {self.post_timeout_s}s "
                                  f"(peer not progressing or not reachable) [imm {imm:#x}]", position=p)
            raise lf.FabricError("fi_writemsg", rc, peer=grp.peers[p], context=f"imm {imm:#x}")

    def _wait_ctx(self) -> int:
        """Progress until a write completes; return its (now free) fi_context address."""
        self.slot_waits += 1
        deadline = time.monotonic() + self.timeout_s
        while not self._free_ctx:
            self._idle_progress()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.max_inflight} writes in flight and none completed within "
                                   f"{self.timeout_s}s (peers not progressing?)")
        return self._free_ctx.pop()

    # ------------------------------------------------------------------ completions

    def progress(self) -> int:
        """Read each CQ once (up to ``CQ_BATCH`` entries): count received immediates, retire local
        write completions. Returns the number of entries handled. Raises
        :class:`~.libfabric.FabricError` for an error completion, naming the peer of the failed write
        when it was ours."""
        handled = 0
        for read, cq_ptr, cq in self._cq_calls:
            n = read(cq_ptr, self._cq_buf_addr, CQ_BATCH)
            if n > 0:
                self._consume(n)
                handled += n
            elif n != _NEG_EAGAIN:
                if n == _NEG_EAVAIL:
                    self._raise_cq_error(cq)
                raise lf.FabricError("fi_cq_read", n)
        return handled

    def _idle_progress(self) -> None:
        """progress() inside a wait loop: when nothing happened and ``idle_yield`` is set, give the
        core away (sched_yield). Measured on 2 cores with 3 busy-polling processes: without it a
        scatter+barrier round takes ~16 ms (time slices), with it well under 1 ms."""
        if not self.progress() and self.idle_yield:
            _sched_yield()

    def _consume(self, n: int) -> None:
        mv = self._cq_mv
        counts = self._imm_counts
        free = self._free_ctx
        remote_flag = lf.FI_REMOTE_WRITE
        n_local = 0
        for i in range(0, n * _ENTRY_U64, _ENTRY_U64):
            # Classify by FI_REMOTE_WRITE: some providers also flag FI_REMOTE_CQ_DATA on the initiator.
            if mv[i + 1] & remote_flag:
                v = mv[i + 4] & _IMM_MASK
                counts[v] = counts.get(v, 0) + 1
            else:
                free.append(mv[i])  # op_context: the write's fi_context address
                n_local += 1
        self.writes_completed += n_local
        self.imms_received += n - n_local

    def _raise_cq_error(self, cq) -> None:
        entry, msg = cq.readerr()
        peer, what = None, "remote write" if entry.flags & lf.FI_REMOTE_WRITE else "write"
        ctx = entry.op_context or 0
        if ctx and 0 <= ctx - self._ctx_base < 8 * _CTX_WORDS * self.max_inflight:
            peer = self._ctx_peer.get(ctx)
            self._free_ctx.append(ctx)
            self.writes_completed += 1
        raise lf.FabricError("fi_cq_read", -entry.err, msg, peer=peer,
                             context=f"{what}, {entry.len} B, imm {entry.data & _IMM_MASK:#x}")

    @property
    def writes_pending(self) -> int:
        """Writes posted and not yet completed locally."""
        return self.max_inflight - len(self._free_ctx)

    def wait_writes(self, timeout_s: float | None = None) -> None:
        """Progress until every posted write completed locally (its source buffer may be reused)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        free = self._free_ctx
        while len(free) < self.max_inflight:
            self._idle_progress()
            if time.monotonic() > deadline:
                raise TimeoutError(f"wait_writes: {self.writes_pending} writes still in flight after "
                                   f"{timeout_s:g}s")

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Close endpoints, AVs, CQs, MRs, domains, fabric (that order: each needs the next). Idempotent.

        Writes still in flight are abandoned (call ``wait_writes`` first for a clean drain)."""
        if self._closed:
            return
        self._closed = True
        for obj in (*self._eps, *self._avs, *self._cqs):
            obj.close()
        for r in list(self._regions):
            r.close()
        for obj in self._domains:
            obj.close()
        for fabric in self._fabrics:
            fabric.close()
        for info in self._infos:
            info.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("TransferEngine is closed")

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TransferEngine({self.provider_name}, domains={self.num_domains}, "
                f"mr_mode={self.info.mr_mode:#x}, pending={self.writes_pending if not self._closed else 0})")


def auto_provider() -> str:
    """``"efa"`` if present, else ``"shm"``, else ``"tcp"`` (only providers we tested as RDM+RMA)."""
    names = lf.list_providers()
    for want in ("efa", "shm", "tcp;ofi_rxm"):
        if want in names:
            return {"tcp;ofi_rxm": "tcp"}.get(want, want)
    raise lf.FabricError("fi_getinfo", -lf.FI_ENODATA, f"none of efa, shm, tcp available (found {names})")
