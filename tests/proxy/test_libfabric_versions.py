"""The shim's struct mirrors against the layouts of the libfabric 1.18 to 1.22 headers, and the API negotiation.

CI has only Debian's libfabric 1.17 headers (tests/proxy/test_libfabric_layout.py compiles against them), so
the layouts of the newer headers are kept here as data: (sizeof, "field offset size, ...") per struct, x86-64,
printed by gcc's ``offsetof``/``sizeof`` on the ``include/`` of the tags v1.18.0 to v1.22.0 of
ofiwg/libfabric, for the fields the shim mirrors (the program is ``test_libfabric_layout._c_program``;
``python -m tests.proxy.test_libfabric_layout <include dir> <x.y>`` prints one version's lines). Each version
after 1.18 lists only the structs that changed. A struct whose size differs from its mirror means a field
appended in that version and not mirrored.
"""
from __future__ import annotations

import ctypes
from ctypes import CFUNCTYPE, c_int, c_size_t, c_ssize_t, c_uint64, c_void_p

import pytest

from moe_a2a.proxy import libfabric as lf

LAYOUTS = {}
LAYOUTS["1.18"] = {
    "iovec": (16, "iov_base 0 8, iov_len 8 8"),
    "fid": (24, "fclass 0 8, context 8 8, ops 16 8"),
    "fi_ops": (56, "size 0 8, close 8 8, bind 16 8, control 24 8, ops_open 32 8, tostr 40 8, ops_set 48 8"),
    "fi_context": (32, "internal 0 32"),
    "fi_tx_attr": (80, "caps 0 8, mode 8 8, op_flags 16 8, msg_order 24 8, comp_order 32 8, inject_size 40 8, "
        "size 48 8, iov_limit 56 8, rma_iov_limit 64 8, tclass 72 4"),
    "fi_rx_attr": (64, "caps 0 8, mode 8 8, op_flags 16 8, msg_order 24 8, comp_order 32 8, "
        "total_buffered_recv 40 8, size 48 8, iov_limit 56 8"),
    "fi_ep_attr": (96, "type 0 4, protocol 4 4, protocol_version 8 4, max_msg_size 16 8, msg_prefix_size 24 8, "
        "max_order_raw_size 32 8, max_order_war_size 40 8, max_order_waw_size 48 8, mem_tag_format 56 8, "
        "tx_ctx_cnt 64 8, rx_ctx_cnt 72 8, auth_key_size 80 8, auth_key 88 8"),
    "fi_domain_attr": (192, "domain 0 8, name 8 8, threading 16 4, control_progress 20 4, data_progress 24 4, "
        "resource_mgmt 28 4, av_type 32 4, mr_mode 36 4, mr_key_size 40 8, cq_data_size 48 8, cq_cnt 56 8, "
        "ep_cnt 64 8, tx_ctx_cnt 72 8, rx_ctx_cnt 80 8, max_ep_tx_ctx 88 8, max_ep_rx_ctx 96 8, "
        "max_ep_stx_ctx 104 8, max_ep_srx_ctx 112 8, cntr_cnt 120 8, mr_iov_limit 128 8, caps 136 8, mode 144 8, "
        "auth_key 152 8, auth_key_size 160 8, max_err_data 168 8, mr_cnt 176 8, tclass 184 4"),
    "fi_fabric_attr": (32, "fabric 0 8, name 8 8, prov_name 16 8, prov_version 24 4, api_version 28 4"),
    "fi_info": (120, "next 0 8, caps 8 8, mode 16 8, addr_format 24 4, src_addrlen 32 8, dest_addrlen 40 8, "
        "src_addr 48 8, dest_addr 56 8, handle 64 8, tx_attr 72 8, rx_attr 80 8, ep_attr 88 8, domain_attr 96 8, "
        "fabric_attr 104 8, nic 112 8"),
    "fi_ops_fabric": (56, "size 0 8, domain 8 8, passive_ep 16 8, eq_open 24 8, wait_open 32 8, trywait 40 8, "
        "domain2 48 8"),
    "fid_fabric": (40, "fid 0 24, ops 24 8, api_version 32 4"),
    "fi_ops_domain": (96, "size 0 8, av_open 8 8, cq_open 16 8, endpoint 24 8, scalable_ep 32 8, cntr_open 40 8, "
        "poll_open 48 8, stx_ctx 56 8, srx_ctx 64 8, query_atomic 72 8, query_collective 80 8, endpoint2 88 8"),
    "fi_ops_mr": (32, "size 0 8, reg 8 8, regv 16 8, regattr 24 8"),
    "fid_domain": (40, "fid 0 24, ops 24 8, mr 32 8"),
    "fid_mr": (40, "fid 0 24, mem_desc 24 8, key 32 8"),
    "fi_mr_attr": (80, "mr_iov 0 8, iov_count 8 8, access 16 8, offset 24 8, requested_key 32 8, context 40 8, "
        "auth_key_size 48 8, auth_key 56 8, iface 64 4, device 72 8"),
    "fi_av_attr": (48, "type 0 4, rx_ctx_bits 4 4, count 8 8, ep_per_node 16 8, name 24 8, map_addr 32 8, flags 40 8"),
    "fi_ops_av": (64, "size 0 8, insert 8 8, insertsvc 16 8, insertsym 24 8, remove 32 8, lookup 40 8, "
        "straddr 48 8, av_set 56 8"),
    "fid_av": (32, "fid 0 24, ops 24 8"),
    "fi_cq_attr": (40, "size 0 8, flags 8 8, format 16 4, wait_obj 20 4, signaling_vector 24 4, wait_cond 28 4, "
        "wait_set 32 8"),
    "fi_cq_data_entry": (40, "op_context 0 8, flags 8 8, len 16 8, buf 24 8, data 32 8"),
    "fi_cq_err_entry": (80, "op_context 0 8, flags 8 8, len 16 8, buf 24 8, data 32 8, tag 40 8, olen 48 8, "
        "err 56 4, prov_errno 60 4, err_data 64 8, err_data_size 72 8"),
    "fi_ops_cq": (64, "size 0 8, read 8 8, readfrom 16 8, readerr 24 8, sread 32 8, sreadfrom 40 8, signal 48 8, "
        "strerror 56 8"),
    "fid_cq": (32, "fid 0 24, ops 24 8"),
    "fi_ops_ep": (64, "size 0 8, cancel 8 8, getopt 16 8, setopt 24 8, tx_ctx 32 8, rx_ctx 40 8, rx_size_left 48 8, "
        "tx_size_left 56 8"),
    "fi_ops_cm": (80, "size 0 8, setname 8 8, getname 16 8, getpeer 24 8, connect 32 8, listen 40 8, accept 48 8, "
        "reject 56 8, shutdown 64 8, join 72 8"),
    "fi_ops_rma": (80, "size 0 8, read 8 8, readv 16 8, readmsg 24 8, write 32 8, writev 40 8, writemsg 48 8, "
        "inject 56 8, writedata 64 8, injectdata 72 8"),
    "fid_ep": (80, "fid 0 24, ops 24 8, cm 32 8, msg 40 8, rma 48 8, tagged 56 8, atomic 64 8, collective 72 8"),
    "fi_rma_iov": (24, "addr 0 8, len 8 8, key 16 8"),
    "fi_msg_rma": (64, "msg_iov 0 8, desc 8 8, iov_count 16 8, addr 24 8, rma_iov 32 8, rma_iov_count 40 8, "
        "context 48 8, data 56 8"),
    "fi_device_attr": (48, "name 0 8, device_id 8 8, device_version 16 8, vendor_id 24 8, driver 32 8, firmware 40 8"),
    "fi_pci_attr": (6, "domain_id 0 2, bus_id 2 1, device_id 3 1, function_id 4 1"),
    "fi_bus_attr": (12, "bus_type 0 4, attr 4 6"),
    "fi_link_attr": (40, "address 0 8, mtu 8 8, speed 16 8, state 24 4, network_type 32 8"),
    "fid_nic": (56, "fid 0 24, device_attr 24 8, bus_attr 32 8, link_attr 40 8, prov_attr 48 8"),
}
LAYOUTS["1.19"] = {**LAYOUTS["1.18"], **{
    "fi_mr_attr": (88, "mr_iov 0 8, iov_count 8 8, access 16 8, offset 24 8, requested_key 32 8, context 40 8, "
        "auth_key_size 48 8, auth_key 56 8, iface 64 4, device 72 8, hmem_data 80 8"),
}}
LAYOUTS["1.20"] = {**LAYOUTS["1.19"], **{
    "fi_domain_attr": (200, "domain 0 8, name 8 8, threading 16 4, control_progress 20 4, data_progress 24 4, "
        "resource_mgmt 28 4, av_type 32 4, mr_mode 36 4, mr_key_size 40 8, cq_data_size 48 8, cq_cnt 56 8, "
        "ep_cnt 64 8, tx_ctx_cnt 72 8, rx_ctx_cnt 80 8, max_ep_tx_ctx 88 8, max_ep_rx_ctx 96 8, "
        "max_ep_stx_ctx 104 8, max_ep_srx_ctx 112 8, cntr_cnt 120 8, mr_iov_limit 128 8, caps 136 8, mode 144 8, "
        "auth_key 152 8, auth_key_size 160 8, max_err_data 168 8, mr_cnt 176 8, tclass 184 4, max_ep_auth_key 192 8"),
    "fi_mr_dmabuf": (32, "fd 0 4, offset 8 8, len 16 8, base_addr 24 8"),
    "fi_ops_av": (88, "size 0 8, insert 8 8, insertsvc 16 8, insertsym 24 8, remove 32 8, lookup 40 8, "
        "straddr 48 8, av_set 56 8, insert_auth_key 64 8, lookup_auth_key 72 8, set_user_id 80 8"),
    "fi_cq_err_entry": (88, "op_context 0 8, flags 8 8, len 16 8, buf 24 8, data 32 8, tag 40 8, olen 48 8, "
        "err 56 4, prov_errno 60 4, err_data 64 8, err_data_size 72 8, src_addr 80 8"),
}}
LAYOUTS["1.21"] = LAYOUTS["1.20"]
LAYOUTS["1.22"] = {**LAYOUTS["1.21"], **{
    "fi_mr_attr": (96, "mr_iov 0 8, iov_count 8 8, access 16 8, offset 24 8, requested_key 32 8, context 40 8, "
        "auth_key_size 48 8, auth_key 56 8, iface 64 4, device 72 8, hmem_data 80 8, page_size 88 8"),
}}

CONSTANTS = {}
CONSTANTS["1.18"] = {"FI_MSG": 1 << 1, "FI_RMA": 1 << 2, "FI_READ": 1 << 8, "FI_WRITE": 1 << 9,
    "FI_RECV": 1 << 10, "FI_SEND": 1 << 11, "FI_TRANSMIT": 1 << 11, "FI_REMOTE_READ": 1 << 12,
    "FI_REMOTE_WRITE": 1 << 13, "FI_REMOTE_CQ_DATA": 1 << 17, "FI_COMPLETION": 1 << 24, "FI_HMEM": 1 << 47,
    "FI_CONTEXT": 1 << 59, "FI_NUMERICHOST": 1 << 55, "FI_SOURCE": 1 << 57, "FI_LOCAL_COMM": 1 << 51,
    "FI_REMOTE_COMM": 1 << 52, "FI_MR_LOCAL": 1 << 2, "FI_MR_VIRT_ADDR": 1 << 4, "FI_MR_ALLOCATED": 1 << 5,
    "FI_MR_PROV_KEY": 1 << 6, "FI_MR_HMEM": 1 << 10, "FI_EP_RDM": 3, "FI_AV_TABLE": 2, "FI_CQ_FORMAT_DATA": 3,
    "FI_WAIT_NONE": 0, "FI_ENABLE": 6, "FI_THREAD_SAFE": 1, "FI_THREAD_DOMAIN": 3, "FI_OPT_ENDPOINT": 0,
    "FI_OPT_CUDA_API_PERMITTED": 10, "FI_HMEM_SYSTEM": 0, "FI_HMEM_CUDA": 1, "FI_ADDR_UNSPEC": (1 << 64) - 1,
    "FI_EAGAIN": 11, "FI_EINVAL": 22, "FI_ENOSYS": 38, "FI_ENODATA": 61, "FI_ENOPROTOOPT": 92,
    "FI_EOPNOTSUPP": 95, "FI_EOTHER": 256, "FI_EAVAIL": 259, "FI_ETRUNC": 265, "FI_EOVERRUN": 268,
    "FI_ENORX": 269, "FI_BUS_UNSPEC": 0, "FI_BUS_PCI": 1}
CONSTANTS["1.19"] = CONSTANTS["1.18"]
CONSTANTS["1.20"] = {**CONSTANTS["1.19"], "FI_MR_DMABUF": 1 << 40}
CONSTANTS["1.21"] = CONSTANTS["1.20"]
CONSTANTS["1.22"] = CONSTANTS["1.21"]

VERSIONS = tuple(LAYOUTS)


def _api(version: str) -> int:
    major, minor = map(int, version.split("."))
    return lf.FI_VERSION(major, minor)


def _fields(layout: str) -> dict[str, tuple[int, int]]:
    out = {}
    for item in layout.split(", "):
        name, off, size = item.split()
        out[name] = (int(off), int(size))
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_mirrors_match_the_header_layouts_of_each_version(version):
    mirrors = lf.mirrored_structs(_api(version))
    assert set(mirrors) == set(LAYOUTS[version]), "structs mirrored at this version differ from the headers'"
    wrong = []
    for name, (size, layout) in LAYOUTS[version].items():
        cls = mirrors[name]
        if ctypes.sizeof(cls) != size:
            wrong.append(f"sizeof(struct {name}): header {size}, mirror {ctypes.sizeof(cls)}")
        want = _fields(layout)
        have = {f: (getattr(cls, f).offset, getattr(cls, f).size) for f, *_ in cls._fields_}
        if have != want:
            wrong.append(f"struct {name}: header {want}, mirror {have}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("version", VERSIONS)
def test_constants_match_the_header_values_of_each_version(version):
    assert lf.mirrored_constants(_api(version)) == CONSTANTS[version]


def test_the_error_entry_grows_where_the_library_copies_more():
    # ofi_cq_err_memcpy copies sizeof(struct fi_cq_err_entry) at API >= 1.20, the 80-byte 1.1 layout below.
    sizes = {v: ctypes.sizeof(lf.mirrored_structs(_api(v))["fi_cq_err_entry"]) for v in ("1.17", "1.19", "1.20", "1.22")}
    assert sizes == {"1.17": 80, "1.19": 80, "1.20": 88, "1.22": 88}
    assert "fi_mr_dmabuf" not in lf.mirrored_structs(_api("1.19"))
    with pytest.raises(ValueError, match="1.23"):
        lf.mirrored_structs(lf.FI_VERSION(1, 23))


@pytest.mark.parametrize("library, requested", [((1, 17), (1, 17)), ((1, 18), (1, 18)), ((1, 21), (1, 21)),
                                                ((1, 22), (1, 22)), ((2, 0), (1, 22)), ((2, 3), (1, 22))])
def test_the_newest_api_both_offer_is_requested(library, requested):
    assert lf.negotiate_api(lf.FI_VERSION(*library)) == lf.FI_VERSION(*requested)


@pytest.mark.parametrize("library", [(1, 16), (1, 5), (3, 0)])
def test_a_library_outside_the_mirrored_range_is_refused_naming_its_version(library):
    with pytest.raises(OSError, match=rf"libfabric {library[0]}\.{library[1]}: .*>= 1\.17"):
        lf.negotiate_api(lf.FI_VERSION(*library))


# ---- the calls whose structs depend on the version, against fake ops tables ------------------------------
_READERR = CFUNCTYPE(c_ssize_t, c_void_p, c_void_p, c_uint64)


def _fake_cq(entry: bytes):
    """A fid_cq whose readerr copies `entry` (as a library at that API version would) and whose strerror
    says nothing. Returns (address, objects to keep alive)."""
    read = lf.CQ_READ_PROTO(lambda cq, buf, n: -lf.FI_EAGAIN)
    readerr = _READERR(lambda cq, buf, flags: (ctypes.memmove(buf, entry, len(entry)), 1)[1])
    strerror = lf._CQ_STRERROR(lambda cq, err, data, buf, n: None)
    ops = lf.fi_ops_cq(size=ctypes.sizeof(lf.fi_ops_cq), read=ctypes.cast(read, c_void_p).value,
                       readerr=ctypes.cast(readerr, c_void_p).value, strerror=ctypes.cast(strerror, c_void_p).value)
    cq = lf.fid_cq()
    cq.ops = ctypes.addressof(ops)
    return ctypes.addressof(cq), (read, readerr, strerror, ops, cq)


@pytest.mark.parametrize("version", ["1.18", "1.20", "1.22"])
def test_readerr_holds_what_the_library_copies_at_each_version(version):
    size, layout = LAYOUTS[version]["fi_cq_err_entry"]
    fields = _fields(layout)
    raw = bytearray(size)
    values = {"err": lf.FI_ETRUNC, "prov_errno": 7, "data": 0xABCD1234, "len": 4096, "src_addr": 0x5A5A}
    for name, value in values.items():
        if name in fields:
            off, n = fields[name]
            raw[off:off + n] = value.to_bytes(n, "little")
    ptr, keep = _fake_cq(bytes(raw))
    cq = lf.CQ(ptr, _api(version))
    assert ctypes.sizeof(cq.err_entry_type) == size  # room for all that the library copies, no more
    entry, msg = cq.readerr()
    assert (entry.err, entry.prov_errno, entry.data, entry.len) == (lf.FI_ETRUNC, 7, 0xABCD1234, 4096)
    assert "prov_errno 7" in msg
    if "src_addr" in fields:
        assert entry.src_addr == 0x5A5A
    del keep


_SETOPT = CFUNCTYPE(c_int, c_void_p, c_int, c_int, c_void_p, c_size_t)


def _fake_endpoint(setopt_rc):
    """A fid_ep whose setopt records (level, optname, the value's first byte, optlen) and returns
    `setopt_rc` (None: the provider's table has no setopt)."""
    calls = []

    def setopt(ep, level, optname, value, optlen):
        calls.append((level, optname, ctypes.string_at(value, 1)[0], optlen))
        return setopt_rc

    fns = [_SETOPT(setopt), lf._BIND(lambda *a: 0), lf._CONTROL(lambda *a: 0),
           lf._CM_GETNAME(lambda *a: 0), lf.WRITEMSG_PROTO(lambda *a: 0)]
    addr = [ctypes.cast(f, c_void_p).value for f in fns]
    ops_ep = lf.fi_ops_ep(size=ctypes.sizeof(lf.fi_ops_ep), setopt=addr[0] if setopt_rc is not None else None)
    fid_ops = lf.fi_ops(size=ctypes.sizeof(lf.fi_ops), bind=addr[1], control=addr[2])
    cm = lf.fi_ops_cm(size=ctypes.sizeof(lf.fi_ops_cm), getname=addr[3])
    rma = lf.fi_ops_rma(size=ctypes.sizeof(lf.fi_ops_rma), writemsg=addr[4])
    ep = lf.fid_ep(ops=ctypes.addressof(ops_ep), cm=ctypes.addressof(cm), rma=ctypes.addressof(rma))
    ep.fid.ops = ctypes.addressof(fid_ops)
    return lf.Endpoint(ctypes.addressof(ep)), calls, (fns, ops_ep, fid_ops, cm, rma, ep)


@pytest.mark.parametrize("rc, outcome", [
    (0, "false"),
    (-lf.FI_ENOPROTOOPT, "not an option of this provider (-FI_ENOPROTOOPT)"),
    (-lf.FI_EINVAL, "no CUDA library or device for the provider (-FI_EINVAL)"),
    (-lf.FI_EOPNOTSUPP, "needed by the provider for GPU memory (-FI_EOPNOTSUPP)"),
    (None, "not an option of this provider (-FI_ENOSYS)"),
])
def test_cuda_api_is_forbidden_where_the_provider_has_the_option(rc, outcome):
    ep, calls, keep = _fake_endpoint(rc)
    assert ep.forbid_cuda_api() == outcome
    # fi_setopt(ep, FI_OPT_ENDPOINT, FI_OPT_CUDA_API_PERMITTED, &(bool){false}, sizeof(bool))
    assert calls == ([] if rc is None else [(lf.FI_OPT_ENDPOINT, lf.FI_OPT_CUDA_API_PERMITTED, 0, 1)])
    del keep


def test_an_unexpected_setopt_refusal_is_raised():
    ep, calls, keep = _fake_endpoint(-lf.FI_EOPBADSTATE)
    with pytest.raises(lf.FabricError, match="FI_OPT_CUDA_API_PERMITTED.*FI_EOPBADSTATE"):
        ep.forbid_cuda_api()
    del keep
