"""The libfabric header mirrored for ctypes (API 1.17 to 1.22): the constants, the structs with the header's
names (one per layout where a struct grew), which of them an API version has (`mirrored_structs`,
`mirrored_constants`), the NIC's bus attributes, and the prototypes of the ops-table entries. Declarations
only: nothing here loads or calls the library (`libfabric.py` does, and re-exports these names, so callers
write ``lf.FI_WRITE``, ``lf.fi_msg_rma``). Layouts are x86-64, checked by tests/proxy/test_libfabric_layout.py
and test_libfabric_versions.py."""
from __future__ import annotations

import errno as _errno
from ctypes import CFUNCTYPE, POINTER, Structure, Union, c_char_p, c_int, c_size_t, c_ssize_t, c_uint8, c_uint16, \
    c_uint32, c_uint64, c_void_p

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
# efa with GPU buffers: libfabric 1.18 and 1.19 reject cuMem allocations at registration unless
# FI_EFA_SET_CUDA_SYNC_MEMOPS=0 (their efa provider sets CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on every CUDA
# region; issue 44's reading of prov/efa at those tags, not run); FI_MR_DMABUF needs API 1.20 as well.
EFA_GPU_API_MIN = FI_VERSION(1, 20)
EFA_SYNC_MEMOPS_ENV = "FI_EFA_SET_CUDA_SYNC_MEMOPS"
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
    """Since the 1.20 headers (absent before: :func:`mirrored_structs` leaves it out below API 1.20).
    ``struct fi_mr_dmabuf {int fd; uint64_t offset; size_t len; void *base_addr;}`` as rdma/fi_domain.h of
    libfabric 1.20 to 1.22 declares it (read from the header text; Debian's 1.17 headers, which the
    compiled layout test uses, lack it, so its offsets are checked as data against the 1.20 and 1.22
    headers' in tests/proxy/test_libfabric_versions.py). efa registers ``len`` bytes at ``offset`` into the
    DMA-BUF with the remote address ``base_addr + offset`` (``ibv_reg_dmabuf_mr``, prov/efa/src/efa_mr.c)."""
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


def nic_device_id(nic: int | None) -> str | None:
    """``device_attr->device_id`` of the ``struct fid_nic`` at ``nic`` (efa: the PCI device id, e.g.
    ``"0xefa1"``, one per EFA device generation), or None when there is none."""
    if not nic:
        return None
    dev = fid_nic.from_address(nic).device_attr
    if not dev or not dev.contents.device_id:
        return None
    return dev.contents.device_id.decode(errors="replace")


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
