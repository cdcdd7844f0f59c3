"""libfabric registrations over the provider's limit (EFA: 2^20 pages per registration): the arithmetic of
the overlapping chunks a buffer is registered in, and the libfabric carrier's posting path for regions
registered in chunks (the key, desc and remote address follow each write). `fabric.py` is the carrier."""
from __future__ import annotations

import os
import struct

from . import libfabric as lf
from .engine import LocalRegion, PeerGroup, RemoteRegion

_WRITE_FLAGS = lf.FI_REMOTE_CQ_DATA | lf.FI_COMPLETION
# A region registered in chunks: the key and the desc change with the write too, and follow the six words
# that change per write in `fabric.py`'s template (its words _T_CONTEXT.._T_DESC0).
_PATCH_CHUNKED = struct.Struct("<8Q")
# EFA: one registration that allows remote write spans at most 2^20 pages (4 GiB at 4 KiB pages; libfabric
# PR #10402), -FI_ENOMEM past it. Larger buffers are registered in chunks (`registration_chunks`).
EFA_MAX_REGISTRATION_PAGES = 1 << 20
MAX_REGISTRATION_ENV = "MOE_A2A_MAX_REGISTRATION_BYTES"  # overrides the provider's limit (tests force it small)
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


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


def check_chunks(i: int, r: RemoteRegion) -> None:
    """``ValueError`` unless the chunks of a peer's region (at group position ``i``) add up to it."""
    n = len(r.chunk_keys)
    if (r.chunk_keys or r.chunk_bases or r.chunk_stride) and not (
            n > 1 and len(r.chunk_bases) == n and r.chunk_keys[0] == r.keys
            and all(len(k) == len(r.keys) for k in r.chunk_keys)
            and 0 < r.chunk_stride <= r.chunk_bytes < r.nbytes <= (n - 1) * r.chunk_stride + r.chunk_bytes):
        raise ValueError(f"peer_group: position {i}: region of {r.nbytes} B in {n} chunks of "
                         f"{r.chunk_bytes} B every {r.chunk_stride} B with {len(r.chunk_bases)} bases: "
                         f"the chunks do not describe it")



def slot_peers(grp, slots):
    """`(peer index, row, post info)` of each `(peer index, row)` slot of a write table, the index checked."""
    info, n = grp.post_info, len(grp.peers)
    for p, b in slots:
        if not 0 <= p < n:
            raise ValueError(f"post_table slot {(p, b)}: peer index {p} outside the group of {n} peers")
        yield p, b, info[p]

class FabricRegistration:
    """A buffer's MRs: one per domain, per chunk (``chunk_descs[i][d]``, ``chunk_keys[i][d]``); ``descs`` and
    ``keys`` are chunk 0's. ``chunk_table[d]``: what the chunked write path needs in domain d (stride, last
    chunk, chunk ends, descs)."""

    def __init__(self, nbytes: int, mrs: list, chunk_stride: int, chunk_bytes: int) -> None:
        # mrs: one list of MRs (one per domain) per chunk.
        self._mrs = [m for chunk in mrs for m in chunk]
        chunks = len(mrs)
        self.chunk_descs = tuple(tuple(m.desc for m in chunk) for chunk in mrs)
        self.chunk_keys = tuple(tuple(m.key for m in chunk) for chunk in mrs)
        self.descs = self.chunk_descs[0]  # fi_mr_desc per domain (may be 0 when not FI_MR_LOCAL); chunk 0's
        self.keys = self.chunk_keys[0]
        stride = chunk_stride if chunks > 1 else 0
        ends = _chunk_ends(nbytes, chunks, stride, chunk_bytes if chunks > 1 else nbytes)
        self.chunk_table = tuple((stride or _ONE_CHUNK, chunks - 1, ends, tuple(c[d] for c in self.chunk_descs))
                                 for d in range(len(self.descs)))

    def close(self) -> None:
        for m in self._mrs:
            m.close()
        self._mrs = []


class ChunkedPosting:
    """`FabricCarrier`'s posting path where the source or a peer's region is registered in chunks."""


    def _post_table_chunked(self, grp: PeerGroup, src: LocalRegion, words, slots, src_base: int, dst_base: int,
                            imm: int | None, skip_empty: bool) -> int:
        """`post_table` where the source or a peer's region is registered in chunks: per write, the chunk
        that holds it on each side (`registration_chunks`: a write no larger than the regions' bound lies
        wholly in one) gives the source desc, the remote key and the remote address (relative to the chunk
        without FI_MR_VIRT_ADDR); the eight words are patched together. A write that would cross chunks is
        refused (``ValueError``), never split: its immediate would arrive twice."""
        rows, templates, src_addr = self._prepared_chunked(grp, src, slots)
        grp._src = None  # the templates' descs now change per write: the fast path sets its own again
        eng = self.engine
        pack, max_len = _PATCH_CHUNKED.pack_into, eng.max_write_bytes
        free = self._free_ctx
        pop, ctx_peer = free.pop, self._ctx_peer
        posted = 0
        for b, p, writemsg, ep, msg, off, peer, (d_stride, d_last, d_ends, d_bases, d_keys), \
                (s_stride, s_last, s_ends, s_descs) in rows:
            so, length, do, v = words[b], words[b + 1], words[b + 2], words[b + 3]
            if skip_empty and not length:
                continue
            if imm is not None:
                v = imm
            if (so | length | do) < 0 or length > max_len:
                raise ValueError(eng.bad_target(grp, src, (p, so + src_base, length, do + dst_base)))
            so += src_base
            do += dst_base
            ks, kd = so // s_stride, do // d_stride
            if ks > s_last:
                ks = s_last
            if kd > d_last:
                kd = d_last
            if so + length > s_ends[ks] or do + length > d_ends[kd]:
                raise ValueError(eng.bad_target(grp, src, (p, so, length, do)))
            ctx = pop() if free else self._wait_ctx()  # none free: max_inflight in flight, progress
            ctx_peer[ctx] = peer
            words_after_ctx = (v, src_addr + so, length, d_bases[kd] + do - kd * d_stride, length, d_keys[kd],
                               s_descs[ks])
            pack(templates, off, ctx, *words_after_ctx)
            if rc := writemsg(ep, msg, _WRITE_FLAGS):  # -FI_EAGAIN: set aside, posted after the rest
                self._post_failed(rc, grp, p, ctx, (pack, templates, off, writemsg, ep, msg, words_after_ctx))
            posted += 1
        if self._deferred or self._lost:
            posted = self._settle(grp, posted)
        eng.writes_posted += posted
        return posted

    def _prepared_chunked(self, grp: PeerGroup, src: LocalRegion, slots):
        """`_prepared_table` for `_post_table_chunked`: per slot its post info and both chunk tables."""
        self.engine.check_source(src)
        key = (id(slots), id(grp), id(src), "chunked")
        hit = self._prepared.get(key)
        if hit is not None and hit[0] is slots:
            return hit[1]
        rows = []
        for p, b, (writemsg, ep, msg, off, _, peer) in slot_peers(grp, slots):
            rows.append((b, p, writemsg, ep, msg, off, peer, grp.remote_chunks[p],
                         src.reg.chunk_table[grp.domain_of[p]]))
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
        for p, b in slots:  # bounds were checked (the engine's _validate): only the chunks are left to check
            so, length, do = words[b:b + 3]
            d_stride, d_last, d_ends = grp.remote_chunks[p][:3]
            s_stride, s_last, s_ends = src.reg.chunk_table[grp.domain_of[p]][:3]
            if so + length > s_ends[min(so // s_stride, s_last)] or do + length > d_ends[min(do // d_stride, d_last)]:
                raise ValueError(self.engine.bad_target(grp, src, (p, so, length, do)))
        if imms is not None:
            for i, v in enumerate(imms):
                words[4 * i + 3] = v
        try:
            self._post_table_chunked(grp, src, words, slots, 0, 0, imm if imms is None else None, False)
        finally:  # these slots are this call's only: nothing to keep prepared
            self._prepared.pop((id(slots), id(grp), id(src), "chunked"), None)
