"""The checks of the devices: the RDMA devices, the GPUs, the GPU -> NIC map."""
from __future__ import annotations

from .common import RDMA_PROVIDERS, Check, _devices, _domains, _rdma_provider


def check_rdma_devices(facts: dict) -> Check:
    devs = facts.get("rdma_devices") or []
    mods = set((facts.get("modules") or {}).get("loaded") or [])
    name = "rdma-devices"
    if not devs:
        return Check(name, "warn", "no EFA or verbs (RDMA) device (/sys/class/infiniband is empty or absent): "
                                   "moe_a2a runs on this host only (LocalCluster, tests, benchmarks over shm/tcp); "
                                   "inter-node runs need EFA or a ConnectX (verbs) NIC",
                     "nothing to do for local runs; for inter-node runs use an EFA-enabled instance (p5, p5e, p5en, "
                     "p6) with its EFA interfaces attached, or a host with ConnectX NICs and rdma-core")
    kinds = {k: _devices(facts, k) for k in RDMA_PROVIDERS}
    summary = "; ".join(f"{len(v)} {k} ({', '.join(d['name'] for d in v[:4])}{', ...' if len(v) > 4 else ''})"
                        for k, v in kinds.items() if v)
    closed = [d["name"] for d in devs if not d.get("uverbs_ok")]
    if closed:
        return Check(name, "fail", f"{summary}; no usable /dev/infiniband/uverbs* node (missing or not read/"
                                   f"writable by this user) for {', '.join(closed[:8])}",
                     "load ib_uverbs; in a container pass the devices (docker --device /dev/infiniband/uverbsN, "
                     "Kubernetes: the EFA or RDMA device plugin) and check their permissions")
    down = [d["name"] for d in devs if d.get("state") and "ACTIVE" not in d["state"]]
    missing = [m for m in ("ib_core", "ib_uverbs") if m not in mods]
    if kinds["efa"] and "efa" not in mods:
        missing.append("efa")
    if down or missing:
        parts = ([f"port 1 not ACTIVE on {', '.join(down[:8])}"] if down else []) + \
                ([f"modules not loaded: {', '.join(missing)}"] if missing else [])
        return Check(name, "warn", f"{summary}; " + "; ".join(parts),
                     "check the links (ibstat / ibv_devinfo); modprobe the missing modules")
    return Check(name, "ok", summary)




def check_gpus(facts: dict) -> Check:
    gpus, name = facts.get("gpus") or [], "gpus"
    if not gpus:
        why = facts.get("gpu_error") or "NVML lists none"
        verdict = "warn" if _rdma_provider(facts) else "ok"
        return Check(name, verdict, f"no GPU ({why}): CPU runs only (Triton interpreter)" +
                     ("; NICs are shared round robin by local rank" if verdict == "warn" else ""),
                     "install the NVIDIA driver (and nvidia-ml-py) if this host has GPUs" if verdict == "warn" else "")
    visible = (facts.get("env") or {}).get("CUDA_VISIBLE_DEVICES")
    return Check(name, "ok", f"{len(gpus)} GPU(s) (NVIDIA driver {facts.get('nvidia_driver') or 'unknown'}), PCI "
                             f"{', '.join(g.get('pci') or '?' for g in gpus[:8])}"
                             + (f"; CUDA_VISIBLE_DEVICES={visible}" if visible is not None else ""))




def check_nic_map(facts: dict) -> Check:
    """The GPU -> NIC plan of nics='auto' (proxy/topology.py plan_nics) over the facts' PCIe tree."""
    from ..proxy import topology

    name, prov = "nic-map", _rdma_provider(facts)
    if prov is None:
        return Check(name, "ok", "not applicable: tcp and shm open the provider's first domain")
    nics = [topology.Device(n["name"], n.get("pci"), None if n.get("bridges") is None else tuple(n["bridges"]),
                            n.get("numa"), n.get("uuid")) for n in (facts.get("nics") or {}).get(prov, [])]
    if not nics:
        nics = [topology.Device(d["name"], d.get("pci")) for d in _domains(facts, prov)]
    gpus = [topology.Device(g["name"], g.get("pci"), None if g.get("bridges") is None else tuple(g["bridges"]),
                            g.get("numa"), g.get("uuid")) for g in facts.get("gpus") or []]
    if not gpus:
        return Check(name, "warn", f"no GPU known: each rank takes its share of the {len(nics)} {prov} NIC(s) round "
                                   f"robin by local rank (listing order)",
                     "make NVML work (NVIDIA driver, pip install nvidia-ml-py) so NICs follow the PCIe tree")
    plan = topology.plan_nics(gpus, nics)
    lines = [f"GPU {g.name} ({g.pci}) -> {', '.join(names)} [{rule}]" for g, (names, rule, _) in zip(gpus, plan)]
    unplaced = [n.name for n in nics if n.pci is None]
    off_switch = [(g, reason) for g, (_, rule, reason) in zip(gpus, plan) if rule != "switch"]
    detail = f"{len(gpus)} GPU(s), {len(nics)} {prov} NIC(s):\n" + "\n".join(lines)
    if off_switch or unplaced:
        why = "; ".join(reason for _, reason in off_switch[:2]) or f"no PCI address for {', '.join(unplaced[:4])}"
        return Check(name, "warn", f"{detail}\nnot by PCIe switch: {why}",
                     "check that sysfs shows the PCIe tree (/sys/bus/pci/devices/<address> resolves through its "
                     "bridges) and that fi_info->nic or /sys/class/infiniband/<dev>/device gives each NIC's address")
    return Check(name, "ok", detail)



def check_rdma_cm(facts: dict) -> Check:
    """verbs: verbs;ofi_rxm connects peers through rdma_cm, by an IP address on each HCA's interface (IPoIB or
    RoCE): /dev/infiniband/rdma_cm must be there and open to this user, and every HCA must have an address."""
    name = "rdma-cm"
    devs = _devices(facts, "verbs")
    if not devs and not _domains(facts, "verbs"):
        return Check(name, "ok", "not applicable: no verbs device (efa connects without rdma_cm)")
    cm = facts.get("rdma_cm") or {}
    without_ip = [d["name"] for d in devs if not d.get("ips")]
    fix_ip = ("give each HCA's interface an address (IPoIB: ip addr add ... dev ibN; RoCE: the Ethernet port's "
              "address), as verbs;ofi_rxm resolves peers by IP")
    if not cm.get("ok"):
        what = "missing" if not cm.get("present") else "not read/writable by this user"
        return Check(name, "fail", f"{cm.get('path', '/dev/infiniband/rdma_cm')} {what}: verbs;ofi_rxm cannot "
                                   f"connect to any peer", "modprobe rdma_ucm; in a container pass "
                                   "/dev/infiniband/rdma_cm with --device (and the uverbs nodes)")
    if devs and len(without_ip) == len(devs):
        return Check(name, "fail", f"rdma_cm present, but no HCA has an IP address ({', '.join(without_ip[:8])}): "
                                   f"verbs;ofi_rxm reaches none", fix_ip)
    if without_ip:
        return Check(name, "warn", f"rdma_cm present; no IP address on {', '.join(without_ip[:8])}: those HCAs "
                                   f"cannot be reached (each rank uses only the NICs with one)", fix_ip)
    shown = ", ".join(f"{d['name']}: {d['ips'][0]}" for d in devs[:4]) + (", ..." if len(devs) > 4 else "")
    return Check(name, "ok", f"rdma_cm present; every HCA has an IP address ({shown})")


def check_proxy_gpu(facts: dict) -> Check:
    """The proxy's GPU: it inherits CUDA_VISIBLE_DEVICES from the model process and opens its rank's GPU by
    the same ordinal, making that GPU's primary context current before libfabric initialises CUDA (libfabric's
    CUDA set-up otherwise opens a context on the process's device 0: with 8 proxies, 8 contexts on one GPU)."""
    name = "proxy-gpu"
    gpus, prov = facts.get("gpus") or [], _rdma_provider(facts)
    if not gpus or prov is None:
        return Check(name, "ok", "not applicable: " + ("no GPU" if not gpus else "no RDMA provider (no GPU buffers "
                                                                                  "for the NIC)"))
    visible = (facts.get("env") or {}).get("CUDA_VISIBLE_DEVICES")
    made = ("each proxy makes its rank's GPU context current before libfabric initialises CUDA, so no proxy "
            "holds a context on GPU 0 that is not its own")
    if visible is None:
        return Check(name, "ok", f"CUDA_VISIBLE_DEVICES unset: the proxies see all {len(gpus)} GPUs; {made}")
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    uuids = [g.get("uuid") or "" for g in gpus]
    unknown = [e for e in entries if not ((e.isdigit() and int(e) < len(gpus)) or
                                          (e.startswith("GPU-") and any(u.startswith(e) for u in uuids)))]
    fix = ("set CUDA_VISIBLE_DEVICES to indices (< the GPU count) or GPU-UUIDs NVML lists, or leave it unset; the "
           "proxy inherits it from the model process")
    if not entries:
        return Check(name, "warn", f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU: neither the model nor its "
                                   f"proxy can open one (GPU buffers fail; buffers='auto' stages)", fix)
    if unknown or len(set(entries)) != len(entries):
        bad = unknown or sorted({e for e in entries if entries.count(e) > 1})
        return Check(name, "warn", f"CUDA_VISIBLE_DEVICES={visible}: {', '.join(bad)} not a GPU of this host (or "
                                   f"repeated): CUDA stops at the first such entry, so the proxy may see fewer "
                                   f"GPUs than intended", fix)
    return Check(name, "ok", f"CUDA_VISIBLE_DEVICES={visible}: the proxies see {len(entries)} GPU(s); {made}")
