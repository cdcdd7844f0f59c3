"""Which NICs a rank's proxy drives.

EFA hosts give each GPU several NICs (p5: 32 for 8 GPUs), each a libfabric domain; the proxy opens
its rank's share and the engine shards peers over them. The share is by listing order: the node's
NICs split into equal contiguous runs, one per rank of the node (libfabric lists EFA devices in PCI
order, which on the hosts we know follows GPU order). Matching NICs to GPUs by PCIe switch through
NVML is the refinement to make once an EFA host is at hand to check it on.

Which CPU a rank's proxy runs on (`choose_proxy_cpus`, docs/transport.md, "Proxy placement"): the one
named by `MOE_A2A_PROXY_CPUS`, else one core near its GPU (NVML), else none (CPU runs: not pinned).
"""
from __future__ import annotations

import os

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
