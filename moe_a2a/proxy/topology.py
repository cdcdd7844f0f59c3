"""Which NICs a rank's proxy drives, and which CPU it runs on.

NICs (`choose_nics`, docs/transport.md, "Which NIC each rank uses"): EFA hosts give each GPU one or
several NICs (p5: 32 for 8 GPUs), ConnectX nodes one per GPU, each a libfabric domain; the proxy opens
its rank's share and the engine shards peers over them. The share follows the PCIe tree: each NIC's
PCI address comes from `fi_info->nic` (libfabric.list_domain_nics), each GPU's from NVML, and sysfs
tells which bridges lie above each device. `plan_nics` is the rule itself, a pure function of that
description (tested on synthetic p5, p5en, p6-b200 and ConnectX nodes):

1. "switch": a GPU gets the NICs that share its PCIe switch (the tree below one root port), split
   equally among the GPUs there, each GPU taking the NICs deepest in the tree with it first;
2. "numa": no NIC under its switch: the NICs of its NUMA node that no switch gave away, split among
   the GPUs of that node left without one;
3. "round-robin": nothing known (no sysfs, no NUMA node, no GPU): equal contiguous shares in listing
   order (`nics_for_rank`), by GPU position, or by local rank when the GPU is unknown.

Which CPU a rank's proxy runs on (`choose_proxy_cpus`, docs/transport.md, "Proxy placement"): the one
named by `MOE_A2A_PROXY_CPUS`, else one core near its GPU (NVML), else none (CPU runs: not pinned).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Sequence

from . import libfabric as lf

# Read in the model process at construction (runtime/wiring.py) and passed to the proxy in its spec.
PROXY_CPUS_ENV = "MOE_A2A_PROXY_CPUS"


def nics_for_rank(domains: list[str], local_rank: int, ranks_per_node: int) -> list[str]:
    """The domains local rank `local_rank` of `ranks_per_node` opens: an equal contiguous share of
    `domains` (the first `len // ranks_per_node * ranks_per_node` of them), or with fewer domains than
    ranks, domain `local_rank % len(domains)` shared with other ranks."""
    if not domains:
        raise ValueError("no NIC (libfabric domain) to choose from")
    if not 0 <= local_rank < ranks_per_node:
        raise ValueError(f"local_rank {local_rank} outside [0, {ranks_per_node})")
    share = len(domains) // ranks_per_node
    if share == 0:
        return [domains[local_rank % len(domains)]]
    return list(domains[local_rank * share:(local_rank + 1) * share])


# ---- NICs by PCIe topology -------------------------------------------------------------------------
_PCI_ADDRESS = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_HOST_BRIDGE = re.compile(r"pci[0-9a-f]{4,}:[0-9a-f]{2}")


@dataclass(frozen=True)
class Device:
    """A GPU or a NIC as `plan_nics` sees it. name: the libfabric domain of a NIC, the NVML index of a
    GPU; pci: its address ("0000:8b:00.0"); bridges: the PCI addresses of the bridges above it, root
    port first (sysfs), () when it hangs off the host bridge, None when unknown; numa: its NUMA node,
    None when unknown; uuid: a GPU's NVML UUID ("GPU-...")."""
    name: str
    pci: str | None = None
    bridges: tuple[str, ...] | None = None
    numa: int | None = None
    uuid: str | None = None


class NicChoice(tuple):
    """The domains a rank opens (a tuple of names), with `rule` ("switch", "numa", "round-robin") and
    `reason` (one line) attached. Pickles as a plain tuple (the proxy needs only the names)."""
    rule: str
    reason: str

    def __new__(cls, names, rule: str, reason: str) -> "NicChoice":
        self = super().__new__(cls, names)
        self.rule, self.reason = rule, reason
        return self

    def __reduce__(self):
        return tuple, (tuple(self),)


def normalize_pci(address) -> str:
    """NVML's "00000000:4F:00.0" (str or bytes), sysfs' "0000:4f:00.0" -> "0000:4f:00.0"."""
    text = address.decode() if isinstance(address, bytes) else str(address)
    domain, bus, rest = text.strip().lower().split(":")
    device, function = rest.split(".")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"


def parse_sysfs_path(resolved: str) -> tuple[str | None, tuple[str, ...] | None]:
    """(device address, bridges above it, root port first) from the resolved path of
    /sys/bus/pci/devices/<address>, e.g. /sys/devices/pci0000:76/0000:76:00.0/0000:77:00.0/0000:78:02.2/
    0000:8b:00.0 -> ("0000:8b:00.0", ("0000:76:00.0", "0000:77:00.0", "0000:78:02.2")). (None, None)
    when the path holds no host bridge followed by the device (the link did not resolve)."""
    parts = [p for p in resolved.lower().split("/") if p]
    hosts = [i for i, p in enumerate(parts) if _HOST_BRIDGE.fullmatch(p)]
    if not hosts or not _PCI_ADDRESS.fullmatch(parts[-1]):
        return None, None
    above = [p for p in parts[hosts[0] + 1:-1] if _PCI_ADDRESS.fullmatch(p)]
    return parts[-1], tuple(above)


def _sort_key(d: Device):
    return (d.pci is None, d.pci or "", d.name)


def _deal(gpus: list[int], nics: list[int], devs_g: Sequence[Device], devs_n: Sequence[Device],
          quota: int) -> dict[int, list[int]]:
    """Give each GPU of one switch `quota` NICs of that switch, deepest shared bridge first: at each
    depth, from the deepest up, the GPUs under a bridge take (in PCI order) the free NICs under the
    same bridge. At depth 1 (the root port) all share it, so every GPU ends with `quota`."""
    taken: dict[int, list[int]] = {g: [] for g in gpus}
    free = sorted(nics, key=lambda n: _sort_key(devs_n[n]))
    depth = max(len(devs_g[g].bridges) for g in gpus)
    for d in range(depth, 0, -1):
        for g in sorted(gpus, key=lambda g: _sort_key(devs_g[g])):
            prefix = devs_g[g].bridges[:d]
            if len(prefix) < d:
                continue
            for n in [n for n in free if devs_n[n].bridges[:d] == prefix][:quota - len(taken[g])]:
                taken[g].append(n)
                free.remove(n)
    return taken


def plan_nics(gpus: Sequence[Device], nics: Sequence[Device]) -> list[tuple[tuple[str, ...], str, str]]:
    """For every GPU of the node (all of them, as NVML lists them: the split must not depend on what
    one process sees), (its NICs' names, the rule, why): see the module docstring for the rules.
    With fewer NICs than GPUs in a group, GPUs share NICs; with a remainder, the extra NICs stay idle
    (as in `nics_for_rank`)."""
    if not nics:
        raise ValueError("no NIC (libfabric domain) to choose from")
    plan: dict[int, tuple[tuple[str, ...], str, str]] = {}
    names = [n.name for n in nics]

    def label(g: int) -> str:
        return f"GPU {gpus[g].name}" + (f" ({gpus[g].pci})" if gpus[g].pci else "")

    # 1. switch: the devices below one root port
    switches: dict[str, tuple[list[int], list[int]]] = {}
    for i, d in enumerate(gpus):
        if d.bridges:
            switches.setdefault(d.bridges[0], ([], []))[0].append(i)
    for j, d in enumerate(nics):
        if d.bridges and d.bridges[0] in switches:
            switches[d.bridges[0]][1].append(j)
    claimed: set[int] = set()
    for port, (gs, ns) in switches.items():
        if not ns:
            continue
        claimed.update(ns)
        quota = len(ns) // len(gs)
        if quota:
            taken = _deal(gs, ns, gpus, nics, quota)
        else:  # fewer NICs than GPUs: neighbours in PCI order share one
            order = sorted(gs, key=lambda g: _sort_key(gpus[g]))
            ns_sorted = sorted(ns, key=lambda n: _sort_key(nics[n]))
            taken = {g: [ns_sorted[k * len(ns) // len(gs)]] for k, g in enumerate(order)}
        for g in gs:
            plan[g] = (tuple(names[n] for n in taken[g]), "switch",
                       f"{label(g)} shares the PCIe switch below root port {port} with {len(gs) - 1} other "
                       f"GPU(s) and {len(ns)} NIC(s): {max(quota, 1)} each" + ("" if quota else ", shared"))

    # 2. numa: NICs no switch gave away, on the GPU's NUMA node
    left = [g for g in range(len(gpus)) if g not in plan]
    for node in sorted({gpus[g].numa for g in left if gpus[g].numa is not None}):
        pool = [j for j, d in enumerate(nics) if j not in claimed and d.numa == node]
        if not pool:
            continue
        sharers = sorted((g for g in left if gpus[g].numa == node), key=lambda g: _sort_key(gpus[g]))
        pool_names = [names[j] for j in sorted(pool, key=lambda j: _sort_key(nics[j]))]
        for k, g in enumerate(sharers):
            plan[g] = (tuple(nics_for_rank(pool_names, k, len(sharers))), "numa",
                       f"no NIC under {label(g)}'s PCIe switch; {len(pool)} NIC(s) on its NUMA node {node} "
                       f"shared by {len(sharers)} GPU(s)")
        claimed.update(pool)

    # 3. round robin: what is left, in listing order, by GPU position
    left = [g for g in range(len(gpus)) if g not in plan]
    pool_names = [names[j] for j in range(len(nics)) if j not in claimed] or names
    for k, g in enumerate(left):
        plan[g] = (tuple(nics_for_rank(pool_names, k, len(left))), "round-robin",
                   f"no NIC under {label(g)}'s PCIe switch nor on its NUMA node (topology unknown): GPU "
                   f"{k} of {len(left)} so placed takes its share of {len(pool_names)} NIC(s) in listing order")
    return [plan[g] for g in range(len(gpus))]


def assign_nics(gpus: Sequence[Device], nics: Sequence[Device], gpu: int | None, local_rank: int,
                ranks_per_node: int, no_gpu: str = "GPU unknown") -> NicChoice:
    """The NICs of the rank whose GPU is `gpus[gpu]` (`plan_nics`); `gpu` None (a CPU run, NVML
    missing, a GPU NVML does not list): today's round robin by local rank, `no_gpu` saying why."""
    if gpu is None:
        names = [n.name for n in nics]
        share = nics_for_rank(names, local_rank, ranks_per_node)
        return NicChoice(share, "round-robin", f"{no_gpu}: local rank {local_rank} of {ranks_per_node} takes "
                                               f"its share of {len(names)} NIC(s) in listing order")
    names, rule, reason = plan_nics(gpus, nics)[gpu]
    return NicChoice(names, rule, reason)


def visible_gpu(ordinal: int, cuda_visible_devices: str | None, gpus: Sequence[Device]) -> int | None:
    """Index in `gpus` (NVML's list, all GPUs of the host) of CUDA device `ordinal` under
    CUDA_VISIBLE_DEVICES: unset, the ordinal itself; else its `ordinal`-th entry, an NVML index or a
    GPU UUID (a unique prefix, "GPU-..."). Like CUDA, the list ends at the first entry that names no
    GPU (or one already named); MIG entries are not resolved. None when the ordinal is not visible."""
    if cuda_visible_devices is None:
        order = list(range(len(gpus)))
    else:
        order = []
        for entry in cuda_visible_devices.split(","):
            e = entry.strip().lower()
            if e.isdigit():
                i = int(e)
                found = [i] if i < len(gpus) else []
            elif e.startswith("gpu-"):
                found = [i for i, g in enumerate(gpus) if g.uuid and g.uuid.lower().startswith(e)]
            else:
                found = []
            if len(found) != 1 or found[0] in order:
                break
            order.append(found[0])
    return order[ordinal] if 0 <= ordinal < len(order) else None


def read_pci_device(address: str, name: str, sysfs: str = "/sys", uuid: str | None = None) -> Device:
    """A `Device` for the PCI device at `address`, its bridges and NUMA node read from sysfs
    (unknown where sysfs lacks them)."""
    pci = normalize_pci(address)
    resolved = os.path.realpath(os.path.join(sysfs, "bus", "pci", "devices", pci))
    bridges = parse_sysfs_path(resolved)[1] if os.path.exists(resolved) else None
    numa = None
    try:
        with open(os.path.join(resolved, "numa_node")) as f:
            numa = int(f.read().strip())
    except (OSError, ValueError):
        pass
    return Device(name, pci, bridges, numa if numa is not None and numa >= 0 else None, uuid)


def _rdma_device_pci(domain: str, sysfs: str) -> str | None:
    """The PCI address of an RDMA device from sysfs, for a domain whose fi_info gave none: EFA names
    its domains "<device>-rdm" / "<device>-dgrm", verbs after the device itself."""
    for dev in (domain, re.sub(r"-(rdm|dgrm)$", "", domain)):
        link = os.path.join(sysfs, "class", "infiniband", dev, "device")
        if os.path.exists(link):
            last = os.path.basename(os.path.realpath(link))
            return last if _PCI_ADDRESS.fullmatch(last) else None
    return None


def describe_nics(domains: Sequence[tuple[str, str | None]], sysfs: str = "/sys") -> list[Device]:
    """`Device`s for (domain, PCI address or None) pairs (libfabric.list_domain_nics)."""
    out = []
    for name, pci in domains:
        pci = pci or _rdma_device_pci(name, sysfs)
        out.append(read_pci_device(pci, name, sysfs) if pci else Device(name))
    return out


def describe_gpus(nvml, sysfs: str = "/sys") -> list[Device]:
    """Every GPU NVML lists, in its index order (NVML ignores CUDA_VISIBLE_DEVICES)."""
    nvml.nvmlInit()
    try:
        out = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            out.append(read_pci_device(nvml.nvmlDeviceGetPciInfo(h).busId, str(i), sysfs, uuid))
    finally:
        nvml.nvmlShutdown()
    return out


def choose_nics(provider: str, local_rank: int, ranks_per_node: int, gpu_ordinal: int | None = None,
                gpu_uuid: str | None = None, sysfs: str = "/sys") -> NicChoice:
    """The domains of `provider` (efa, verbs) local rank `local_rank` opens, by `assign_nics`. Its GPU:
    `gpu_uuid` when given (it survives any renumbering), else CUDA ordinal `gpu_ordinal` under
    CUDA_VISIBLE_DEVICES; None (a CPU run) or any NVML problem: round robin by local rank."""
    nics = describe_nics(lf.list_domain_nics(provider), sysfs)
    gpus: list[Device] = []
    gpu, why = None, "no GPU (CPU run)"
    if gpu_ordinal is not None or gpu_uuid:
        try:
            gpus = describe_gpus(_load_nvml(), sysfs)
        except Exception as exc:  # ImportError, NVMLError: the GPU is unknown, not an error
            why = f"GPU unknown (NVML unavailable: {type(exc).__name__}: {exc})"
        else:
            by_uuid = [i for i, g in enumerate(gpus) if gpu_uuid and g.uuid == gpu_uuid]
            gpu = by_uuid[0] if by_uuid else (
                None if gpu_ordinal is None else visible_gpu(gpu_ordinal, os.environ.get("CUDA_VISIBLE_DEVICES"), gpus))
            why = f"GPU unknown (CUDA device {gpu_ordinal}, {gpu_uuid or 'no UUID'}: not among NVML's {len(gpus)})"
    return assign_nics(gpus, nics, gpu, local_rank, ranks_per_node, why)


# ---- proxy placement: which CPU the proxy process runs on ----------------------------------------
def format_cpu_list(cpus) -> str:
    """`[0, 1, 2, 5]` -> "0-2,5" (the kernel's cpu list format)."""
    cpus, runs = sorted(set(cpus)), []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_proxy_cpus(override: str, allowed=None) -> list[int] | None:
    """The CPUs `MOE_A2A_PROXY_CPUS` names: a cpu list ("3", "2-5", "0,4,8-9") as a sorted list, or
    None for "none" (do not pin). ValueError naming the variable when the text is malformed or names
    CPUs outside `allowed` (default: this process's affinity, `os.sched_getaffinity(0)`)."""
    text = override.strip()
    if text.lower() == "none":
        return None
    expected = 'expected a cpu list such as "3", "2-5" or "0,4,8-9", or "none" (do not pin)'
    allowed = os.sched_getaffinity(0) if allowed is None else set(allowed)
    top = max(allowed, default=-1)
    cpus: set[int] = set()
    above: list[str] = []  # the parts past the highest allowed CPU, not expanded (a range may be huge)
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"{PROXY_CPUS_ENV}={override!r}: {expected}") from None
        if a < 0 or b < a:
            raise ValueError(f"{PROXY_CPUS_ENV}={override!r}: {expected} (range {part.strip()!r} is empty)")
        cpus.update(range(a, min(b, top) + 1))
        if b > top:
            above.append(str(b) if max(a, top + 1) == b else f"{max(a, top + 1)}-{b}")
    outside = ",".join(filter(None, [format_cpu_list(cpus - allowed)] + above))
    if outside:
        raise ValueError(f"{PROXY_CPUS_ENV}={override!r}: CPUs {outside} are outside this process's affinity "
                         f"({format_cpu_list(allowed)}); the proxy could not run there")
    return sorted(cpus)


def _load_nvml():
    """pynvml (nvidia-ml-py); a function so tests can put a fake in its place."""
    import pynvml

    return pynvml


def _gpu_cpus(nvml, gpu_ordinal: int, gpu_uuid: str | None) -> tuple[int, list[int]]:
    """(NVML index, CPUs near the GPU) from NVML; the UUID, when known, finds the GPU whatever
    CUDA_VISIBLE_DEVICES renumbered (the ordinal is then only a fallback)."""
    nvml.nvmlInit()
    try:
        handle = (nvml.nvmlDeviceGetHandleByUUID(gpu_uuid) if gpu_uuid
                  else nvml.nvmlDeviceGetHandleByIndex(gpu_ordinal))
        index = int(nvml.nvmlDeviceGetIndex(handle))
        words = (max(os.cpu_count() or 1, max(os.sched_getaffinity(0)) + 1) + 63) // 64
        mask = nvml.nvmlDeviceGetCpuAffinity(handle, words)  # 64-bit words, bit j of word i: CPU 64 i + j
    finally:
        nvml.nvmlShutdown()
    return index, [64 * i + j for i, word in enumerate(mask) for j in range(64) if int(word) >> j & 1]


def choose_proxy_cpus(gpu_ordinal: int | None, rank: int, shard: int, shards: int, override: str | None,
                      gpu_uuid: str | None = None) -> tuple[list[int], str]:
    """The CPUs proxy `shard` of `shards` of `rank` is pinned to (empty: not pinned) and why, in one line.

    `override` (`MOE_A2A_PROXY_CPUS`, read by the model process) wins: its CPUs, or "none". Else, on a
    GPU (`gpu_ordinal` not None), one core of the GPU's NVML CPU affinity within this process's:
    slot (rank * shards + shard) from the high end of that list. A host's ranks are consecutive, so
    its proxies get different cores (ranks sharing one GPU too, which the GPU's index would not give)
    while the list has enough, and the model process, usually on low cores, keeps its own. No GPU,
    or any NVML problem: not pinned (never raises for NVML)."""
    if override is not None:
        cpus = parse_proxy_cpus(override)
        if cpus is None:
            return [], f"not pinned: {PROXY_CPUS_ENV}={override!r}"
        return cpus, f"pinned to CPUs {format_cpu_list(cpus)} by {PROXY_CPUS_ENV}={override!r}"
    if gpu_ordinal is None:
        return [], "not pinned: no GPU (CPU run)"
    try:
        index, near = _gpu_cpus(_load_nvml(), gpu_ordinal, gpu_uuid)
    except Exception as exc:  # ImportError, NVMLError, a driver without the call: run unpinned
        return [], f"not pinned: NVML unavailable: {type(exc).__name__}: {exc}"
    allowed = os.sched_getaffinity(0)
    candidates = sorted(set(near) & allowed)
    if not candidates:
        return [], (f"not pinned: GPU {index}'s CPUs ({format_cpu_list(near) or 'none'}) are outside this "
                    f"process's affinity ({format_cpu_list(allowed)})")
    slot = rank * shards + shard
    cpu = candidates[-1 - slot % len(candidates)]
    return [cpu], (f"pinned to CPU {cpu}: near GPU {index} (NVML: {format_cpu_list(near)}; allowed here: "
                   f"{format_cpu_list(candidates)}), slot {slot} = rank {rank} x {shards} + proxy {shard}")


def pin_current_process(cpus: list[int]) -> list[int]:
    """Pin every thread of this process (and so the threads it starts later) to `cpus`; empty: leave
    it as it is. Returns the CPUs this process may run on afterwards. OSError if the kernel refuses."""
    if cpus:
        for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    return sorted(os.sched_getaffinity(0))
