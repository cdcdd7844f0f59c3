"""FabricCarrier: the libfabric carrier of `engine.TransferEngine` (efa, verbs, tcp, shm).

How bytes and immediates move over libfabric; the engine (regions, peers, validation, immediate counts,
waits) is `engine.py`.

- Registration: ``fi_mr_reg`` in every domain, with a random 64-bit key per MR (or the provider's own,
  ``FI_MR_PROV_KEY``): a key is a capability (whoever reaches the endpoint and knows it may write the
  region), so it must not be guessable. A buffer larger than the provider allows in one registration
  (``max_registration_bytes``; EFA: 2^20 pages) is registered in overlapping chunks
  (:func:`registration_chunks`): every write lies wholly in one chunk.
- Peers: ``fi_av_insert`` per domain; a peer group gets one ``fi_msg_rma`` template per peer, pre-built,
  so a posted write only patches five integers (`prepare_group`).
- Posting: one ``fi_writemsg`` with ``FI_REMOTE_CQ_DATA`` per write; a write refused with ``-FI_EAGAIN`` is
  set aside and the rest of the call posted first, then the ones set aside are retried, at most
  ``POSTS_PER_PASS`` per pass with a progress between passes, each up to the engine's ``post_timeout_s``
  (then `PeerTimeout` naming every such peer: one busy peer does not hold up the others); at most
  ``max_inflight`` writes in flight (one ``fi_context`` each).
- Completions: one CQ per domain for both directions: ``FI_REMOTE_WRITE`` entries are immediates (counted
  into the engine's counter by exact value), the others retire our writes. An error entry raises, or, when
  the engine keeps ``peer_errors`` (shrink mode) and the entry names one of our writes, is recorded there
  against its peer and the call goes on.
- GPU memory (``hmem``): ``FI_OPT_CUDA_API_PERMITTED`` must be accepted, and efa needs libfabric >= 1.20 (or
  ``FI_EFA_SET_CUDA_SYNC_MEMOPS=0``), else :class:`~.libfabric.HmemUnsupported` at construction; buffers
  register by DMA-BUF fd (``FI_MR_DMABUF``, API >= 1.20) when the caller has one, else by address.

Software providers (tcp, shm) move data only while the *target* reads its CQ, so every wait of the
engine progresses all CQs.

Domains: with ``num_domains > 1`` (EFA: two or more NICs per GPU) the peers of a group are sharded over
domains in contiguous ranges; local domain ``d`` always talks to the remote engine's domain
``d % remote_num_domains``, so keys and addresses pair up.
"""
from __future__ import annotations

import ctypes
import secrets
import struct
import time
from collections.abc import Sequence
from itertools import repeat

from . import libfabric as lf
from .engine import EngineAddress, LocalRegion, Peer, PeerGroup, PeerTimeout, RemoteRegion, use_default_carrier
from .fabric_chunks import (_ONE_CHUNK, _WRITE_FLAGS, MAX_REGISTRATION_ENV, PAGE_SIZE, ChunkedPosting, slot_peers,
                            FabricRegistration, _chunk_ends, check_chunks,
                            default_max_registration_bytes, max_registration_from_env, registration_chunks)

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
# Every write is one iovec and one fi_rma_iov: EFA writes in hardware only a single iovec (it emulates
# more with sends, reading a GPU source from the CPU), so a private write's count row sits in the
# source buffer in front of its rows (config.Layout, private staging) rather than in a second iovec.
# A write larger than EFA's bound is split by EFA, its immediate arriving more than once: refused.
EFA_MAX_WRITE_BYTES = 1 << 30
_CTX_WORDS = 4  # struct fi_context: 4 pointers; FI_CONTEXT mode needs one per outstanding op
_IMM_MASK = 0xFFFFFFFF
_NEG_EAGAIN = -lf.FI_EAGAIN
_NEG_EAVAIL = -lf.FI_EAVAIL
# Writes set aside after -FI_EAGAIN that one retry pass posts before progressing again (pplx-garden's
# fabric-lib posts at most 32 queued work requests per progress pass).
POSTS_PER_PASS = 32



def _u64_view(ctypes_array) -> memoryview:
    return memoryview(ctypes_array).cast("B").cast("Q")


def auto_provider() -> str:
    """``"efa"`` if present, else ``"shm"``, else ``"tcp"`` (only providers we tested as RDM+RMA)."""
    names = lf.list_providers()
    for want in ("efa", "shm", "tcp;ofi_rxm"):
        if want in names:
            return {"tcp;ofi_rxm": "tcp"}.get(want, want)
    raise lf.FabricError("fi_getinfo", -lf.FI_ENODATA, f"none of efa, shm, tcp available (found {names})")


class FabricCarrier(ChunkedPosting):
    """Writes and immediates over libfabric (see the module docstring); the arguments are
    `TransferEngine`'s."""

    def __init__(self, provider: str = "auto", num_domains: int = 1, *, domains: Sequence[str] | None = None,
                 tx_size: int | None = None, cq_size: int = 4096, max_inflight: int | None = None,
                 hmem: bool = False, local_only: bool = False, max_registration_bytes: int | None = None):
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
        self.local_only = local_only
        self.engine = None
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
            if hmem and self.provider_name == "efa":  # refused before anything is opened, naming the floor
                why = lf.efa_gpu_refusal(lf.library().fi_version())
                if why:
                    raise lf.HmemUnsupported("fi_getinfo", -lf.FI_EOPNOTSUPP, why)
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
                # Before fi_enable: the provider reads it when the endpoint starts (efa). With GPU buffers
                # asked for, a refusal raises HmemUnsupported: the caller stages or refuses (`buffers=`).
                cuda_api = ep.forbid_cuda_api(hmem)
                ep.enable()
            self.address = EngineAddress(self.provider_name, tuple(ep.getname() for ep in self._eps),
                                         fabric=self._fabric_label())
            self.domain_names = tuple(self._infos[d % len(self._infos)].domain_name for d in range(num_domains))
        except BaseException:
            self.close([])
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
        self._prepared: dict = {}  # post_table's per-slot constants (`_prepared_table`)
        # Bytes one write may carry (one iovec): the endpoint's max_msg_size, and EFA's bound on it.
        self.max_write_bytes = int(self.info.max_msg_size) or (1 << 63) - 1
        if self.provider_name == "efa":
            self.max_write_bytes = min(self.max_write_bytes, EFA_MAX_WRITE_BYTES)
        # Bytes one registration may span (None: no limit); over it `register` registers in chunks.
        self.max_registration_bytes = (default_max_registration_bytes(self.provider_name)
                                       if max_registration_bytes is None else max_registration_bytes)
        self.waiting_for = ""  # wait_writes' message: nothing to add
        # Writes refused with -FI_EAGAIN, set aside until the rest of the call is posted: (group position,
        # when first refused, what re-posts it); and how many of the call's rows were not posted after all.
        self._deferred: list = []
        self._lost = 0

    def _fabric_label(self) -> str:
        """What every peer must share with us (`EngineAddress.fabric`): on efa the libfabric version and
        the EFA device generation (PCI device id of each domain's NIC), since a peer of another version or
        generation makes EFA emulate writes with sends, whose protocol reads our unregistered source. Other
        providers: "" (nothing compared)."""
        if self.provider_name != "efa":
            return ""
        major, minor = lf.runtime_version()
        devices = sorted({i.device_id or "unknown" for i in self._infos})
        return f"libfabric {major}.{minor}, EFA device {'/'.join(devices)}"

    def attach(self, engine) -> None:
        """The engine whose immediate counts and totals this carrier fills."""
        self.engine = engine
        self._imm_counts = engine._imm_counts

    # ------------------------------------------------------------------ memory

    def register(self, addr: int, nbytes: int, access: int, *, dmabuf_fd: int | None = None,
                 cuda_device: int | None = None, max_write_bytes: int | None = None) -> LocalRegion:
        """``fi_mr_reg`` in every domain (access checked by the engine). Host memory by default. GPU memory
        with ``cuda_device`` set (``FI_HMEM_CUDA`` by virtual address; with ``dmabuf_fd`` by DMA-BUF,
        libfabric >= 1.20): raises :class:`~.libfabric.HmemUnsupported` when the provider/build cannot, so
        the caller can fall back to host-staged buffers.

        Over ``max_registration_bytes`` (host and GPU memory alike) the buffer is registered in overlapping
        chunks, each within the limit, consecutive ones overlapping by at least the largest write
        (``max_write_bytes``: the engine's, or the caller's own bound on its writes if smaller), so every
        write of at most that size lies wholly in one chunk and is posted with that chunk's desc / key
        (`registration_chunks`). ``ValueError`` when the limit leaves no room for that overlap. A write
        into or from such a region that is larger and would cross chunks is refused when posted.
        """
        eng_bound = self.engine.max_write_bytes
        bound = eng_bound if max_write_bytes is None else min(max_write_bytes, eng_bound)
        count, stride, chunk = registration_chunks(nbytes, self.max_registration_bytes, bound, addr % PAGE_SIZE)
        # By DMA-BUF where the caller has an fd of the buffer (from its first byte) and the API has FI_MR_DMABUF
        # (1.20): chunk i at offset i * stride into it, as the address path registers addr + i * stride.
        # Else by address (GPU memory then needs a peer-memory module on efa up to libfabric 2.4).
        by_dmabuf = dmabuf_fd is not None and self.info.api_version >= lf.FI_VERSION(1, 20)
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
                    elif by_dmabuf:
                        mr = dom.mr_regattr_cuda(at, size, access, key, cuda_device or 0, dmabuf_fd, i * stride,
                                                 dmabuf_base=addr)
                    else:
                        mr = dom.mr_regattr_cuda(at, size, access, key, cuda_device or 0)
                    mrs.append(mr)
                    self._used_keys.add(mr.key)
        except BaseException:
            for m in (m for c in chunks for m in c):
                m.close()
            raise
        reg = FabricRegistration(nbytes, chunks, stride, chunk)
        return LocalRegion(self.engine, addr, nbytes, access, reg, count, stride, chunk)

    def _new_key(self) -> int:
        """A random requested key of the domain's key size: nonzero, not used by this engine before
        (a collision would make fi_mr_reg fail with -FI_ENOKEY; at 64 bits it does not happen)."""
        while True:
            key = secrets.randbits(self._key_bits)
            if key and key not in self._used_keys:
                return key

    def descriptor(self, region: LocalRegion) -> RemoteRegion:
        """The region's keys and remote addresses per chunk (see `RemoteRegion`)."""
        reg = region.reg
        virt = self.info.virt_addr
        base = region.addr if virt else 0
        if region.chunks == 1:
            return RemoteRegion(self.provider_name, region.nbytes, base, reg.keys)
        bases = tuple(region.addr + i * region.chunk_stride if virt else 0 for i in range(region.chunks))
        return RemoteRegion(self.provider_name, region.nbytes, base, reg.keys, region.chunk_stride,
                            region.chunk_bytes, bases, reg.chunk_keys)

    # ------------------------------------------------------------------ peers

    def connect(self, address: EngineAddress) -> tuple[int, ...]:
        """Insert a remote engine into every domain's AV: its ``fi_addr_t`` per domain."""
        return tuple(av.insert(address.names[d % len(address.names)]) for d, av in enumerate(self._avs))

    def check_region(self, i: int, p: Peer, r: RemoteRegion) -> None:
        """Refuse a region of another provider, with another number of keys, or whose chunks do not add up."""
        if r.provider != self.provider_name or len(r.keys) != len(p.address.names):
            raise ValueError(f"peer_group: position {i}: region of provider {r.provider!r} with "
                             f"{len(r.keys)} keys does not match {p} ({len(p.address.names)} domains)")
        check_chunks(i, r)

    def prepare_group(self, grp: PeerGroup) -> None:
        """Build the group's write templates: per peer one ``fi_msg_rma`` (with its iovec, rma iov and desc
        slot) as 14 words, and the tuple the posting loop reads per write (``grp.post_info``)."""
        peers, regions = grp.peers, grp.regions
        n, nd = len(peers), self.num_domains
        # Contiguous peer ranges per domain: position i -> domain i * nd // n.
        grp.domain_of = tuple(i * nd // n for i in range(n))
        grp._templates = (ctypes.c_uint64 * (_T_WORDS * n))()
        grp._mv = mv = _u64_view(grp._templates)
        base_addr = ctypes.addressof(grp._templates)
        for i, (peer, region, d) in enumerate(zip(peers, regions, grp.domain_of)):
            b = i * _T_WORDS
            addr0 = base_addr + 8 * b
            mv[b + _T_MSG_IOV] = addr0 + 8 * _T_IOV_BASE
            mv[b + _T_DESC] = addr0 + 8 * _T_DESC0
            mv[b + _T_IOV_COUNT] = 1
            mv[b + _T_ADDR] = peer.link[d]
            mv[b + _T_RMA_IOV] = addr0 + 8 * _T_RMA_ADDR
            mv[b + _T_RMA_IOV_COUNT] = 1
            mv[b + _T_RMA_KEY] = region.keys[d % len(region.keys)]
        grp.msg_addr = tuple(base_addr + 8 * _T_WORDS * i for i in range(n))
        grp.remote_base = tuple(r.base for r in regions)
        # What the posting loop needs of peer i, in one tuple (one index and an unpack per write):
        # writemsg, endpoint, message address, byte offset of the words to patch, remote base, peer.
        grp.post_info = tuple(
            (self._eps[d].writemsg, self._eps[d].ptr, grp.msg_addr[i], 8 * (_T_WORDS * i + _T_CONTEXT),
             grp.remote_base[i], peers[i]) for i, d in enumerate(grp.domain_of))
        # A peer's region in chunks: every write to this group patches its key too (`_post_table_chunked`).
        # Per peer: (stride, last chunk, chunk ends, chunk bases, chunk keys in the peer's domain).
        grp.chunked = any(r.chunks > 1 for r in regions)
        grp.remote_chunks = tuple(
            (r.chunk_stride, r.chunks - 1, _chunk_ends(r.nbytes, r.chunks, r.chunk_stride, r.chunk_bytes),
             r.chunk_bases, tuple(k[d % len(k)] for k in r.chunk_keys)) if r.chunks > 1 else
            (_ONE_CHUNK, 0, (r.nbytes,), (r.base,), (r.keys[d % len(r.keys)],))
            for r, d in zip(regions, grp.domain_of))
        grp._src = None  # LocalRegion whose descs are in the templates

    @staticmethod
    def _set_source(grp: PeerGroup, src: LocalRegion) -> None:
        # The desc (fi_mr_desc of the source MR in the peer's domain) changes only with the source.
        mv, descs = grp._mv, src.reg.descs
        for i, d in enumerate(grp.domain_of):
            mv[i * _T_WORDS + _T_DESC0] = descs[d]
        grp._src = src

    # ------------------------------------------------------------------ posting

    def scatter(self, grp: PeerGroup, src: LocalRegion, targets, imm, imms) -> None:
        """One ``fi_writemsg`` per target (validated by the engine): `TransferEngine.scatter`."""
        if grp.chunked or src.chunks > 1:
            self._scatter_chunked(grp, src, targets, imm, imms)
            return
        if grp._src is not src:
            self._set_source(grp, src)
        # Hot loop. Measured on the 2-core CI VM (interleaved minimum, null C function in place of
        # fi_writemsg): 0.41 µs for the bare ctypes call; the whole loop per write is in
        # docs/transport.md. Hence: locals only, one tuple per peer, one struct.pack_into for the six
        # contiguous words of the peer's template that change per write, free contexts as addresses.
        pack, templates, info, flags = _PATCH.pack_into, grp._templates, grp.post_info, _WRITE_FLAGS
        free, ctx_peer, src_addr = self._free_ctx, self._ctx_peer, src.addr
        pop = free.pop
        for (p, so, length, do), v in zip(targets, repeat(imm) if imms is None else imms):
            writemsg, ep, msg, off, rbase, peer = info[p]
            ctx = pop() if free else self._wait_ctx()  # none free: max_inflight in flight, progress
            ctx_peer[ctx] = peer
            # context (this op's fi_context), data (the immediate), iov_base, iov_len, rma addr, rma len
            pack(templates, off, ctx, v, src_addr + so, length, rbase + do, length)
            if rc := writemsg(ep, msg, flags):
                self._post_failed(rc, grp, p, ctx, (pack, templates, off, writemsg, ep, msg,
                                                    (v, src_addr + so, length, rbase + do, length)))
        posted = len(targets)
        if self._deferred or self._lost:
            posted = self._settle(grp, posted)
        self.engine.writes_posted += posted

    def post_table(self, grp: PeerGroup, src: LocalRegion, words, slots, src_base: int, dst_base: int,
                   imm: int | None, skip_empty: bool) -> int:
        """`TransferEngine.post_table`: each row bounds-checked as it is posted."""
        if grp.chunked or getattr(src, "chunks", 1) > 1:
            return self._post_table_chunked(grp, src, words, slots, src_base, dst_base, imm, skip_empty)
        rows, templates, src_addr, src_lim = self._prepared_table(grp, src, slots, src_base, dst_base)
        eng = self.engine
        pack, max_len = _PATCH.pack_into, eng.max_write_bytes
        free = self._free_ctx
        pop, ctx_peer = free.pop, self._ctx_peer
        posted = 0
        for b, p, writemsg, ep, msg, off, rbase, peer, dst_lim in rows:
            so, length, do, v = words[b], words[b + 1], words[b + 2], words[b + 3]
            if skip_empty and not length:
                continue
            if imm is not None:
                v = imm
            if (so | length | do) < 0 or so + length > src_lim or do + length > dst_lim or length > max_len:
                raise ValueError(eng.bad_target(grp, src, (p, so + src_base, length, do + dst_base)))
            ctx = pop() if free else self._wait_ctx()  # none free: max_inflight in flight, progress
            ctx_peer[ctx] = peer
            pack(templates, off, ctx, v, src_addr + so, length, rbase + do, length)
            if rc := writemsg(ep, msg, _WRITE_FLAGS):
                self._post_failed(rc, grp, p, ctx, (pack, templates, off, writemsg, ep, msg,
                                                    (v, src_addr + so, length, rbase + do, length)))
            posted += 1
        if self._deferred or self._lost:
            posted = self._settle(grp, posted)
        eng.writes_posted += posted
        return posted

    def _prepared_table(self, grp: PeerGroup, src: LocalRegion, slots, src_base: int, dst_base: int):
        """What `post_table` needs per slot that does not change per call (the peer's post info, the
        bases, the bounds), remembered per (slots, group, source, bases): one lookup per call."""
        if grp._src is not src:
            self.engine.check_source(src)
            self._set_source(grp, src)
        key = (id(slots), id(grp), id(src), src_base, dst_base)
        hit = self._prepared.get(key)
        if hit is not None and hit[0] is slots:
            return hit[1]
        self.engine.check_source(src)
        rows = []
        for p, b, (writemsg, ep, msg, off, rbase, peer) in slot_peers(grp, slots):
            rows.append((b, p, writemsg, ep, msg, off, rbase + dst_base, peer, grp.remote_nbytes[p] - dst_base))
        prep = (tuple(rows), grp._templates, src.addr + src_base, src.nbytes - src_base)
        self._prepared[key] = (slots, prep)
        return prep

    def _post_failed(self, rc: int, grp: PeerGroup, p: int, ctx: int, again: tuple) -> None:
        """Slow path of a post refused with ``rc``: ``-FI_EAGAIN`` sets the write aside (``again``: the pack
        function, the templates, the offset, writemsg, endpoint, message and the words after the context,
        all it takes to post it once more; `_settle` does); anything else raises, or with
        ``engine.peer_errors`` kept is recorded against the peer (the write is lost, the call goes on)."""
        self._free_ctx.append(ctx)
        if rc == _NEG_EAGAIN:
            self._deferred.append((p, time.monotonic(), again))
            return
        err = lf.FabricError("fi_writemsg", rc, peer=grp.peers[p], context=f"imm {again[6][0]:#x}")
        errors = self.engine.peer_errors
        if errors is None:
            self._deferred, self._lost = [], 0  # the call ends here: nothing of it is retried by a later one
            raise err
        errors.setdefault(grp.peers[p], err)
        self._lost += 1

    def _settle(self, grp: PeerGroup, posted: int) -> int:
        """After a call's rows were tried once: post the ones set aside (`_post_deferred`), then return how
        many of the call's ``posted`` rows really were posted; `PeerTimeout` naming every peer still
        refusing after ``post_timeout_s`` (the others' rows all posted)."""
        try:
            timed_out = self._post_deferred(grp) if self._deferred else {}
        except BaseException:
            self._deferred, self._lost = [], 0
            raise
        posted, self._lost = posted - self._lost, 0
        if not timed_out:
            return posted
        self.engine.writes_posted += posted
        eng, first = self.engine, next(iter(timed_out))
        raise PeerTimeout(f"fi_writemsg to {grp.peers[first]} returned -FI_EAGAIN for {eng.post_timeout_s}s (peer "
                          f"not progressing or not reachable) [imm {timed_out[first]:#x}]"
                          + (f"; also to {', '.join(str(grp.peers[p]) for p in list(timed_out)[1:])}"
                             if len(timed_out) > 1 else "") + "; every other write of the call was posted",
                          position=first, positions=tuple(timed_out), posted=posted)

    def _post_deferred(self, grp: PeerGroup) -> dict[int, int]:
        """Retry the writes set aside, in passes: progress, then at most ``POSTS_PER_PASS`` posts. A peer that
        refuses again is not tried further in that pass (its queue is full), and what a pass did not try goes
        first in the next: one busy peer cannot take the others' turns. A write is dropped ``post_timeout_s``
        after its first refusal. Returns {group position: imm} of the peers that timed out."""
        eng, free, ctx_peer, peers = self.engine, self._free_ctx, self._ctx_peer, grp.peers
        timed_out: dict[int, int] = {}
        while self._deferred:
            eng._idle_progress()
            pending, self._deferred = self._deferred, []
            now, tries, busy, untried, refused = time.monotonic(), 0, set(), [], []
            for item in pending:
                p, since, (pack, templates, off, writemsg, ep, msg, words) = item
                if p in timed_out or now - since > eng.post_timeout_s:
                    timed_out.setdefault(p, words[0])
                    self._lost += 1
                    continue
                if tries == POSTS_PER_PASS or p in busy:
                    untried.append(item)
                    continue
                tries += 1
                eng.eagain_retries += 1
                ctx = free.pop() if free else self._wait_ctx()
                ctx_peer[ctx] = peers[p]
                pack(templates, off, ctx, *words)
                if rc := writemsg(ep, msg, _WRITE_FLAGS):
                    if rc == _NEG_EAGAIN:
                        free.append(ctx)
                        busy.add(p)
                        refused.append(item)
                    else:
                        self._post_failed(rc, grp, p, ctx, item[2])
            self._deferred = untried + refused
        return timed_out

    def _wait_ctx(self) -> int:
        """Progress until a write completes; return its (now free) fi_context address."""
        eng = self.engine
        eng.slot_waits += 1
        deadline = time.monotonic() + eng.timeout_s
        while not self._free_ctx:
            eng._idle_progress()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.max_inflight} writes in flight and none completed within "
                                   f"{eng.timeout_s}s (peers not progressing?)")
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
                if n != _NEG_EAVAIL:
                    raise lf.FabricError("fi_cq_read", n)
                self._cq_error(cq)
                handled += 1
        return handled

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
        eng = self.engine
        eng.writes_completed += n_local
        eng.imms_received += n - n_local

    def _cq_error(self, cq) -> None:
        """An error entry (after ``-FI_EAVAIL``): ``FabricError`` naming the peer of the failed write when it
        was ours; with ``engine.peer_errors`` kept (shrink mode) and a peer named, recorded there instead
        (efa reports a dead peer so, ``FI_ECONNABORTED`` / ``FI_EHOSTUNREACH`` / ``FI_ENOTCONN``)."""
        entry, msg = cq.readerr()
        peer, what = None, "remote write" if entry.flags & lf.FI_REMOTE_WRITE else "write"
        ctx = entry.op_context or 0
        if ctx and 0 <= ctx - self._ctx_base < 8 * _CTX_WORDS * self.max_inflight:
            peer = self._ctx_peer.get(ctx)
            self._free_ctx.append(ctx)
            self.engine.writes_completed += 1
        err = lf.FabricError("fi_cq_read", -entry.err, msg, peer=peer,
                             context=f"{what}, {entry.len} B, imm {entry.data & _IMM_MASK:#x}")
        if peer is None or self.engine.peer_errors is None:
            raise err
        self.engine.peer_errors.setdefault(peer, err)

    @property
    def pending(self) -> int:
        """Writes posted and not yet completed locally."""
        return self.max_inflight - len(self._free_ctx)

    # ------------------------------------------------------------------ teardown

    def close(self, regions: Sequence[LocalRegion]) -> None:
        """Close endpoints, AVs, CQs, the regions' MRs, domains, fabric (that order: each needs the next)."""
        for obj in (*self._eps, *self._avs, *self._cqs):
            obj.close()
        for r in regions:
            r.close()
        for obj in self._domains:
            obj.close()
        for fabric in self._fabrics:
            fabric.close()
        for info in self._infos:
            info.close()

    def __repr__(self) -> str:
        return f"libfabric {self.provider_name}, domains={self.num_domains}, mr_mode={self.info.mr_mode:#x}"


use_default_carrier(FabricCarrier)  # a TransferEngine made without a carrier runs over libfabric
