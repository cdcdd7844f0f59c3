"""The checks of memory registration: FI_HMEM and peer memory (can the NIC register GPU memory?), and the
sizes one rank registers against EFA's per-registration limit."""
from __future__ import annotations

from .common import (EFA_DMABUF_BY_ADDRESS_SINCE, EFA_GPU_MIN, EFA_REMOTE_WRITE_MR_MAX_PAGES, KSYM_DMABUF,
                     PEER_MEMORY_MODULES, Check, _devices, _domains, _gib, _rdma_provider, _version)


def check_fi_hmem(facts: dict) -> Check:
    """FI_HMEM on the RDMA provider: whether buffers='auto' can register GPU memory with the NIC."""
    name, prov = "fi-hmem", _rdma_provider(facts)
    lib_api = _version((facts.get("libfabric") or {}).get("api_version"))
    dmabuf = "DMA-BUF registration (dmabuf_fd=) needs API >= 1.20: " + (
        "available" if lib_api >= (1, 20) else f"not at API {lib_api[0]}.{lib_api[1]}")
    if prov is None:
        return Check(name, "ok", "not applicable: no RDMA provider; tcp and shm stage GPU rows through host memory "
                                 "(buffers='auto' -> staged)")
    if not facts.get("gpus"):
        return Check(name, "ok", f"not applicable: no GPU; {prov} registers host buffers")
    doms = _domains(facts, prov)
    with_hmem = [d["name"] for d in doms if d.get("hmem")]
    if len(with_hmem) == len(doms):
        return Check(name, "ok", f"FI_HMEM offered by {prov} on all {len(doms)} domains: buffers='auto' registers "
                                 f"GPU memory with the NIC (FI_HMEM_CUDA); {dmabuf}")
    why = (facts.get("fi_getinfo") or {}).get(prov, {}).get("hmem_error") or "not in the answer"
    fix = ("use a libfabric >= 1.18 built with CUDA (the EFA installer's), with libcuda.so loadable by the proxy; "
           "FI_HMEM_DISABLE_P2P must be unset" if prov == "efa" else
           "load nvidia-peermem (with MLNX_OFED's peer-memory API) or use a kernel with DMA-BUF memory registration "
           "(>= 5.12, NVIDIA open kernel modules), and a libfabric built with CUDA; FI_HMEM_DISABLE_P2P unset")
    return Check(name, "warn", f"FI_HMEM offered by {prov} on {len(with_hmem)} of {len(doms)} domains ({why}): "
                               f"buffers='auto' falls back to host staging (GPU -> host -> NIC copies); {dmabuf}", fix)


def check_gpu_peer_memory(facts: dict) -> Check:
    """How the NIC reaches GPU memory: a peer-memory module (nvidia_peermem / nv_peer_mem / efa_nv_peermem)
    or DMA-BUF registration in the kernel; and gdrcopy (/dev/gdrdrv) for the provider's small copies."""
    name, prov = "gpu-peer-memory", _rdma_provider(facts)
    if prov is None or not facts.get("gpus"):
        return Check(name, "ok", "not applicable: " + ("no RDMA provider" if prov is None else "no GPU"))
    mods = set((facts.get("modules") or {}).get("loaded") or [])
    ksyms = facts.get("kallsyms")
    peer = [m for m in PEER_MEMORY_MODULES if m in mods]
    dmabuf = bool(ksyms and ksyms.get(KSYM_DMABUF))
    gdr = "gdrcopy: /dev/gdrdrv " + ("present" if facts.get("gdrdrv") else "absent")
    paths = ([f"peer memory ({', '.join(peer)})"] if peer else []) + (["DMA-BUF (kernel)"] if dmabuf else [])
    if paths:
        return Check(name, "ok", f"the NIC can reach GPU memory through {' and '.join(paths)}; {gdr}")
    known = "kernel symbols unknown (/proc/kallsyms unreadable)" if ksyms is None else "no DMA-BUF registration in the kernel"
    fix = ("EFA: the EFA installer's efa driver with DMA-BUF support (or efa_nv_peermem), and the NVIDIA driver's "
           "open kernel modules for DMA-BUF; " if prov == "efa" else "") + \
          "ConnectX: modprobe nvidia-peermem (needs MLNX_OFED's peer-memory API) or a kernel >= 5.12 with DMA-BUF"
    return Check(name, "warn", f"no peer-memory module loaded ({', '.join(PEER_MEMORY_MODULES)}) and {known}: GPU "
                               f"memory cannot be registered with the NIC, buffers='auto' stages through host; {gdr}", fix)


def check_gpu_registration(facts: dict) -> Check:
    """Whether the proxy's cuMem GPU buffers will register with the NIC, and how: the version floor of efa with
    GPU buffers (libfabric >= 1.20, or FI_EFA_SET_CUDA_SYNC_MEMOPS=0), the DMA-BUF path where the kernel has
    DMA-BUF and no peer-memory module (efa registers GPU memory by address only through one up to libfabric
    2.4: the proxy registers by DMA-BUF fd, FI_MR_DMABUF, API >= 1.20), and the CUDA runtime libfabric loads
    by its unversioned name (libcudart.so)."""
    name, prov = "gpu-registration", _rdma_provider(facts)
    if prov is None or not facts.get("gpus"):
        return Check(name, "ok", "not applicable: " + ("no RDMA provider" if prov is None else "no GPU"))
    lib = facts.get("libfabric") or {}
    version, api = _version(lib.get("version")), _version(lib.get("api_version"))
    env = facts.get("env") or {}
    warns, fixes, notes = [], [], []
    cudart = facts.get("cudart") or {}
    if cudart and not cudart.get("loadable"):
        warns.append(f"{cudart.get('name', 'libcudart.so')} does not load ({cudart.get('error') or 'not found'}): "
                     f"libfabric loads the CUDA runtime by that unversioned name, so it offers no FI_HMEM and GPU "
                     f"buffers are staged")
        fixes.append("put a libcudart.so on the proxy's library path (the CUDA toolkit's, or a symlink to pip's "
                     "libcudart.so.<major> in a directory of LD_LIBRARY_PATH)")
    elif cudart.get("path"):
        notes.append(f"libcudart.so -> {cudart['path']}")
    if prov == "efa" and version < EFA_GPU_MIN and (env.get("FI_EFA_SET_CUDA_SYNC_MEMOPS") or "").strip() != "0":
        warns.append(f"libfabric {lib.get('version')} < {EFA_GPU_MIN[0]}.{EFA_GPU_MIN[1]}: efa rejects cuMem GPU "
                     f"buffers at registration; the proxy refuses GPU buffers up front (buffers='auto' stages, "
                     f"buffers='gpu' raises)")
        fixes.append("use libfabric >= 1.20 (a recent EFA installer), or set FI_EFA_SET_CUDA_SYNC_MEMOPS=0 in the "
                     "environment the proxies inherit")
    mods = set((facts.get("modules") or {}).get("loaded") or [])
    peer = [m for m in PEER_MEMORY_MODULES if m in mods]
    dmabuf = bool((facts.get("kallsyms") or {}).get(KSYM_DMABUF))
    if prov == "efa" and not peer and dmabuf and version < EFA_DMABUF_BY_ADDRESS_SINCE:
        if api >= (1, 20):
            notes.append(f"DMA-BUF only (no peer-memory module) with libfabric {lib.get('version')} < "
                         f"{EFA_DMABUF_BY_ADDRESS_SINCE[0]}.{EFA_DMABUF_BY_ADDRESS_SINCE[1]}: by address the "
                         f"registration would fail; the proxy registers by DMA-BUF fd (FI_MR_DMABUF)")
        else:
            warns.append(f"DMA-BUF only (no peer-memory module) at API {lib.get('api_version')}: efa registers GPU "
                         f"memory by address only through a peer-memory module and FI_MR_DMABUF needs API 1.20: "
                         f"GPU buffers are staged")
            fixes.append("use libfabric >= 1.20 (the proxy then registers by DMA-BUF fd) or load efa_nv_peermem")
    elif prov == "efa" and peer:
        notes.append(f"peer memory ({', '.join(peer)}): by address or DMA-BUF fd")
    if warns:
        return Check(name, "warn", "; ".join(warns + notes), "; ".join(fixes))
    how = "by DMA-BUF fd where the driver gives one (API >= 1.20), else by address"
    return Check(name, "ok", f"{prov} with GPU buffers: libfabric {lib.get('version')} (API {lib.get('api_version')}); "
                             f"registered {how}" + (f"; {'; '.join(notes)}" if notes else ""))


def check_registration(facts: dict) -> Check:
    """The registrations of one rank against EFA's per-registration page limit: a buffer over it is
    registered in overlapping chunks (`proxy.fabric_chunks.registration_chunks`), each within the limit."""
    from ..proxy.fabric import EFA_MAX_WRITE_BYTES, MAX_REGISTRATION_ENV, max_registration_from_env, registration_chunks

    name, sizes = "registration", facts.get("sizes") or {}
    if "host_segment_bytes" not in sizes:
        return Check(name, "warn", f"not sized ({sizes.get('error', 'no sizes in the facts')})",
                     "install torch (A2AConfig sizes the buffers) or check --world / --node / --tokens")
    page = int(facts.get("page_size") or 4096)
    limit = EFA_REMOTE_WRITE_MR_MAX_PAGES * page
    try:
        forced = max_registration_from_env(facts.get("env") or {})
    except ValueError as e:
        return Check(name, "fail", f"{e} (every proxy refuses to start with it)",
                     f"unset {MAX_REGISTRATION_ENV} or set it to a number of bytes")
    seg = sizes["host_segment_bytes"]
    pages = -(-seg // page)
    detail = (f"{sizes.get('config')}: host-staged segment {_gib(seg)} ({pages:,} pages of {page} B), written by "
              f"peers; with GPU buffers: recv {_gib(sizes['gpu_recv_bytes'])} (written by peers), send "
              f"{_gib(sizes['gpu_send_bytes'])}; EFA's limit for one remote-writable registration: "
              f"{EFA_REMOTE_WRITE_MR_MAX_PAGES:,} pages = {_gib(limit)} ({100 * pages / EFA_REMOTE_WRITE_MR_MAX_PAGES:.0f}%)")
    verbs_only = _rdma_provider(facts) == "verbs" and not _devices(facts, "efa")
    if forced is not None:
        limit = forced
        detail += f"; {MAX_REGISTRATION_ENV}={forced} sets the limit ({_gib(forced)}) on every provider"
    elif verbs_only:
        return Check(name, "ok", detail + "; verbs: each buffer in one registration")
    # The proxy's chunks overlap by the layout's largest write (or EFA's bound on one write, not sized).
    largest = min(int(sizes.get("largest_write_bytes") or EFA_MAX_WRITE_BYTES), EFA_MAX_WRITE_BYTES)
    parts = []
    for what, n in (("host-staged segment", seg), ("GPU recv buffer", sizes["gpu_recv_bytes"]),
                    ("GPU send buffer", sizes["gpu_send_bytes"])):
        try:
            count = registration_chunks(n, limit, largest, 0, page)[0]
        except ValueError as e:
            return Check(name, "fail", f"{detail}: the {what}: {e}",
                         f"raise or unset {MAX_REGISTRATION_ENV}" if forced is not None else
                         "fewer tokens per call (--tokens) or experts per token: the largest write shrinks with both")
        if count > 1:
            parts.append(f"the {what} in {count} registrations")
    if not parts:
        return Check(name, "ok", detail + ": each buffer in one registration")
    return Check(name, "ok", detail + f": over it, the proxy registers {', '.join(parts)} (overlapping chunks "
                                      f"within the limit, each overlapping the next by the largest write, "
                                      f"{largest:,} B, so no write is split)")

