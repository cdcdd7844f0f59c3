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

