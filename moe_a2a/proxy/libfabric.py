"""ctypes shim over ``libfabric.so.1`` (API 1.17 to 1.22): RDM endpoints, RMA writes with immediates, CQs.

Scope: exactly what the transfer engine needs, nothing more. Most ``fi_*`` calls are ``static inline``
functions in the headers that call through ops tables (``ep->rma->writemsg(...)``), so this module mirrors
the C structs with the header's names, resolves each ops-table function pointer **once** per object and
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
    CFUNCTYPE,
    POINTER,
    Structure,
    Union,
    byref,
    c_char_p,
    c_int,
    c_size_t,
    c_ssize_t,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
    sizeof,
)

# --------------------------------------------------------------------------------------------------
# Constants (header names; checked against the C headers by the layout test)
# --------------------------------------------------------------------------------------------------


def FI_VERSION(major: int, minor: int) -> int:
    return (major << 16) | minor


FI_MSG = 1 << 1
FI_RMA = 1 << 2
FI_READ = 1 << 8
FI_WRITE = 1 << 9
FI_RECV = 1 << 10
FI_SEND = 1 << 11
FI_TRANSMIT = FI_SEND
FI_REMOTE_READ = 1 << 12
FI_REMOTE_WRITE = 1 << 13
FI_REMOTE_CQ_DATA = 1 << 17
FI_COMPLETION = 1 << 24
FI_HMEM = 1 << 47
FI_LOCAL_COMM = 1 << 51  # secondary caps: peers on this host / on other hosts
FI_REMOTE_COMM = 1 << 52
FI_NUMERICHOST = 1 << 55  # fi_getinfo flags: ``node`` is a numeric address...
FI_SOURCE = 1 << 57  # ...and the local (source) address to bind to, not a destination
FI_CONTEXT = 1 << 59

FI_MR_LOCAL = 1 << 2
FI_MR_VIRT_ADDR = 1 << 4
FI_MR_ALLOCATED = 1 << 5
FI_MR_PROV_KEY = 1 << 6
FI_MR_HMEM = 1 << 10
# Not in the 1.17 headers: a flag of ``fi_mr_regattr`` since libfabric 1.20 (fi_domain.h).
FI_MR_DMABUF = 1 << 40

FI_EP_RDM = 3  # enum fi_ep_type
FI_AV_TABLE = 2  # enum fi_av_type
FI_CQ_FORMAT_DATA = 3  # enum fi_cq_format
FI_WAIT_NONE = 0  # enum fi_wait_obj
FI_ENABLE = 6  # enum fi_control command
FI_THREAD_SAFE = 1  # enum fi_threading
FI_THREAD_DOMAIN = 3  # the application serialises all access to a domain's objects
THREADING_NAMES = {0: "FI_THREAD_UNSPEC", FI_THREAD_SAFE: "FI_THREAD_SAFE", 2: "FI_THREAD_FID",
                   FI_THREAD_DOMAIN: "FI_THREAD_DOMAIN", 4: "FI_THREAD_COMPLETION", 5: "FI_THREAD_ENDPOINT"}
FI_OPT_ENDPOINT = 0  # fi_setopt level
# fi_setopt name (bool), since the 1.18 headers: whether the provider may call the CUDA API in its data path.
FI_OPT_CUDA_API_PERMITTED = 10
FI_HMEM_SYSTEM = 0  # enum fi_hmem_iface
FI_HMEM_CUDA = 1

FI_ADDR_UNSPEC = (1 << 64) - 1

# errno values (fi_errno.h: FI_E* < 256 are the system errno values)
FI_EAGAIN = _errno.EAGAIN
FI_EINVAL = _errno.EINVAL
FI_ENOPROTOOPT = _errno.ENOPROTOOPT
FI_EOPNOTSUPP = _errno.EOPNOTSUPP
FI_ENOSYS = _errno.ENOSYS
FI_ENODATA = _errno.ENODATA
FI_EOTHER = 256
FI_ETOOSMALL = 257
FI_EOPBADSTATE = 258
FI_EAVAIL = 259
FI_EBADFLAGS = 260
FI_ENOEQ = 261
FI_EDOMAIN = 262
FI_ENOCQ = 263
FI_ECRC = 264
FI_ETRUNC = 265
FI_ENOKEY = 266
FI_ENOAV = 267
FI_EOVERRUN = 268
FI_ENORX = 269

_FI_ERRNO_NAMES = {
    FI_EOTHER: "FI_EOTHER", FI_ETOOSMALL: "FI_ETOOSMALL", FI_EOPBADSTATE: "FI_EOPBADSTATE",
    FI_EAVAIL: "FI_EAVAIL", FI_EBADFLAGS: "FI_EBADFLAGS", FI_ENOEQ: "FI_ENOEQ", FI_EDOMAIN: "FI_EDOMAIN",
    FI_ENOCQ: "FI_ENOCQ", FI_ECRC: "FI_ECRC", FI_ETRUNC: "FI_ETRUNC", FI_ENOKEY: "FI_ENOKEY",
    FI_ENOAV: "FI_ENOAV", FI_EOVERRUN: "FI_EOVERRUN", FI_ENORX: "FI_ENORX",
}

# API versions. We request min(library version, API_NEWEST): a library keeps the layouts of every API
# version it offers for callers that request it, and API_NEWEST is the newest whose layouts are mirrored
# below and checked against its headers (a 2.x library is asked for 1.22: 2.0 changed semantics too).
API_OLDEST = FI_VERSION(1, 17)
API_NEWEST = FI_VERSION(1, 22)
# efa below 1.18: RDMA write is emulated with sends on some device revisions and FI_HMEM is not offered
# (fi_efa(7); prov/efa/src/efa_user_info.c, rdm/efa_rdm_util.c); hardware RDMA write first shipped in 1.18.
EFA_API_MIN = FI_VERSION(1, 18)
# Newest library major version accepted (2.x still serves 1.x API requests; 3.x may not).
_LIBRARY_MAJOR_MAX = 2


def version_str(version: int) -> str:
    """``"1.22"`` for ``FI_VERSION(1, 22)``."""
    return f"{version >> 16}.{version & 0xFFFF}"


def negotiate_api(library_version: int) -> int:
    """The API version to request from a library of ``library_version`` (an ``FI_VERSION``): the newest
    both offer. ``OSError`` for a library older than 1.17 or of a major version after 2."""
    if library_version < API_OLDEST or library_version >> 16 > _LIBRARY_MAJOR_MAX:
        raise OSError(f"libfabric {version_str(library_version)}: this shim needs libfabric >= 1.17 and < "
                      f"{_LIBRARY_MAJOR_MAX + 1}.0 (it mirrors the API 1.17 to {version_str(API_NEWEST)} layouts)")
    return min(library_version, API_NEWEST)

# --------------------------------------------------------------------------------------------------
# Struct mirrors (x86-64, libfabric 1.17-1.22). Ops tables keep raw function pointers as c_void_p; the
# prototypes are applied once, when an object is opened. A struct that grew is mirrored per layout: the
# header's name for the newest (API 1.22), ``<name>_<first API version>`` for older ones.
# --------------------------------------------------------------------------------------------------


class iovec(Structure):
    _fields_ = [("iov_base", c_void_p), ("iov_len", c_size_t)]


class fi_ops(Structure):
    _fields_ = [("size", c_size_t), ("close", c_void_p), ("bind", c_void_p), ("control", c_void_p),
                ("ops_open", c_void_p), ("tostr", c_void_p), ("ops_set", c_void_p)]


class fid(Structure):
    _fields_ = [("fclass", c_size_t), ("context", c_void_p), ("ops", c_void_p)]  # ops: fi_ops*


class fi_context(Structure):
    _fields_ = [("internal", c_void_p * 4)]


class fi_tx_attr(Structure):
    _fields_ = [("caps", c_uint64), ("mode", c_uint64), ("op_flags", c_uint64), ("msg_order", c_uint64),
                ("comp_order", c_uint64), ("inject_size", c_size_t), ("size", c_size_t),
                ("iov_limit", c_size_t), ("rma_iov_limit", c_size_t), ("tclass", c_uint32)]


class fi_rx_attr(Structure):
    _fields_ = [("caps", c_uint64), ("mode", c_uint64), ("op_flags", c_uint64), ("msg_order", c_uint64),
                ("comp_order", c_uint64), ("total_buffered_recv", c_size_t), ("size", c_size_t),
                ("iov_limit", c_size_t)]


class fi_ep_attr(Structure):
    _fields_ = [("type", c_int), ("protocol", c_uint32), ("protocol_version", c_uint32),
                ("max_msg_size", c_size_t), ("msg_prefix_size", c_size_t),
                ("max_order_raw_size", c_size_t), ("max_order_war_size", c_size_t),
                ("max_order_waw_size", c_size_t), ("mem_tag_format", c_uint64), ("tx_ctx_cnt", c_size_t),
                ("rx_ctx_cnt", c_size_t), ("auth_key_size", c_size_t), ("auth_key", POINTER(c_uint8))]


class fi_domain_attr_1_17(Structure):
    """``fi_domain_attr`` up to the 1.19 headers."""
    _fields_ = [("domain", c_void_p), ("name", c_char_p), ("threading", c_int),
                ("control_progress", c_int), ("data_progress", c_int), ("resource_mgmt", c_int),
                ("av_type", c_int), ("mr_mode", c_int), ("mr_key_size", c_size_t),
                ("cq_data_size", c_size_t), ("cq_cnt", c_size_t), ("ep_cnt", c_size_t),
                ("tx_ctx_cnt", c_size_t), ("rx_ctx_cnt", c_size_t), ("max_ep_tx_ctx", c_size_t),
                ("max_ep_rx_ctx", c_size_t), ("max_ep_stx_ctx", c_size_t), ("max_ep_srx_ctx", c_size_t),
                ("cntr_cnt", c_size_t), ("mr_iov_limit", c_size_t), ("caps", c_uint64), ("mode", c_uint64),
                ("auth_key", POINTER(c_uint8)), ("auth_key_size", c_size_t), ("max_err_data", c_size_t),
                ("mr_cnt", c_size_t), ("tclass", c_uint32)]


class fi_domain_attr(Structure):
    """Since the 1.20 headers: ``max_ep_auth_key`` appended. The library allocates every ``fi_info``
    (``fi_dupinfo``, ``fi_getinfo``): we only read and set fields of the common prefix."""
    _fields_ = fi_domain_attr_1_17._fields_ + [("max_ep_auth_key", c_size_t)]


class fi_fabric_attr(Structure):
    # char* fields are c_void_p (not c_char_p): they may be replaced by libc strdup pointers that
    # fi_freeinfo frees, and ctypes must not own or copy them.
    _fields_ = [("fabric", c_void_p), ("name", c_void_p), ("prov_name", c_void_p),
                ("prov_version", c_uint32), ("api_version", c_uint32)]


class fi_info(Structure):
    pass


fi_info._fields_ = [
    ("next", POINTER(fi_info)), ("caps", c_uint64), ("mode", c_uint64), ("addr_format", c_uint32),
    ("src_addrlen", c_size_t), ("dest_addrlen", c_size_t), ("src_addr", c_void_p), ("dest_addr", c_void_p),
    ("handle", c_void_p), ("tx_attr", POINTER(fi_tx_attr)), ("rx_attr", POINTER(fi_rx_attr)),
    ("ep_attr", POINTER(fi_ep_attr)), ("domain_attr", POINTER(fi_domain_attr)),
    ("fabric_attr", POINTER(fi_fabric_attr)), ("nic", c_void_p)]


class fi_ops_fabric(Structure):
    _fields_ = [("size", c_size_t), ("domain", c_void_p), ("passive_ep", c_void_p), ("eq_open", c_void_p),
                ("wait_open", c_void_p), ("trywait", c_void_p), ("domain2", c_void_p)]


class fid_fabric(Structure):
    _fields_ = [("fid", fid), ("ops", c_void_p), ("api_version", c_uint32)]


class fi_ops_domain(Structure):
    _fields_ = [("size", c_size_t), ("av_open", c_void_p), ("cq_open", c_void_p), ("endpoint", c_void_p),
                ("scalable_ep", c_void_p), ("cntr_open", c_void_p), ("poll_open", c_void_p),
                ("stx_ctx", c_void_p), ("srx_ctx", c_void_p), ("query_atomic", c_void_p),
                ("query_collective", c_void_p), ("endpoint2", c_void_p)]


class fi_ops_mr(Structure):
    _fields_ = [("size", c_size_t), ("reg", c_void_p), ("regv", c_void_p), ("regattr", c_void_p)]


class fid_domain(Structure):
    _fields_ = [("fid", fid), ("ops", c_void_p), ("mr", c_void_p)]


class fid_mr(Structure):
    _fields_ = [("fid", fid), ("mem_desc", c_void_p), ("key", c_uint64)]


class _fi_mr_attr_device(Union):
    _fields_ = [("reserved", c_uint64), ("cuda", c_int), ("ze", c_int), ("neuron", c_int),
                ("synapseai", c_int)]


class fi_mr_attr_1_17(Structure):
    """``fi_mr_attr`` of the 1.17 and 1.18 headers. The first field is ``const struct iovec *mr_iov``;
    since 1.20 it is a union with ``const struct fi_mr_dmabuf *dmabuf`` (same offset), chosen by
    ``FI_MR_DMABUF``."""
    _fields_ = [("mr_iov", c_void_p), ("iov_count", c_size_t), ("access", c_uint64), ("offset", c_uint64),
                ("requested_key", c_uint64), ("context", c_void_p), ("auth_key_size", c_size_t),
                ("auth_key", POINTER(c_uint8)), ("iface", c_int), ("device", _fi_mr_attr_device)]


class fi_mr_attr_1_19(Structure):
    """Since 1.19: ``hmem_data`` appended (read at API >= 1.19 when the domain has FI_HMEM)."""
    _fields_ = fi_mr_attr_1_17._fields_ + [("hmem_data", c_void_p)]


class fi_mr_attr(Structure):
    """Since 1.22: ``page_size`` appended (read at API >= 1.22; 0: the system's)."""
    _fields_ = fi_mr_attr_1_19._fields_ + [("page_size", c_size_t)]


class fi_mr_dmabuf(Structure):
    """Since the 1.20 headers (absent before: :func:`mirrored_structs` leaves it out below API 1.20)."""
    _fields_ = [("fd", c_int), ("offset", c_uint64), ("len", c_size_t), ("base_addr", c_void_p)]


class fi_av_attr(Structure):
    _fields_ = [("type", c_int), ("rx_ctx_bits", c_int), ("count", c_size_t), ("ep_per_node", c_size_t),
                ("name", c_char_p), ("map_addr", c_void_p), ("flags", c_uint64)]


class fi_ops_av_1_17(Structure):
    _fields_ = [("size", c_size_t), ("insert", c_void_p), ("insertsvc", c_void_p), ("insertsym", c_void_p),
                ("remove", c_void_p), ("lookup", c_void_p), ("straddr", c_void_p), ("av_set", c_void_p)]


class fi_ops_av(Structure):
    """Since 1.20: three entries appended (auth keys, user ids); we call none of them."""
    _fields_ = fi_ops_av_1_17._fields_ + [("insert_auth_key", c_void_p), ("lookup_auth_key", c_void_p),
                                          ("set_user_id", c_void_p)]


class fid_av(Structure):
    _fields_ = [("fid", fid), ("ops", c_void_p)]


class fi_cq_attr(Structure):
    _fields_ = [("size", c_size_t), ("flags", c_uint64), ("format", c_int), ("wait_obj", c_int),
                ("signaling_vector", c_int), ("wait_cond", c_int), ("wait_set", c_void_p)]


class fi_cq_data_entry(Structure):
    _fields_ = [("op_context", c_void_p), ("flags", c_uint64), ("len", c_size_t), ("buf", c_void_p),
                ("data", c_uint64)]


class fi_cq_err_entry_1_17(Structure):
    """``fi_cq_err_entry`` as ``fi_cq_readerr`` fills it at API 1.5 to 1.19 (80 bytes; the layout of the
    1.17 to 1.19 headers)."""
    _fields_ = [("op_context", c_void_p), ("flags", c_uint64), ("len", c_size_t), ("buf", c_void_p),
                ("data", c_uint64), ("tag", c_uint64), ("olen", c_size_t), ("err", c_int),
                ("prov_errno", c_int), ("err_data", c_void_p), ("err_data_size", c_size_t)]


class fi_cq_err_entry(Structure):
    """Since 1.20: ``src_addr`` appended; at API >= 1.20 ``fi_cq_readerr`` copies all 88 bytes, so a
    1.5-sized entry would be overrun by 8."""
    _fields_ = fi_cq_err_entry_1_17._fields_ + [("src_addr", c_uint64)]


class fi_ops_cq(Structure):
    _fields_ = [("size", c_size_t), ("read", c_void_p), ("readfrom", c_void_p), ("readerr", c_void_p),
                ("sread", c_void_p), ("sreadfrom", c_void_p), ("signal", c_void_p), ("strerror", c_void_p)]


class fid_cq(Structure):
    _fields_ = [("fid", fid), ("ops", c_void_p)]


class fi_ops_ep(Structure):
    _fields_ = [("size", c_size_t), ("cancel", c_void_p), ("getopt", c_void_p), ("setopt", c_void_p),
                ("tx_ctx", c_void_p), ("rx_ctx", c_void_p), ("rx_size_left", c_void_p),
                ("tx_size_left", c_void_p)]


class fi_ops_cm(Structure):
    _fields_ = [("size", c_size_t), ("setname", c_void_p), ("getname", c_void_p), ("getpeer", c_void_p),
                ("connect", c_void_p), ("listen", c_void_p), ("accept", c_void_p), ("reject", c_void_p),
                ("shutdown", c_void_p), ("join", c_void_p)]


class fi_ops_rma(Structure):
    _fields_ = [("size", c_size_t), ("read", c_void_p), ("readv", c_void_p), ("readmsg", c_void_p),
                ("write", c_void_p), ("writev", c_void_p), ("writemsg", c_void_p), ("inject", c_void_p),
                ("writedata", c_void_p), ("injectdata", c_void_p)]


class fid_ep(Structure):
    _fields_ = [("fid", fid), ("ops", c_void_p), ("cm", c_void_p), ("msg", c_void_p), ("rma", c_void_p),
                ("tagged", c_void_p), ("atomic", c_void_p), ("collective", c_void_p)]


class fi_rma_iov(Structure):
    _fields_ = [("addr", c_uint64), ("len", c_size_t), ("key", c_uint64)]


class fi_msg_rma(Structure):
    _fields_ = [("msg_iov", c_void_p), ("desc", c_void_p), ("iov_count", c_size_t), ("addr", c_uint64),
                ("rma_iov", c_void_p), ("rma_iov_count", c_size_t), ("context", c_void_p), ("data", c_uint64)]


# Every mirrored struct by its header name, in its newest layout (API_NEWEST); the layout tests generate
# their C programs from `mirrored_structs` so the check cannot drift from the definitions above.
MIRRORED_STRUCTS = {
    "iovec": iovec, "fid": fid, "fi_ops": fi_ops, "fi_context": fi_context, "fi_tx_attr": fi_tx_attr,
    "fi_rx_attr": fi_rx_attr, "fi_ep_attr": fi_ep_attr, "fi_domain_attr": fi_domain_attr,
    "fi_fabric_attr": fi_fabric_attr, "fi_info": fi_info, "fi_ops_fabric": fi_ops_fabric,
    "fid_fabric": fid_fabric, "fi_ops_domain": fi_ops_domain, "fi_ops_mr": fi_ops_mr,
    "fid_domain": fid_domain, "fid_mr": fid_mr, "fi_mr_attr": fi_mr_attr, "fi_mr_dmabuf": fi_mr_dmabuf,
    "fi_av_attr": fi_av_attr, "fi_ops_av": fi_ops_av, "fid_av": fid_av, "fi_cq_attr": fi_cq_attr,
    "fi_cq_data_entry": fi_cq_data_entry, "fi_cq_err_entry": fi_cq_err_entry, "fi_ops_cq": fi_ops_cq,
    "fid_cq": fid_cq, "fi_ops_ep": fi_ops_ep, "fi_ops_cm": fi_ops_cm, "fi_ops_rma": fi_ops_rma,
    "fid_ep": fid_ep, "fi_rma_iov": fi_rma_iov, "fi_msg_rma": fi_msg_rma,
}
# Older layouts: header name -> ((API version up to which this layout holds, its mirror), ...), oldest
# first; from the next version on the next entry (or MIRRORED_STRUCTS) applies. None: not in the headers.
_OLDER_LAYOUTS = {
    "fi_domain_attr": ((FI_VERSION(1, 19), fi_domain_attr_1_17),),
    "fi_ops_av": ((FI_VERSION(1, 19), fi_ops_av_1_17),),
    "fi_cq_err_entry": ((FI_VERSION(1, 19), fi_cq_err_entry_1_17),),
    "fi_mr_dmabuf": ((FI_VERSION(1, 19), None),),
    "fi_mr_attr": ((FI_VERSION(1, 18), fi_mr_attr_1_17), (FI_VERSION(1, 21), fi_mr_attr_1_19)),
}


def mirrored_structs(api: int) -> dict[str, type]:
    """The mirror of every struct as the headers of API version ``api`` (1.17 to API_NEWEST) lay it out."""
    if not API_OLDEST <= api <= API_NEWEST:
        raise ValueError(f"mirrored_structs: API version {version_str(api)} outside the mirrored "
                         f"{version_str(API_OLDEST)}..{version_str(API_NEWEST)}")
    out = {}
    for name, newest in MIRRORED_STRUCTS.items():
        cls = newest
        for until, older in _OLDER_LAYOUTS.get(name, ()):
            if api <= until:
                cls = older
                break
        if cls is not None:
            out[name] = cls
    return out


# Header constants checked by the layout tests (name -> value as mirrored here).
MIRRORED_CONSTANTS = {
    name: globals()[name] for name in (
        "FI_MSG", "FI_RMA", "FI_READ", "FI_WRITE", "FI_RECV", "FI_SEND", "FI_TRANSMIT", "FI_REMOTE_READ",
        "FI_REMOTE_WRITE", "FI_REMOTE_CQ_DATA", "FI_COMPLETION", "FI_HMEM", "FI_CONTEXT", "FI_NUMERICHOST",
        "FI_SOURCE", "FI_LOCAL_COMM", "FI_REMOTE_COMM", "FI_MR_LOCAL",
        "FI_MR_VIRT_ADDR", "FI_MR_ALLOCATED", "FI_MR_PROV_KEY", "FI_MR_HMEM", "FI_MR_DMABUF", "FI_EP_RDM",
        "FI_AV_TABLE", "FI_CQ_FORMAT_DATA", "FI_WAIT_NONE", "FI_ENABLE", "FI_THREAD_SAFE", "FI_THREAD_DOMAIN", "FI_OPT_ENDPOINT",
        "FI_OPT_CUDA_API_PERMITTED", "FI_HMEM_SYSTEM", "FI_HMEM_CUDA", "FI_ADDR_UNSPEC",
        "FI_EAGAIN", "FI_EINVAL", "FI_ENOSYS", "FI_ENODATA", "FI_ENOPROTOOPT", "FI_EOPNOTSUPP", "FI_EOTHER",
        "FI_EAVAIL", "FI_ETRUNC", "FI_EOVERRUN", "FI_ENORX")
}
# First API version whose headers define a constant (the rest are in every version mirrored).
_CONSTANT_SINCE = {"FI_OPT_CUDA_API_PERMITTED": FI_VERSION(1, 18), "FI_MR_DMABUF": FI_VERSION(1, 20)}


def mirrored_constants(api: int) -> dict[str, int]:
    """The constants the headers of API version ``api`` define, with our values."""
    return {k: v for k, v in MIRRORED_CONSTANTS.items() if _CONSTANT_SINCE.get(k, API_OLDEST) <= api}


# --------------------------------------------------------------------------------------------------
# Where a domain's NIC sits: ``fi_info->nic`` (``struct fid_nic``, fabric.h), read by proxy/topology.py
# to match NICs with GPUs by PCIe switch. Read only; ``fi_info.nic`` stays a bare pointer above.
# --------------------------------------------------------------------------------------------------
FI_BUS_UNSPEC = 0  # enum fi_bus_type
FI_BUS_PCI = 1


class fi_device_attr(Structure):
    _fields_ = [("name", c_char_p), ("device_id", c_char_p), ("device_version", c_char_p),
                ("vendor_id", c_char_p), ("driver", c_char_p), ("firmware", c_char_p)]


class fi_pci_attr(Structure):
    _fields_ = [("domain_id", c_uint16), ("bus_id", c_uint8), ("device_id", c_uint8), ("function_id", c_uint8)]


class _fi_bus_attr_attr(Union):
    _fields_ = [("pci", fi_pci_attr)]


class fi_bus_attr(Structure):
    _fields_ = [("bus_type", c_int), ("attr", _fi_bus_attr_attr)]


class fi_link_attr(Structure):
    _fields_ = [("address", c_char_p), ("mtu", c_size_t), ("speed", c_size_t), ("state", c_int),
                ("network_type", c_char_p)]


class fid_nic(Structure):
    _fields_ = [("fid", fid), ("device_attr", POINTER(fi_device_attr)), ("bus_attr", POINTER(fi_bus_attr)),
                ("link_attr", POINTER(fi_link_attr)), ("prov_attr", c_void_p)]


MIRRORED_STRUCTS.update({"fi_device_attr": fi_device_attr, "fi_pci_attr": fi_pci_attr, "fi_bus_attr": fi_bus_attr,
                         "fi_link_attr": fi_link_attr, "fid_nic": fid_nic})
MIRRORED_CONSTANTS.update({"FI_BUS_UNSPEC": FI_BUS_UNSPEC, "FI_BUS_PCI": FI_BUS_PCI})


def nic_pci_address(nic: int | None) -> str | None:
    """The PCI address ("0000:4f:00.0") of the ``struct fid_nic`` at ``nic`` (an ``fi_info.nic``), or
    None when there is none or its bus is not PCI (tcp and shm domains)."""
    if not nic:
        return None
    bus = fid_nic.from_address(nic).bus_attr
    if not bus or bus.contents.bus_type != FI_BUS_PCI:
        return None
    p = bus.contents.attr.pci
    return f"{p.domain_id:04x}:{p.bus_id:02x}:{p.device_id:02x}.{p.function_id:x}"


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

# --------------------------------------------------------------------------------------------------
# Function prototypes of ops-table entries (resolved per object, once)
# --------------------------------------------------------------------------------------------------

_CLOSE = CFUNCTYPE(c_int, c_void_p)
_BIND = CFUNCTYPE(c_int, c_void_p, c_void_p, c_uint64)
_CONTROL = CFUNCTYPE(c_int, c_void_p, c_int, c_void_p)
_FABRIC_DOMAIN = CFUNCTYPE(c_int, c_void_p, c_void_p, POINTER(c_void_p), c_void_p)
_DOMAIN_AV_OPEN = CFUNCTYPE(c_int, c_void_p, POINTER(fi_av_attr), POINTER(c_void_p), c_void_p)
_DOMAIN_CQ_OPEN = CFUNCTYPE(c_int, c_void_p, POINTER(fi_cq_attr), POINTER(c_void_p), c_void_p)
_DOMAIN_ENDPOINT = CFUNCTYPE(c_int, c_void_p, c_void_p, POINTER(c_void_p), c_void_p)
_MR_REG = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_uint64, c_uint64, c_uint64, c_uint64,
                    POINTER(c_void_p), c_void_p)
_MR_REGATTR = CFUNCTYPE(c_int, c_void_p, c_void_p, c_uint64, POINTER(c_void_p))
_AV_INSERT = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, POINTER(c_uint64), c_uint64, c_void_p)
_CM_GETNAME = CFUNCTYPE(c_int, c_void_p, c_void_p, POINTER(c_size_t))
_EP_SETOPT = CFUNCTYPE(c_int, c_void_p, c_int, c_int, c_void_p, c_size_t)
_CQ_READERR = CFUNCTYPE(c_ssize_t, c_void_p, c_void_p, c_uint64)  # the entry's type depends on the API
_CQ_STRERROR = CFUNCTYPE(c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_size_t)
# Hot paths: every integer argument as c_void_p (ctypes converts a Python int to a pointer faster than
# to c_uint64/c_size_t; measured 0.6 µs instead of 1.2-1.5 µs per call). Returns ssize_t.
WRITEMSG_PROTO = CFUNCTYPE(c_ssize_t, c_void_p, c_void_p, c_void_p)  # (ep, const fi_msg_rma*, flags)
CQ_READ_PROTO = CFUNCTYPE(c_ssize_t, c_void_p, c_void_p, c_void_p)  # (cq, buf, count)

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
                        dmabuf_fd: int | None = None, dmabuf_offset: int = 0) -> "MR":
        """Register GPU memory with ``iface = FI_HMEM_CUDA``: by virtual address, or by DMA-BUF fd
        (``FI_MR_DMABUF``, API >= 1.20 only). Raises :class:`HmemUnsupported` when the
        provider or build cannot (e.g. shm without CUDA support returns ``-FI_ENOSYS``)."""
        if not self.info.caps & FI_HMEM:
            raise HmemUnsupported("fi_mr_regattr", -FI_ENOSYS,
                                  f"provider {self.info.prov_name} was opened without FI_HMEM")
        flags = 0
        iov = iovec(addr, nbytes)
        dmabuf = fi_mr_dmabuf(fd=dmabuf_fd or 0, offset=dmabuf_offset, len=nbytes, base_addr=addr)
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
            raise HmemUnsupported("fi_mr_regattr", rc, f"FI_HMEM_CUDA device {cuda_device} addr={addr:#x} "
                                  f"nbytes={nbytes} on {self.info.prov_name}")
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

    def forbid_cuda_api(self) -> str:
        """``FI_OPT_CUDA_API_PERMITTED = false`` (before ``fi_enable``): the provider must not call CUDA in
        its data path (a CUDA call from the proxy may wait on the model's work). Returns the outcome:
        ``"false"``, or why it stays as the provider has it; ``FabricError`` for an unexpected refusal."""
        rc = self.setopt(FI_OPT_CUDA_API_PERMITTED, ctypes.c_bool(False))
        if rc == 0:
            return "false"
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
