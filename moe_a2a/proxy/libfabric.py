"""ctypes shim over ``libfabric.so.1`` (API 1.17 to 1.22): RDM endpoints, RMA writes with immediates, CQs.

Scope: exactly what the transfer engine needs, nothing more. Most ``fi_*`` calls are ``static inline``
functions in the headers that call through ops tables (``ep->rma->writemsg(...)``), so the C structs are
mirrored with the header's names (`libfabric_abi.py`, whose names this module re-exports), and this module
loads the library, resolves each ops-table function pointer **once** per object and
declares the hot ones (``writemsg``, ``cq read``) with ``c_void_p`` integer arguments: measured on the CI
machine, that halves the ctypes cost of a call (0.6 µs instead of 1.2-1.5 µs).

API version: we request the newest the loaded library offers, up to :data:`API_NEWEST` (the newest whose
header layouts are mirrored here); ``efa`` needs >= 1.18 (below it EFA emulates RDMA writes on some
devices and offers no ``FI_HMEM``), tcp and shm also run on 1.17 (Debian's). Structs that grew between
1.17 and 1.22 are mirrored once per layout (``fi_cq_err_entry`` gained ``src_addr`` in 1.20: the library
copies 88 bytes into an error entry at API >= 1.20, 80 below); :func:`mirrored_structs` gives the ones of
an API version. Layouts are x86-64: ``tests/proxy/test_libfabric_layout.py`` checks every mirrored field
against the C compiler on the installed headers, ``tests/proxy/test_libfabric_versions.py`` against the
layouts of the 1.18 / 1.20 / 1.22 headers kept as data there.

Which library: ``MOE_A2A_LIBFABRIC`` (a path) if set, else the EFA installer's
(``/opt/amazon/efa/lib*/libfabric.so*``) when present, else the system's (:func:`library_candidates`);
:func:`library_info` says which was loaded, its version and the API requested.

Object lifetime: close in the reverse order of creation: endpoint, then AV and CQ, then MRs, then the
domain, then the fabric (a domain with open MRs/endpoints refuses to close with ``-FI_EBUSY``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import glob
import logging
import os
from ctypes import (
    POINTER,
    Structure,
    byref,
    c_char_p,
    c_int,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
    sizeof,
)

from .libfabric_abi import *  # noqa: F401,F403 - the header's names, as callers know them (lf.FI_WRITE)
from .libfabric_abi import (_AV_INSERT, _BIND, _CLOSE, _CM_GETNAME, _CONTROL, _CQ_READERR, _CQ_STRERROR,
                            _DOMAIN_AV_OPEN, _DOMAIN_CQ_OPEN, _DOMAIN_ENDPOINT, _EP_SETOPT, _FABRIC_DOMAIN,
                            _FI_ERRNO_NAMES, _MR_REG, _MR_REGATTR)


# --------------------------------------------------------------------------------------------------
# Library loading (at first use, never at import)
# --------------------------------------------------------------------------------------------------

LIBFABRIC_ENV = "MOE_A2A_LIBFABRIC"  # a path: load this libfabric and no other
# The EFA installer's prefix (lib on Debian/Ubuntu, lib64 on Amazon Linux/RHEL): its libfabric has the
# efa provider built with CUDA support and is newer than a distribution's.
EFA_INSTALLER_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64")
SOURCE_OVERRIDE, SOURCE_EFA_INSTALLER, SOURCE_SYSTEM = LIBFABRIC_ENV, "EFA installer", "system"

_log = logging.getLogger("moe_a2a.proxy")
_lib_cache: list = []  # [(CDLL, library info dict)] once loaded; a list so no ``global`` statement is needed
_logged_fabrics: set = set()  # what log_fabric_once said already, in this process


class FabricError(Exception):
    """A libfabric call failed.

    Attributes: ``call`` (the C call, e.g. ``"fi_writemsg"``), ``rc`` (the negative return or the CQ
    error's errno, as a positive number in ``errno``), ``errno_name`` (``"FI_EAGAIN"``...), ``peer``
    and ``context`` (what the caller knew: peer name, op, imm) when known.
    """

    def __init__(self, call: str, rc: int, detail: str = "", peer: object = None, context: str = ""):
        self.call = call
        self.errno = abs(int(rc))
        self.errno_name = errno_name(self.errno)
        self.peer = peer
        self.context = context
        msg = f"{call} failed: -{self.errno_name} ({strerror(self.errno)})"
        if detail:
            msg += f": {detail}"
        if peer is not None:
            msg += f" [peer {peer}]"
        if context:
            msg += f" [{context}]"
        super().__init__(msg)


class HmemUnsupported(FabricError):
    """Registering device (GPU) memory is not supported by this provider/build. Callers fall back to
    host-staged buffers (pinned host memory the GPU reaches over PCIe)."""


def errno_name(err: int) -> str:
    """``FI_E*`` name of a positive libfabric errno (system errnos map to ``FI_`` + their errno name)."""
    err = abs(int(err))
    if err in _FI_ERRNO_NAMES:
        return _FI_ERRNO_NAMES[err]
    sys_name = _errno.errorcode.get(err)
    return f"FI_{sys_name}" if sys_name else f"errno {err}"


def strerror(err: int) -> str:
    """``fi_strerror`` of a positive errno (falls back to a plain name if the library is absent)."""
    try:
        s = library().fi_strerror(abs(int(err)))
    except OSError:
        return errno_name(err)
    return s.decode(errors="replace") if s else errno_name(err)


def _efa_installer_library(directory: str) -> str | None:
    """The libfabric in ``directory``: ``libfabric.so.1``, else ``libfabric.so``, else the first
    ``libfabric.so.*``; None when there is none."""
    for name in ("libfabric.so.1", "libfabric.so"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    found = sorted(glob.glob(os.path.join(directory, "libfabric.so.*")))
    return found[0] if found else None


def library_candidates(environ=None) -> list[tuple[str, str]]:
    """(path or soname, where it comes from) of each libfabric :func:`library` may load, preferred first:
    ``MOE_A2A_LIBFABRIC`` alone when it is set; else the EFA installer's when present, then the system's
    (``find_library``, else ``libfabric.so.1`` for the dynamic loader)."""
    env = os.environ if environ is None else environ
    override = env.get(LIBFABRIC_ENV)
    if override:
        return [(override, SOURCE_OVERRIDE)]
    out = [(path, SOURCE_EFA_INSTALLER) for path in map(_efa_installer_library, EFA_INSTALLER_DIRS) if path]
    out.append((ctypes.util.find_library("fabric") or "libfabric.so.1", SOURCE_SYSTEM))
    return out


class _Dl_info(Structure):
    _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p),
                ("dli_saddr", c_void_p)]


def _loaded_path(lib: ctypes.CDLL, fallback: str) -> str:
    """The file the dynamic loader mapped for ``lib`` (a soname resolves to a path only there)."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.restype, dladdr.argtypes = c_int, [c_void_p, POINTER(_Dl_info)]
        info = _Dl_info()
        if dladdr(ctypes.cast(lib.fi_version, c_void_p), byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError):  # no dladdr in this libc: say what was asked for
        pass
    return fallback


def _declare(lib: ctypes.CDLL) -> None:
    lib.fi_version.restype = c_uint32
    lib.fi_version.argtypes = []
    lib.fi_getinfo.restype = c_int
    lib.fi_getinfo.argtypes = [c_uint32, c_char_p, c_char_p, c_uint64, POINTER(fi_info),
                               POINTER(POINTER(fi_info))]
    lib.fi_freeinfo.restype = None
    lib.fi_freeinfo.argtypes = [POINTER(fi_info)]
    lib.fi_dupinfo.restype = POINTER(fi_info)
    lib.fi_dupinfo.argtypes = [POINTER(fi_info)]
    lib.fi_fabric.restype = c_int
    lib.fi_fabric.argtypes = [POINTER(fi_fabric_attr), POINTER(c_void_p), c_void_p]
    lib.fi_strerror.restype = c_char_p
    lib.fi_strerror.argtypes = [c_int]


def load_library(candidates: list[tuple[str, str]]) -> tuple[ctypes.CDLL, dict]:
    """Load the first of ``candidates`` (see :func:`library_candidates`) that loads, and negotiate the API
    version. Returns the library and its facts: ``path`` (the file mapped), ``source``, ``version``
    (the library's), ``api_version`` (what we request). ``OSError`` naming what was tried, or the path
    and version of a library this shim cannot use."""
    tried = []
    for path, source in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({source}): {e}")
            continue
        _declare(lib)
        version = lib.fi_version()
        where = _loaded_path(lib, path)
        try:
            api = negotiate_api(version)
        except OSError as e:
            raise OSError(f"libfabric at {where} ({source}) is {version_str(version)}: {e}; point "
                          f"{LIBFABRIC_ENV} at another libfabric.so.1") from None
        if tried:  # a preferred library is there but does not load: say so, it is probably not intended
            _log.warning("libfabric: could not load %s; using %s (%s)", "; ".join(tried), where, source)
        return lib, {"path": where, "source": source, "version": version_str(version),
                     "api_version": version_str(api), "api": api}
    raise OSError(f"cannot load libfabric: tried {'; '.join(tried)}; install it (Debian/Ubuntu: apt-get "
                  f"install libfabric1; EFA: the EFA installer) or point {LIBFABRIC_ENV} at libfabric.so.1")


def library() -> ctypes.CDLL:
    """The libfabric of this process, loaded at first use (:func:`library_candidates` says which) with
    the exported functions we call declared. ``OSError`` if none can be loaded or used."""
    if not _lib_cache:
        _lib_cache.append(load_library(library_candidates()))
    return _lib_cache[0][0]


def library_info() -> dict:
    """Which libfabric this process loaded: ``path``, ``source`` (``MOE_A2A_LIBFABRIC``, ``EFA
    installer`` or ``system``), ``version`` and ``api_version`` (``"1.22"``) and ``api`` (the
    ``FI_VERSION`` requested)."""
    library()
    return dict(_lib_cache[0][1])


def api_version() -> int:
    """The API version requested from the loaded library (an ``FI_VERSION``)."""
    library()
    return _lib_cache[0][1]["api"]


def runtime_version() -> tuple[int, int]:
    """(major, minor) of the loaded library."""
    v = library().fi_version()
    return v >> 16, v & 0xFFFF


def log_fabric_once(facts: dict) -> None:
    """Log (INFO, logger ``moe_a2a.proxy``) which libfabric, provider and FI_HMEM outcome an engine got,
    once per distinct facts in this process (a benchmark opens many engines alike)."""
    key = tuple(sorted((k, str(v)) for k, v in facts.items()))
    if key in _logged_fabrics:
        return
    _logged_fabrics.add(key)
    _log.info("libfabric %s (API %s) from %s (%s): provider %s, domains %s, FI_HMEM %s, threading %s, "
              "remote-only %s, FI_OPT_CUDA_API_PERMITTED %s", facts.get("version"), facts.get("api_version"),
              facts.get("path"), facts.get("source"), facts.get("provider"), ",".join(facts.get("domains", ())),
              facts.get("hmem"), facts.get("threading"), facts.get("remote_only"),
              facts.get("cuda_api_permitted"))


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.strdup.restype = c_void_p
    libc.strdup.argtypes = [c_char_p]
    return libc


def _check(call: str, rc: int, detail: str = "") -> int:
    if rc < 0:
        raise FabricError(call, rc, detail)
    return rc


def _fn(proto, table_addr: int, table_type, name: str):
    """Function pointer ``name`` of the ops table at ``table_addr`` as a callable of prototype ``proto``."""
    ptr = getattr(table_type.from_address(table_addr), name)
    if not ptr:
        raise FabricError(f"{table_type.__name__}.{name}", -FI_ENOSYS, "provider does not implement it")
    return proto(ptr)


def _close_fid(fid_addr: int, what: str) -> None:
    ops = fi_ops.from_address(fid.from_address(fid_addr).ops)
    _check(f"fi_close({what})", _CLOSE(ops.close)(fid_addr))


# --------------------------------------------------------------------------------------------------
# Objects
# --------------------------------------------------------------------------------------------------

PROVIDER_NAMES = {"tcp": "tcp;ofi_rxm", "shm": "shm", "efa": "efa", "verbs": "verbs;ofi_rxm"}
# Providers whose endpoints are IP sockets (a listening port), where ``local_only`` binds them to the
# loopback address. shm has no socket (same host by construction); efa/verbs address NICs, not IPs.
SOCKET_PROVIDERS = ("tcp", "tcp;ofi_rxm", "sockets", "udp;ofi_rxd")
LOOPBACK_NODE = "127.0.0.1"


class Info:
    """One ``fi_info`` chosen by :func:`getinfo` (owns the whole list; ``close()`` frees it)."""

    def __init__(self, head, chosen):
        self._head = head
        self.ptr = ctypes.addressof(chosen)  # fi_info* passed to fi_fabric/fi_domain/fi_endpoint
        info = chosen
        self.prov_name = ctypes.string_at(info.fabric_attr.contents.prov_name).decode()
        self.fabric_name = ctypes.string_at(info.fabric_attr.contents.name).decode()
        self.domain_name = info.domain_attr.contents.name.decode()
        self.mr_mode = info.domain_attr.contents.mr_mode
        self.mr_key_size = info.domain_attr.contents.mr_key_size
        self.cq_data_size = info.domain_attr.contents.cq_data_size
        self.caps = info.caps
        self.tx_size = info.tx_attr.contents.size
        self.tx_iov_limit = info.tx_attr.contents.iov_limit  # local iovecs per write (we post one)
        self.rx_size = info.rx_attr.contents.size
        self.max_msg_size = info.ep_attr.contents.max_msg_size
        self.threading = info.domain_attr.contents.threading  # FI_THREAD_DOMAIN when the provider took the hint
        self.api_version = info.fabric_attr.contents.api_version  # what fi_getinfo was asked for
        self.device_id = nic_device_id(info.nic)  # efa: "0xefaN", the device generation (None: not known)
        self.info = chosen  # the ctypes struct (valid until close)

    @property
    def virt_addr(self) -> bool:
        """Remote addresses are virtual addresses (shm, efa); else offsets into the MR (tcp)."""
        return bool(self.mr_mode & FI_MR_VIRT_ADDR)

    @property
    def prov_key(self) -> bool:
        """The provider picks MR keys; otherwise the requested key is used and must be unique."""
        return bool(self.mr_mode & FI_MR_PROV_KEY)

    @property
    def remote_only(self) -> bool:
        """The endpoint serves peers on other hosts only (``FI_REMOTE_COMM`` without ``FI_LOCAL_COMM``): EFA
        then opens no shm sub-provider (which would mirror every registration)."""
        return bool(self.caps & FI_REMOTE_COMM) and not self.caps & FI_LOCAL_COMM

    def close(self) -> None:
        if self._head is not None:
            library().fi_freeinfo(self._head)
            self._head = None

    def __repr__(self) -> str:
        return (f"Info(prov={self.prov_name!r}, domain={self.domain_name!r}, mr_mode={self.mr_mode:#x}, "
                f"cq_data_size={self.cq_data_size}, tx_size={self.tx_size})")


# Providers whose endpoints ask for remote-only communication (FI_REMOTE_COMM without FI_LOCAL_COMM): the
# proxy carries inter-node traffic only, and EFA then skips its shm sub-provider (prov/efa/src/efa_domain.c)
# while still looping back over the device if a peer is local after all. Not shm (it offers FI_LOCAL_COMM
# only) nor tcp (its loopback interface offers FI_LOCAL_COMM only: remote-only would skip 127.0.0.1, which
# `local_only` binds to and CI runs on; prov/util/src/util_main.c).
REMOTE_ONLY_PROVIDERS = ("efa", "verbs;ofi_rxm")


def list_providers() -> list[str]:
    """Provider names (``fabric_attr.prov_name``) offering RDM endpoints with RMA writes here."""
    try:
        head = _getinfo_raw(None, hmem=False, tx_size=None)
    except FabricError:
        return []
    names, node = [], head
    while node:
        name = ctypes.string_at(node.contents.fabric_attr.contents.prov_name).decode()
        if name not in names:
            names.append(name)
        node = node.contents.next
    library().fi_freeinfo(head)
    return names


def _getinfo_raw(prov_name: str | None, *, hmem: bool, tx_size: int | None, source: str | None = None,
                 remote_only: bool = False):
    """``fi_getinfo`` at the negotiated API version with our hints. ``source``: a numeric local address to
    bind endpoints to (``node`` with ``FI_SOURCE | FI_NUMERICHOST``): the tcp provider then listens on that
    address only, instead of the first interface's (checked with ``ss -ltn`` by
    tests/proxy/test_security.py). ``remote_only``: ask ``FI_REMOTE_COMM`` without ``FI_LOCAL_COMM``."""
    lib = library()
    hints = lib.fi_dupinfo(None)  # fi_allocinfo() is an inline wrapper of fi_dupinfo(NULL)
    if not hints:
        raise MemoryError("fi_dupinfo(NULL) returned NULL")
    try:
        h = hints.contents
        h.caps = (FI_RMA | FI_WRITE | FI_REMOTE_WRITE | (FI_HMEM if hmem else 0)
                  | (FI_REMOTE_COMM if remote_only else 0))
        h.mode = FI_CONTEXT
        h.ep_attr.contents.type = FI_EP_RDM
        d = h.domain_attr.contents
        d.mr_mode = (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY
                     | (FI_MR_HMEM if hmem else 0))
        d.av_type = FI_AV_TABLE
        # One thread drives an engine and all its domains (the proxy's loop): the provider may drop its locks.
        d.threading = FI_THREAD_DOMAIN
        if tx_size:
            h.tx_attr.contents.size = tx_size
        if prov_name:
            # fi_freeinfo frees this string: it must come from the C allocator.
            h.fabric_attr.contents.prov_name = _libc().strdup(prov_name.encode())
        out = POINTER(fi_info)()
        node, flags = (source.encode(), FI_SOURCE | FI_NUMERICHOST) if source else (None, 0)
        rc = lib.fi_getinfo(api_version(), node, None, flags, hints, byref(out))
    finally:
        lib.fi_freeinfo(hints)
    if rc == -FI_ENODATA:
        raise FabricError("fi_getinfo", rc, f"no provider {prov_name or '(any)'} offers RDM endpoints with "
                          f"RMA writes{' and FI_HMEM' if hmem else ''}"
                          f"{' for remote peers only' if remote_only else ''}"
                          f"{f' bound to {source}' if source else ''} here (API "
                          f"{version_str(api_version())}, libfabric {library_info()['path']})")
    _check("fi_getinfo", rc)
    return out


def check_api_for(prov_name: str) -> None:
    """``FabricError`` naming the loaded library's path and version when ``prov_name`` needs a newer API
    than it offers (efa: >= 1.18)."""
    if prov_name == "efa" and api_version() < EFA_API_MIN:
        lib = library_info()
        raise FabricError("fi_getinfo", -FI_ENOSYS,
                          f"provider efa needs libfabric >= {version_str(EFA_API_MIN)} (hardware RDMA write, "
                          f"FI_HMEM), found {lib['version']} at {lib['path']} ({lib['source']}); install the EFA "
                          f"installer (/opt/amazon/efa) or point {LIBFABRIC_ENV} at a libfabric >= "
                          f"{version_str(EFA_API_MIN)}")


def efa_gpu_refusal(library_version: int, environ=None) -> str | None:
    """Why efa cannot register cuMem GPU buffers with a libfabric of ``library_version`` (an ``FI_VERSION``),
    or None when it can: 1.18 and 1.19 reject them at registration unless ``FI_EFA_SET_CUDA_SYNC_MEMOPS=0``
    is in the proxy's environment (:data:`EFA_GPU_API_MIN`)."""
    env = os.environ if environ is None else environ
    if library_version >= EFA_GPU_API_MIN or env.get(EFA_SYNC_MEMOPS_ENV, "").strip() == "0":
        return None
    return (f"efa with GPU buffers needs libfabric >= {version_str(EFA_GPU_API_MIN)} (found "
            f"{version_str(library_version)}, which rejects cuMem buffers at registration) or "
            f"{EFA_SYNC_MEMOPS_ENV}=0 in the proxy's environment")


def _usable(provider: str, *, hmem: bool, tx_size: int | None, source: str | None = None):
    """(head of the fi_getinfo list, [the usable fi_info nodes]): RDM + RMA + >= 4 B of remote CQ data
    on ``provider`` (in 1.17 remote CQ data is not a capability bit: ``cq_data_size`` is checked)."""
    prov_name = PROVIDER_NAMES.get(provider, provider)
    check_api_for(prov_name)
    head = _getinfo_raw(prov_name, hmem=hmem, tx_size=tx_size, source=source,
                        remote_only=prov_name in REMOTE_ONLY_PROVIDERS)
    nodes, node = [], head
    while node:
        info = node.contents
        name = ctypes.string_at(info.fabric_attr.contents.prov_name).decode()
        if name == prov_name and info.domain_attr.contents.cq_data_size >= 4:
            nodes.append(info)
        node = info.next
    return head, nodes


def getinfo(provider: str, *, hmem: bool = False, tx_size: int | None = None, domain: str | None = None,
            local_only: bool = False) -> Info:
    """``fi_getinfo`` for an RDM endpoint with RMA writes and remote CQ data on ``provider``
    (``"tcp"`` means ``tcp;ofi_rxm``; ``"shm"``, ``"efa"``, or a full provider name): the first such
    entry, or the first on the domain (NIC) named ``domain`` (see :func:`list_domains`).

    ``tx_size`` asks for a transmit queue depth (small values provoke ``-FI_EAGAIN``, for tests).
    ``local_only``: every peer is on this host; socket providers (:data:`SOCKET_PROVIDERS`) bind to
    127.0.0.1 (``FI_SOURCE``), so their port is unreachable from other hosts. Others: no effect (shm
    never listens on a network; efa/verbs have no loopback).
    """
    prov_name = PROVIDER_NAMES.get(provider, provider)
    source = LOOPBACK_NODE if local_only and prov_name in SOCKET_PROVIDERS else None
    head, nodes = _usable(provider, hmem=hmem, tx_size=tx_size, source=source)
    for info in nodes:
        if domain is None or info.domain_attr.contents.name.decode() == domain:
            return Info(head, info)
    names = sorted({i.domain_attr.contents.name.decode() for i in nodes})
    library().fi_freeinfo(head)
    if domain is not None and names:
        raise FabricError("fi_getinfo", -FI_ENODATA, f"provider {prov_name!r} has no domain {domain!r} "
                          f"(it has {names})")
    raise FabricError("fi_getinfo", -FI_ENODATA,
                      f"provider {prov_name!r} offers no RDM endpoint with >= 4 bytes of remote CQ data")


def list_domains(provider: str, *, hmem: bool = False) -> list[str]:
    """Distinct domain names (one per NIC on EFA; one per interface on tcp) of ``provider``, in the
    order ``fi_getinfo`` lists them."""
    head, nodes = _usable(provider, hmem=hmem, tx_size=None)
    names = []
    for info in nodes:
        name = info.domain_attr.contents.name.decode()
        if name not in names:
            names.append(name)
    library().fi_freeinfo(head)
    return names


def list_domain_nics(provider: str) -> list[tuple[str, str | None]]:
    """(domain name, its NIC's PCI address or None) for the domains :func:`list_domains` gives, in
    the same order."""
    head, nodes = _usable(provider, hmem=False, tx_size=None)
    found: dict[str, str | None] = {}
    for info in nodes:
        name = info.domain_attr.contents.name.decode()
        if found.get(name) is None:
            found[name] = nic_pci_address(info.nic)
    library().fi_freeinfo(head)
    return list(found.items())


class Fabric:
    """``fi_fabric`` for an :class:`Info`."""

    def __init__(self, info: Info):
        self.info = info
        ptr = c_void_p()
        _check("fi_fabric", library().fi_fabric(info.info.fabric_attr, byref(ptr), None))
        self.ptr = ptr.value

    def domain(self) -> "Domain":
        return Domain(self)

    def close(self) -> None:
        if self.ptr:
            _close_fid(self.ptr, "fabric")
            self.ptr = None


class Domain:
    """``fi_domain`` plus the objects opened from it (CQ, AV, endpoint, MRs)."""

    def __init__(self, fabric: Fabric):
        self.info = fabric.info
        f = fid_fabric.from_address(fabric.ptr)
        ptr = c_void_p()
        fn = _fn(_FABRIC_DOMAIN, f.ops, fi_ops_fabric, "domain")
        _check("fi_domain", fn(fabric.ptr, self.info.ptr, byref(ptr), None))
        self.ptr = ptr.value
        d = fid_domain.from_address(self.ptr)
        self._av_open = _fn(_DOMAIN_AV_OPEN, d.ops, fi_ops_domain, "av_open")
        self._cq_open = _fn(_DOMAIN_CQ_OPEN, d.ops, fi_ops_domain, "cq_open")
        self._endpoint = _fn(_DOMAIN_ENDPOINT, d.ops, fi_ops_domain, "endpoint")
        self._mr_reg = _fn(_MR_REG, d.mr, fi_ops_mr, "reg")
        self._mr_regattr = _fn(_MR_REGATTR, d.mr, fi_ops_mr, "regattr")

    def cq_open(self, size: int) -> "CQ":
        """A CQ of ``FI_CQ_FORMAT_DATA`` entries, no wait object (we busy-poll)."""
        attr = fi_cq_attr(size=size, format=FI_CQ_FORMAT_DATA, wait_obj=FI_WAIT_NONE)
        ptr = c_void_p()
        _check("fi_cq_open", self._cq_open(self.ptr, byref(attr), byref(ptr), None))
        return CQ(ptr.value, self.info.api_version)

    def av_open(self, count: int) -> "AV":
        attr = fi_av_attr(type=FI_AV_TABLE, count=count)
        ptr = c_void_p()
        _check("fi_av_open", self._av_open(self.ptr, byref(attr), byref(ptr), None))
        return AV(ptr.value)

    def endpoint(self) -> "Endpoint":
        ptr = c_void_p()
        _check("fi_endpoint", self._endpoint(self.ptr, self.info.ptr, byref(ptr), None))
        return Endpoint(ptr.value)

    def mr_reg(self, addr: int, nbytes: int, access: int, requested_key: int) -> "MR":
        """Register host memory ``[addr, addr+nbytes)``."""
        ptr = c_void_p()
        _check("fi_mr_reg", self._mr_reg(self.ptr, addr, nbytes, access, 0, requested_key, 0, byref(ptr), None),
               f"addr={addr:#x} nbytes={nbytes}")
        return MR(ptr.value)

    def mr_regattr_cuda(self, addr: int, nbytes: int, access: int, requested_key: int, cuda_device: int,
                        dmabuf_fd: int | None = None, dmabuf_offset: int = 0,
                        dmabuf_base: int | None = None) -> "MR":
        """Register GPU memory ``[addr, addr + nbytes)`` with ``iface = FI_HMEM_CUDA``: by virtual address, or
        by DMA-BUF fd (``FI_MR_DMABUF``, API >= 1.20 only): the bytes at ``dmabuf_offset`` into the DMA-BUF
        whose first byte is mapped at ``dmabuf_base`` (default ``addr - dmabuf_offset``), so that the
        provider's remote address, ``base_addr + offset``, is ``addr`` (``struct fi_mr_dmabuf``; efa:
        ``ibv_reg_dmabuf_mr(pd, offset, len, base_addr + offset, fd)``). Raises :class:`HmemUnsupported`
        when the provider or build cannot (e.g. shm without CUDA support returns ``-FI_ENOSYS``)."""
        if not self.info.caps & FI_HMEM:
            raise HmemUnsupported("fi_mr_regattr", -FI_ENOSYS,
                                  f"provider {self.info.prov_name} was opened without FI_HMEM")
        flags = 0
        iov = iovec(addr, nbytes)
        base = addr - dmabuf_offset if dmabuf_base is None else dmabuf_base
        if dmabuf_fd is not None and base + dmabuf_offset != addr:
            raise ValueError(f"mr_regattr_cuda: DMA-BUF base {base:#x} + offset {dmabuf_offset} is not addr {addr:#x}")
        dmabuf = fi_mr_dmabuf(fd=dmabuf_fd or 0, offset=dmabuf_offset, len=nbytes, base_addr=base)
        # The layout of the API we asked for (hmem_data since 1.19, page_size since 1.22, read by the
        # library at those versions), with zeroed room after it for a provider that reads further.
        attr_type = mirrored_structs(self.info.api_version)["fi_mr_attr"]
        raw = (c_uint8 * (sizeof(attr_type) + 64))()
        attr = attr_type.from_buffer(raw)
        if dmabuf_fd is not None:
            if self.info.api_version < FI_VERSION(1, 20):  # the library reads the union as mr_iov below it
                raise HmemUnsupported("fi_mr_regattr", -FI_ENOSYS,
                                      f"DMA-BUF registration needs libfabric API >= 1.20, requested "
                                      f"{version_str(self.info.api_version)} of libfabric "
                                      f"{'.'.join(map(str, runtime_version()))}")
            attr.mr_iov = ctypes.addressof(dmabuf)
            flags |= FI_MR_DMABUF
        else:
            attr.mr_iov = ctypes.addressof(iov)
        attr.iov_count = 1
        attr.access = access
        attr.requested_key = requested_key
        attr.iface = FI_HMEM_CUDA
        attr.device.cuda = cuda_device
        ptr = c_void_p()
        rc = self._mr_regattr(self.ptr, ctypes.addressof(attr), flags, byref(ptr))
        if rc < 0:
            how = f" DMA-BUF fd {dmabuf_fd} offset {dmabuf_offset}" if dmabuf_fd is not None else ""
            raise HmemUnsupported("fi_mr_regattr", rc, f"FI_HMEM_CUDA device {cuda_device} addr={addr:#x} "
                                  f"nbytes={nbytes}{how} on {self.info.prov_name}")
        return MR(ptr.value)

    def close(self) -> None:
        if self.ptr:
            _close_fid(self.ptr, "domain")
            self.ptr = None


class MR:
    """A registered memory region: ``desc`` (``fi_mr_desc``) and ``key`` (``fi_mr_key``) are field reads."""

    def __init__(self, ptr: int):
        self.ptr = ptr
        m = fid_mr.from_address(ptr)
        self.desc = m.mem_desc or 0
        self.key = m.key

    def close(self) -> None:
        if self.ptr:
            _close_fid(self.ptr, "mr")
            self.ptr = None


class AV:
    """An ``FI_AV_TABLE`` address vector."""

    def __init__(self, ptr: int):
        self.ptr = ptr
        self._insert = _fn(_AV_INSERT, fid_av.from_address(ptr).ops, fi_ops_av, "insert")

    def insert(self, address: bytes) -> int:
        """Insert one endpoint name; returns its ``fi_addr_t``."""
        out = c_uint64(FI_ADDR_UNSPEC)
        buf = ctypes.create_string_buffer(address, len(address))
        rc = self._insert(self.ptr, buf, 1, byref(out), 0, None)
        if rc != 1:
            raise FabricError("fi_av_insert", rc if rc < 0 else -FI_EOTHER,
                              f"inserted {rc} of 1 addresses ({address.hex()[:32]}...)")
        return out.value

    def close(self) -> None:
        if self.ptr:
            _close_fid(self.ptr, "av")
            self.ptr = None


class CQ:
    """A completion queue. ``read`` is the raw hot-path callable ``read(cq_ptr, buf_addr, count)``.
    ``api``: the API version the fabric was opened at (it decides how much ``fi_cq_readerr`` writes)."""

    def __init__(self, ptr: int, api: int):
        self.ptr = ptr
        ops = fid_cq.from_address(ptr).ops
        self.read = _fn(CQ_READ_PROTO, ops, fi_ops_cq, "read")
        self._readerr = _fn(_CQ_READERR, ops, fi_ops_cq, "readerr")
        self._strerror = _fn(_CQ_STRERROR, ops, fi_ops_cq, "strerror")
        self.err_entry_type = mirrored_structs(api)["fi_cq_err_entry"]  # 80 B below API 1.20, 88 from it

    def readerr(self):
        """``fi_cq_readerr`` after a read returned ``-FI_EAVAIL``: the entry (an ``err_entry_type``) and a
        decoded message (``fi_strerror`` of ``err`` plus the provider's ``fi_cq_strerror`` of ``prov_errno``)."""
        entry = self.err_entry_type()
        rc = self._readerr(self.ptr, ctypes.addressof(entry), 0)
        if rc < 0:
            raise FabricError("fi_cq_readerr", rc)
        buf = ctypes.create_string_buffer(256)
        prov = self._strerror(self.ptr, entry.prov_errno, entry.err_data, buf, len(buf))
        prov_msg = buf.value.decode(errors="replace") or (ctypes.string_at(prov).decode(errors="replace")
                                                           if prov else "")
        return entry, f"{strerror(entry.err)}; provider: {prov_msg} (prov_errno {entry.prov_errno})"

    def close(self) -> None:
        if self.ptr:
            _close_fid(self.ptr, "cq")
            self.ptr = None


class Endpoint:
    """An RDM endpoint. ``writemsg`` is the raw hot-path callable ``writemsg(ep_ptr, msg_addr, flags)``."""

    def __init__(self, ptr: int):
        self.ptr = ptr
        e = fid_ep.from_address(ptr)
        fops = fi_ops.from_address(e.fid.ops)
        self._bind = _BIND(fops.bind)
        self._control = _CONTROL(fops.control)
        self._getname = _fn(_CM_GETNAME, e.cm, fi_ops_cm, "getname")
        self.writemsg = _fn(WRITEMSG_PROTO, e.rma, fi_ops_rma, "writemsg")
        setopt = fi_ops_ep.from_address(e.ops).setopt
        self._setopt = _EP_SETOPT(setopt) if setopt else None

    def bind(self, obj_ptr: int, flags: int, what: str) -> None:
        """``fi_ep_bind`` (a CQ with ``FI_TRANSMIT|FI_RECV``, or an AV with 0)."""
        _check(f"fi_ep_bind({what})", self._bind(self.ptr, obj_ptr, flags))

    def enable(self) -> None:
        _check("fi_enable", self._control(self.ptr, FI_ENABLE, None))

    def setopt(self, optname: int, value, level: int = FI_OPT_ENDPOINT) -> int:
        """``fi_setopt(&ep->fid, level, optname, &value, sizeof(value))`` with ``value`` a ctypes object.
        Returns 0 or the negative errno, not raised: which refusals are harmless depends on the option
        (-FI_ENOSYS: the provider has no setopt at all)."""
        if self._setopt is None:
            return -FI_ENOSYS
        return self._setopt(self.ptr, level, optname, ctypes.addressof(value), sizeof(value))

    def forbid_cuda_api(self, hmem: bool = False) -> str:
        """``FI_OPT_CUDA_API_PERMITTED = false`` (before ``fi_enable``): the provider must not call CUDA in
        its data path (a CUDA call from the proxy may wait on the model's work). Returns the outcome:
        ``"false"``, or why it stays as the provider has it; ``FabricError`` for an unexpected refusal.

        ``hmem``: GPU buffers are asked for. Then any refusal raises :class:`HmemUnsupported`: a provider
        that cannot do without CUDA calls cannot reach GPU memory from the NIC (efa without peer-to-peer
        registers, then fails the first write with ``-FI_EINVAL``: libfabric issue 12853), and one without
        the option would call CUDA from the proxy's loop; the caller stages through host memory instead,
        or refuses, as ``buffers=`` asks (pplx-garden treats any refusal as fatal)."""
        rc = self.setopt(FI_OPT_CUDA_API_PERMITTED, ctypes.c_bool(False))
        if rc == 0:
            return "false"
        if hmem and rc < 0:
            raise HmemUnsupported("fi_setopt(FI_OPT_CUDA_API_PERMITTED, false)", rc,
                                  "the provider needs the CUDA API for GPU memory (or lacks the option): no GPU "
                                  "buffers with the NIC")
        if rc in (-FI_ENOPROTOOPT, -FI_ENOSYS):  # tcp, shm before 1.18, any provider without the option
            return f"not an option of this provider (-{errno_name(rc)})"
        if rc == -FI_EINVAL:  # efa, shm, verbs, rxm: no CUDA library or device here, so none is called
            return "no CUDA library or device for the provider (-FI_EINVAL)"
        if rc == -FI_EOPNOTSUPP:  # its GPU support needs the CUDA API (efa without peer-to-peer, shm)
            return "needed by the provider for GPU memory (-FI_EOPNOTSUPP)"
        raise FabricError("fi_setopt(FI_OPT_CUDA_API_PERMITTED)", rc)

    def getname(self) -> bytes:
        size = c_size_t(0)
        rc = self._getname(self.ptr, None, byref(size))  # -FI_ETOOSMALL, and the size we need
        if rc not in (0, -FI_ETOOSMALL):
            _check("fi_getname", rc)
        buf = ctypes.create_string_buffer(max(size.value, 1))
        _check("fi_getname", self._getname(self.ptr, buf, byref(size)))
        return buf.raw[: size.value]

    def close(self) -> None:
        if self.ptr:
            _close_fid(self.ptr, "ep")
            self.ptr = None
