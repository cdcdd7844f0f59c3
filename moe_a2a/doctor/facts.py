"""The facts of this host (`collect_facts`): a JSON-able dict gathered without starting any process."""
from __future__ import annotations

import ctypes
import os
import re
import resource

from .common import (CAP_BITS, CUDART_NAME, DECODE, DEFAULT_NODE, DEFAULT_TOKENS, DEFAULT_WORLD, EFA_INSTALLER_MANIFEST,
                     EFA_INSTALLER_PREFIX, KSYM_DMABUF, KSYM_PEER_MEMORY, MODULES, MR_MODE_BITS, PROVIDERS,
                     RDMA_PROVIDERS, SCHEMA, bit_names)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


_PCI = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def library_facts(environ) -> dict:
    """Which libfabric loads (path, source, version, API requested) and which would be tried."""
    from ..proxy import libfabric as lf

    out: dict = {"candidates": [list(c) for c in lf.library_candidates(environ)]}
    try:
        info = lf.library_info()
    except OSError as e:
        out["error"] = str(e)
        return out
    out.update({k: info[k] for k in ("path", "source", "version", "api_version")})
    return out


def efa_installer_facts(prefix: str = EFA_INSTALLER_PREFIX, manifest: str = EFA_INSTALLER_MANIFEST) -> dict:
    """Whether the EFA installer is there, its version (from its package list) and its libfabric."""
    from ..proxy import libfabric as lf

    out: dict = {"prefix": prefix, "present": os.path.isdir(prefix), "version": None, "libfabric": None}
    text = _read(manifest) or ""
    m = re.search(r"EFA installer version:\s*(\S+)", text)
    out["version"] = m.group(1) if m else None
    for sub in ("lib", "lib64"):
        lib = lf._efa_installer_library(os.path.join(prefix, sub))
        if lib:
            out["libfabric"] = lib
            break
    return out


def _domain_rows(provider: str, hmem: bool) -> list[dict]:
    """One row per distinct domain of what `fi_getinfo` answers to the engine's own hints."""
    from ..proxy import libfabric as lf

    head, nodes = lf._usable(provider, hmem=hmem, tx_size=None)
    rows: dict[str, dict] = {}
    try:
        for info in nodes:
            name = info.domain_attr.contents.name.decode()
            if name in rows:
                continue
            fab = info.fabric_attr.contents
            rows[name] = {
                "name": name, "fabric": ctypes.string_at(fab.name).decode() if fab.name else None,
                "pci": lf.nic_pci_address(info.nic), "api": lf.version_str(fab.api_version),
                "caps": bit_names(info.caps, CAP_BITS),
                "mr_mode": bit_names(info.domain_attr.contents.mr_mode, MR_MODE_BITS),
                "threading": lf.THREADING_NAMES.get(info.domain_attr.contents.threading),
                "max_msg_size": int(info.ep_attr.contents.max_msg_size),
            }
    finally:
        lf.library().fi_freeinfo(head)
    return list(rows.values())


def provider_facts(provider: str) -> dict:
    """`fi_getinfo` for `provider` ("tcp", "shm", "efa", "verbs"), without and with `FI_HMEM`: its
    domains (each with "hmem": offered with FI_HMEM), or the error that says why there are none."""
    from ..proxy import libfabric as lf

    out: dict = {"provider": lf.PROVIDER_NAMES[provider], "domains": [], "error": None, "hmem_error": None}
    try:
        out["domains"] = _domain_rows(provider, hmem=False)
    except (lf.FabricError, OSError) as e:
        out["error"] = str(e)
        return out
    try:
        with_hmem = {d["name"]: d for d in _domain_rows(provider, hmem=True)}
    except (lf.FabricError, OSError) as e:
        out["hmem_error"], with_hmem = str(e), {}
    for d in out["domains"]:
        d["hmem"] = d["name"] in with_hmem
        if d["hmem"]:
            d["caps"], d["mr_mode"] = with_hmem[d["name"]]["caps"], with_hmem[d["name"]]["mr_mode"]
    return out


def rdma_device_facts(sysfs: str = "/sys", dev: str = "/dev", proc: str = "/proc") -> list[dict]:
    """The devices of /sys/class/infiniband: driver (efa, mlx5_core...), PCI address, port state, link
    layer, their uverbs nodes and whether this process may open them (read and write), their network
    interfaces and those interfaces' IP addresses."""
    base = os.path.join(sysfs, "class", "infiniband")
    uverbs: dict[str, list[str]] = {}
    vbase = os.path.join(sysfs, "class", "infiniband_verbs")
    for u in sorted(os.listdir(vbase)) if os.path.isdir(vbase) else []:
        ib = _read(os.path.join(vbase, u, "ibdev"))
        if ib:
            uverbs.setdefault(ib, []).append(u)
    out = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        devdir = os.path.join(base, name, "device")
        driver = os.path.join(devdir, "driver")
        last = os.path.basename(os.path.realpath(devdir))
        nodes = uverbs.get(name, [])
        netdir = os.path.join(devdir, "net")
        netdevs = sorted(os.listdir(netdir)) if os.path.isdir(netdir) else []
        out.append({
            "name": name,
            "driver": os.path.basename(os.path.realpath(driver)) if os.path.exists(driver) else None,
            "pci": last if _PCI.fullmatch(last) else None,
            "state": _read(os.path.join(base, name, "ports", "1", "state")),
            "link_layer": _read(os.path.join(base, name, "ports", "1", "link_layer")),
            "uverbs": nodes,
            "uverbs_ok": bool(nodes) and all(os.access(os.path.join(dev, "infiniband", u), os.R_OK | os.W_OK)
                                             for u in nodes),
            "netdevs": netdevs,
            "ips": [a for n in netdevs for a in interface_addresses(n, proc)],
        })
    return out


def interface_addresses(ifname: str, proc: str = "/proc") -> list[str]:
    """The IP addresses of network interface ``ifname``: IPv4 by ``SIOCGIFADDR`` (this host only), IPv6 from
    ``<proc>/net/if_inet6``. verbs;ofi_rxm reaches a peer's HCA through rdma_cm, by an IP address on it."""
    import fcntl
    import socket
    import struct

    out = []
    if proc == "/proc":
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))  # SIOCGIFADDR
            out.append(socket.inet_ntoa(raw[20:24]))
        except OSError:  # no IPv4 address (or no such interface)
            pass
    for line in (_read(os.path.join(proc, "net", "if_inet6")) or "").splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[5] == ifname:
            out.append(":".join(parts[0][i:i + 4] for i in range(0, 32, 4)))
    return out


def rdma_cm_facts(dev: str = "/dev") -> dict:
    """``/dev/infiniband/rdma_cm``: present, and read-writable by this user (verbs;ofi_rxm connects through it)."""
    path = os.path.join(dev, "infiniband", "rdma_cm")
    return {"path": path, "present": os.path.exists(path), "ok": os.access(path, os.R_OK | os.W_OK)}


def cudart_facts(name: str = CUDART_NAME) -> dict:
    """Whether the CUDA runtime loads by the unversioned name libfabric uses (the proxy inherits this
    process's library path): ``loadable``, the file mapped, or the loader's error."""
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        return {"name": name, "loadable": False, "path": None, "error": str(e)}
    try:
        path = _loaded_path_of(lib, "cudaGetDeviceCount") or name
    except Exception:  # noqa: BLE001 - the name loaded, where from is a detail
        path = name
    return {"name": name, "loadable": True, "path": path, "error": None}


def _loaded_path_of(lib, symbol: str) -> str | None:
    from ..proxy.libfabric import _Dl_info

    dladdr = ctypes.CDLL(None).dladdr
    dladdr.restype, dladdr.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(_Dl_info)]
    info = _Dl_info()
    if dladdr(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p), ctypes.byref(info)) and info.dli_fname:
        return os.path.realpath(info.dli_fname.decode())
    return None


def module_facts(proc: str = "/proc", sysfs: str = "/sys") -> dict:
    """The modules of MODULES that are loaded (/proc/modules, or built in: /sys/module/<name>), with the
    version the module reports where it does."""
    listed = {line.split()[0] for line in (_read(os.path.join(proc, "modules")) or "").splitlines() if line}
    loaded = [m for m in MODULES if m in listed or os.path.isdir(os.path.join(sysfs, "module", m))]
    versions = {m: v for m in loaded if (v := _read(os.path.join(sysfs, "module", m, "version")))}
    return {"loaded": loaded, "versions": versions}


def kallsyms_facts(proc: str = "/proc") -> dict | None:
    """Whether the kernel has the peer-memory and DMA-BUF registration symbols (names only; None when
    /proc/kallsyms cannot be read)."""
    found = {KSYM_PEER_MEMORY: False, KSYM_DMABUF: False}
    try:
        with open(os.path.join(proc, "kallsyms")) as f:
            for line in f:
                for sym in found:
                    if sym in line:
                        found[sym] = True
                if all(found.values()):
                    break
    except OSError:
        return None
    return found


def _device_dict(d) -> dict:
    return {"name": d.name, "pci": d.pci, "bridges": None if d.bridges is None else list(d.bridges),
            "numa": d.numa, "uuid": d.uuid}


def gpu_facts(sysfs: str = "/sys") -> dict:
    """Every GPU NVML lists (PCI address, bridges, NUMA node, UUID) and the driver version; "error" says
    why there are none (no NVML library, no driver)."""
    from ..proxy import topology

    out: dict = {"gpus": [], "driver": None, "error": None}
    try:
        nvml = topology._load_nvml()
        out["gpus"] = [_device_dict(d) for d in topology.describe_gpus(nvml, sysfs)]
        nvml.nvmlInit()
        try:
            v = nvml.nvmlSystemGetDriverVersion()
            out["driver"] = v.decode() if isinstance(v, bytes) else str(v)
        finally:
            nvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - ImportError, NVMLError_*: no GPU known, said as such
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def registration_sizes(world: int = DEFAULT_WORLD, node: int = DEFAULT_NODE, tokens: int = DEFAULT_TOKENS) -> dict:
    """The buffers one rank registers with its NIC(s) for DeepSeek-V3 decode sizes (fp8 payload with
    scales, bf16 combine) at `world` ranks, `node` per node, `tokens` per rank (config.Layout owns the
    sizes): the host-staged segment (one registration, written by peers), or with GPU buffers the recv
    buffer (written by peers) and the send buffer (a source only)."""
    out: dict = {"world": world, "node": node, "tokens": tokens,
                 "config": f"DeepSeek-V3 decode: T={tokens}, E={DECODE['num_experts']}, K={DECODE['experts_per_token']}, "
                           f"H={DECODE['hidden_dim']} fp8 + scales, bf16 out; {world} ranks, {node} per node"}
    try:
        import torch

        from ..config import A2AConfig

        cfg = A2AConfig(max_num_tokens=tokens, **DECODE, in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16)
        lay = cfg.layout(world, node)
    except (ImportError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    from ..proxy.worker import largest_write_bytes

    out.update(host_segment_bytes=lay.segment_bytes(True), gpu_recv_bytes=lay.recv_bytes,
               gpu_send_bytes=lay.send_bytes, largest_write_bytes=largest_write_bytes(lay))
    return out


def collect_facts(*, world: int = DEFAULT_WORLD, node: int = DEFAULT_NODE, tokens: int = DEFAULT_TOKENS,
                  environ=None, sysfs: str = "/sys", proc: str = "/proc", dev: str = "/dev",
                  efa_prefix: str = EFA_INSTALLER_PREFIX) -> dict:
    """Everything the checks read, from this host (see the module docstring). Starts no process."""
    from ..proxy import topology

    env = dict(os.environ if environ is None else environ)
    facts: dict = {"schema": SCHEMA, "source": "this host"}
    facts["libfabric"] = library_facts(env)
    facts["efa_installer"] = efa_installer_facts(efa_prefix)
    if "error" in facts["libfabric"]:
        facts["providers"], facts["fi_getinfo"] = [], {p: {"provider": p, "domains": [], "error": "no libfabric",
                                                           "hmem_error": None} for p in PROVIDERS}
    else:
        from ..proxy import libfabric as lf

        facts["providers"] = lf.list_providers()
        facts["fi_getinfo"] = {p: provider_facts(p) for p in PROVIDERS}
    facts["rdma_devices"] = rdma_device_facts(sysfs, dev, proc)
    facts["rdma_cm"] = rdma_cm_facts(dev)
    facts["cudart"] = cudart_facts()
    facts["modules"] = module_facts(proc, sysfs)
    # The symbols only matter for GPU memory over an RDMA device; the file is long (about 0.3 s to scan).
    facts["kallsyms"] = kallsyms_facts(proc) if facts["rdma_devices"] else None
    facts["gdrdrv"] = os.path.exists(os.path.join(dev, "gdrdrv"))
    g = gpu_facts(sysfs)
    facts["gpus"], facts["nvidia_driver"], facts["gpu_error"] = g["gpus"], g["driver"], g["error"]
    facts["nics"] = {}
    for p in RDMA_PROVIDERS:
        domains = facts["fi_getinfo"][p]["domains"]
        if domains:
            facts["nics"][p] = [_device_dict(d) for d in
                                topology.describe_nics([(d["name"], d["pci"]) for d in domains], sysfs)]
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    facts["memlock"] = {"soft": -1 if soft == resource.RLIM_INFINITY else soft,
                        "hard": -1 if hard == resource.RLIM_INFINITY else hard}
    facts["page_size"] = os.sysconf("SC_PAGE_SIZE")
    facts["env"] = {k: v for k, v in sorted(env.items())
                    if k.startswith(("FI_", "MOE_A2A_")) or k == "CUDA_VISIBLE_DEVICES"}
    facts["sizes"] = registration_sizes(world, node, tokens)
    return facts
