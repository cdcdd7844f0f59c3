"""ctypes shim over ``libfabric.so.1`` (API 1.17): RDM endpoints, RMA writes with immediates, CQs.

Scope: exactly what the transfer engine needs, nothing more. Most ``fi_*`` calls are ``static inline``
functions in the headers that call through ops tables (``ep->rma->writemsg(...)``), so this module mirrors
the C structs with the header's names, resolves each ops-table function pointer **once** per object and
declares the hot ones (``writemsg``, ``cq read``) with ``c_void_p`` integer arguments: measured on the CI
machine, that halves the ctypes cost of a call (0.6 µs instead of 1.2-1.5 µs).

Layouts are those of libfabric 1.17 on x86-64 (``tests/proxy/test_libfabric_layout.py`` checks every
mirrored field against the C compiler on the installed headers; re-run it against any other libfabric).

Object lifetime: close in the reverse order of creation: endpoint, then AV and CQ, then MRs, then the
domain, then the fabric (a domain with open MRs/endpoints refuses to close with ``-FI_EBUSY``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
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
FI_HMEM_SYSTEM = 0  # enum fi_hmem_iface
FI_HMEM_CUDA = 1

FI_ADDR_UNSPEC = (1 << 64) - 1

# errno values (fi_errno.h: FI_E* < 256 are the system errno values)
FI_EAGAIN = _errno.EAGAIN
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

# The API version we ask for. Structs below are the 1.17 layouts; a newer library keeps them for
# callers that request 1.17 (attribute structs only grow at the end, ops tables too).
API_VERSION = FI_VERSION(1, 17)

# --------------------------------------------------------------------------------------------------
# Struct mirrors (x86-64, libfabric 1.17). Ops tables keep raw function pointers as c_void_p; the
# prototypes are applied once, when an object is opened.
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


class fi_domain_attr(Structure):
    _fields_ = [("domain", c_void_p), ("name", c_char_p), ("threading", c_int),
                ("control_progress", c_int), ("data_progress", c_int), ("resource_mgmt", c_int),
                ("av_type", c_int), ("mr_mode", c_int), ("mr_key_size", c_size_t),
                ("cq_data_size", c_size_t), ("cq_cnt", c_size_t), ("ep_cnt", c_size_t),
                ("tx_ctx_cnt", c_size_t), ("rx_ctx_cnt", c_size_t), ("max_ep_tx_ctx", c_size_t),
                ("max_ep_rx_ctx", c_size_t), ("max_ep_stx_ctx", c_size_t), ("max_ep_srx_ctx", c_size_t),
                ("cntr_cnt", c_size_t), ("mr_iov_limit", c_size_t), ("caps", c_uint64), ("mode", c_uint64),
                ("auth_key", POINTER(c_uint8)), ("auth_key_size", c_size_t), ("max_err_data", c_size_t),
                ("mr_cnt", c_size_t), ("tclass", c_uint32)]


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


class fi_mr_attr(Structure):
    # First field is ``const struct iovec *mr_iov``; since 1.20 it is a union with
    # ``const struct fi_mr_dmabuf *dmabuf`` (same offset), selected by FI_MR_DMABUF.
    _fields_ = [("mr_iov", c_void_p), ("iov_count", c_size_t), ("access", c_uint64), ("offset", c_uint64),
                ("requested_key", c_uint64), ("context", c_void_p), ("auth_key_size", c_size_t),
                ("auth_key", POINTER(c_uint8)), ("iface", c_int), ("device", _fi_mr_attr_device)]


class fi_mr_dmabuf(Structure):
    """Not in the 1.17 headers (added in 1.20); mirrored from the 1.20 ``fi_domain.h``. The layout test
    checks it only where the installed headers define it."""
    _fields_ = [("fd", c_int), ("offset", c_uint64), ("len", c_size_t), ("base_addr", c_void_p)]


class fi_av_attr(Structure):
    _fields_ = [("type", c_int), ("rx_ctx_bits", c_int), ("count", c_size_t), ("ep_per_node", c_size_t),
                ("name", c_char_p), ("map_addr", c_void_p), ("flags", c_uint64)]


class fi_ops_av(Structure):
    _fields_ = [("size", c_size_t), ("insert", c_void_p), ("insertsvc", c_void_p), ("insertsym", c_void_p),
                ("remove", c_void_p), ("lookup", c_void_p), ("straddr", c_void_p), ("av_set", c_void_p)]


class fid_av(Structure):
    _fields_ = [("fid", fid), ("ops", c_void_p)]


class fi_cq_attr(Structure):
    _fields_ = [("size", c_size_t), ("flags", c_uint64), ("format", c_int), ("wait_obj", c_int),
                ("signaling_vector", c_int), ("wait_cond", c_int), ("wait_set", c_void_p)]


class fi_cq_data_entry(Structure):
    _fields_ = [("op_context", c_void_p), ("flags", c_uint64), ("len", c_size_t), ("buf", c_void_p),
                ("data", c_uint64)]


class fi_cq_err_entry(Structure):
    _fields_ = [("op_context", c_void_p), ("flags", c_uint64), ("len", c_size_t), ("buf", c_void_p),
                ("data", c_uint64), ("tag", c_uint64), ("olen", c_size_t), ("err", c_int),
                ("prov_errno", c_int), ("err_data", c_void_p), ("err_data_size", c_size_t)]


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


# Every mirrored struct with the header that defines it; the layout test generates its C program from
# this table so the check cannot drift from the definitions above.
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
# Header constants checked by the layout test (name -> value as mirrored here).
MIRRORED_CONSTANTS = {
    name: globals()[name] for name in (
        "FI_MSG", "FI_RMA", "FI_READ", "FI_WRITE", "FI_RECV", "FI_SEND", "FI_TRANSMIT", "FI_REMOTE_READ",
        "FI_REMOTE_WRITE", "FI_REMOTE_CQ_DATA", "FI_COMPLETION", "FI_HMEM", "FI_CONTEXT", "FI_NUMERICHOST",
        "FI_SOURCE", "FI_MR_LOCAL",
        "FI_MR_VIRT_ADDR", "FI_MR_ALLOCATED", "FI_MR_PROV_KEY", "FI_MR_HMEM", "FI_EP_RDM", "FI_AV_TABLE",
        "FI_CQ_FORMAT_DATA", "FI_WAIT_NONE", "FI_ENABLE", "FI_HMEM_SYSTEM", "FI_HMEM_CUDA", "FI_ADDR_UNSPEC",
        "FI_EAGAIN", "FI_ENOSYS", "FI_ENODATA", "FI_EOTHER", "FI_EAVAIL", "FI_ETRUNC", "FI_EOVERRUN",
        "FI_ENORX")
}

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
_CQ_READERR = CFUNCTYPE(c_ssize_t, c_void_p, POINTER(fi_cq_err_entry), c_uint64)
_CQ_STRERROR = CFUNCTYPE(c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_size_t)
# Hot paths: every integer argument as c_void_p (ctypes converts a Python int to a pointer faster than
# to c_uint64/c_size_t; measured 0.6 µs instead of 1.2-1.5 µs per call). Returns ssize_t.
WRITEMSG_PROTO = CFUNCTYPE(c_ssize_t, c_void_p, c_void_p, c_void_p)  # (ep, const fi_msg_rma*, flags)
CQ_READ_PROTO = CFUNCTYPE(c_ssize_t, c_void_p, c_void_p, c_void_p)  # (cq, buf, count)

# --------------------------------------------------------------------------------------------------
# Library loading (at first use, never at import)
# --------------------------------------------------------------------------------------------------

_lib_cache: list = []  # [CDLL] once loaded; a list so no ``global`` statement is needed


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


def library() -> ctypes.CDLL:
    """Load ``libfabric.so.1`` (``MOE_A2A_LIBFABRIC`` overrides the path) and declare the exported
    functions we call. Raises ``OSError`` with what was tried if it cannot be loaded."""
    if _lib_cache:
        return _lib_cache[0]
    path = os.environ.get("MOE_A2A_LIBFABRIC") or ctypes.util.find_library("fabric") or "libfabric.so.1"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise OSError(
            f"cannot load libfabric from {path!r} ({e}); install it (Debian/Ubuntu: apt-get install "
            f"libfabric1) or point MOE_A2A_LIBFABRIC at libfabric.so.1") from e
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
    version = lib.fi_version()
    if version >> 16 != 1 or (version & 0xFFFF) < 17:
        raise OSError(f"libfabric at {path!r} is {version >> 16}.{version & 0xFFFF}; this shim mirrors the "
                      f"1.17 ABI and needs libfabric 1.x >= 1.17")
    _lib_cache.append(lib)
    return lib


def runtime_version() -> tuple[int, int]:
    """(major, minor) of the loaded library."""
    v = library().fi_version()
    return v >> 16, v & 0xFFFF


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
        self.tx_iov_limit = info.tx_attr.contents.iov_limit  # local iovecs per write (2: a header write)
        self.rx_size = info.rx_attr.contents.size
        self.max_msg_size = info.ep_attr.contents.max_msg_size
        self.info = chosen  # the ctypes struct (valid until close)

    @property
    def virt_addr(self) -> bool:
        """Remote addresses are virtual addresses (shm, efa); else offsets into the MR (tcp)."""
        return bool(self.mr_mode & FI_MR_VIRT_ADDR)

    @property
    def prov_key(self) -> bool:
        """The provider picks MR keys; otherwise the requested key is used and must be unique."""
        return bool(self.mr_mode & FI_MR_PROV_KEY)

    def close(self) -> None:
        if self._head is not None:
            library().fi_freeinfo(self._head)
            self._head = None

    def __repr__(self) -> str:
        return (f"Info(prov={self.prov_name!r}, domain={self.domain_name!r}, mr_mode={self.mr_mode:#x}, "
                f"cq_data_size={self.cq_data_size}, tx_size={self.tx_size})")


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


def _getinfo_raw(prov_name: str | None, *, hmem: bool, tx_size: int | None, source: str | None = None):
    """``fi_getinfo`` with our hints. ``source``: a numeric local address to bind endpoints to
    (``node`` with ``FI_SOURCE | FI_NUMERICHOST``): the tcp provider then listens on that address only,
    instead of the first interface's (checked with ``ss -ltn`` by tests/proxy/test_security.py)."""
    lib = library()
    hints = lib.fi_dupinfo(None)  # fi_allocinfo() is an inline wrapper of fi_dupinfo(NULL)
    if not hints:
        raise MemoryError("fi_dupinfo(NULL) returned NULL")
    try:
        h = hints.contents
        h.caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | (FI_HMEM if hmem else 0)
        h.mode = FI_CONTEXT
        h.ep_attr.contents.type = FI_EP_RDM
        d = h.domain_attr.contents
        d.mr_mode = (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY
                     | (FI_MR_HMEM if hmem else 0))
        d.av_type = FI_AV_TABLE
        if tx_size:
            h.tx_attr.contents.size = tx_size
        if prov_name:
            # fi_freeinfo frees this string: it must come from the C allocator.
            h.fabric_attr.contents.prov_name = _libc().strdup(prov_name.encode())
        out = POINTER(fi_info)()
        node, flags = (source.encode(), FI_SOURCE | FI_NUMERICHOST) if source else (None, 0)
        rc = lib.fi_getinfo(API_VERSION, node, None, flags, hints, byref(out))
    finally:
        lib.fi_freeinfo(hints)
    if rc == -FI_ENODATA:
        raise FabricError("fi_getinfo", rc, f"no provider {prov_name or '(any)'} offers RDM endpoints with "
                          f"RMA writes{' and FI_HMEM' if hmem else ''}"
                          f"{f' bound to {source}' if source else ''} here")
    _check("fi_getinfo", rc)
    return out


def _usable(provider: str, *, hmem: bool, tx_size: int | None, source: str | None = None):
    """(head of the fi_getinfo list, [the usable fi_info nodes]): RDM + RMA + >= 4 B of remote CQ data
    on ``provider`` (in 1.17 remote CQ data is not a capability bit: ``cq_data_size`` is checked)."""
    prov_name = PROVIDER_NAMES.get(provider, provider)
    head = _getinfo_raw(prov_name, hmem=hmem, tx_size=tx_size, source=source)
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
        return CQ(ptr.value)

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
        """Register GPU memory with ``iface = FI_HMEM_CUDA``: by virtual address (API 1.17), or by
        DMA-BUF fd (``FI_MR_DMABUF``, libfabric >= 1.20 only). Raises :class:`HmemUnsupported` when the
        provider or build cannot (e.g. shm without CUDA support returns ``-FI_ENOSYS``)."""
        if not self.info.caps & FI_HMEM:
            raise HmemUnsupported("fi_mr_regattr", -FI_ENOSYS,
                                  f"provider {self.info.prov_name} was opened without FI_HMEM")
        flags = 0
        iov = iovec(addr, nbytes)
        dmabuf = fi_mr_dmabuf(fd=dmabuf_fd or 0, offset=dmabuf_offset, len=nbytes, base_addr=addr)
        # Zeroed room after the 1.17 struct: newer libraries read fields appended later (hmem_data,
        # page_size, ...) and must see zeros there.
        raw = (c_uint8 * (sizeof(fi_mr_attr) + 64))()
        attr = fi_mr_attr.from_buffer(raw)
        if dmabuf_fd is not None:
            if runtime_version() < (1, 20):
                raise HmemUnsupported("fi_mr_regattr", -FI_ENOSYS,
                                      f"DMA-BUF registration needs libfabric >= 1.20, loaded "
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
    """A completion queue. ``read`` is the raw hot-path callable ``read(cq_ptr, buf_addr, count)``."""

    def __init__(self, ptr: int):
        self.ptr = ptr
        ops = fid_cq.from_address(ptr).ops
        self.read = _fn(CQ_READ_PROTO, ops, fi_ops_cq, "read")
        self._readerr = _fn(_CQ_READERR, ops, fi_ops_cq, "readerr")
        self._strerror = _fn(_CQ_STRERROR, ops, fi_ops_cq, "strerror")

    def readerr(self) -> tuple[fi_cq_err_entry, str]:
        """``fi_cq_readerr`` after a read returned ``-FI_EAVAIL``: the entry and a decoded message
        (``fi_strerror`` of ``err`` plus the provider's ``fi_cq_strerror`` of ``prov_errno``)."""
        entry = fi_cq_err_entry()
        rc = self._readerr(self.ptr, byref(entry), 0)
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

    def bind(self, obj_ptr: int, flags: int, what: str) -> None:
        """``fi_ep_bind`` (a CQ with ``FI_TRANSMIT|FI_RECV``, or an AV with 0)."""
        _check(f"fi_ep_bind({what})", self._bind(self.ptr, obj_ptr, flags))

    def enable(self) -> None:
        _check("fi_enable", self._control(self.ptr, FI_ENABLE, None))

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
