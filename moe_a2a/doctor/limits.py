"""The checks of this host's limits and environment: RLIMIT_MEMLOCK and the FI_* / MOE_A2A_* variables."""
from __future__ import annotations

import os

from .common import RDMA_PROVIDERS, Check, _devices, _domains, _env_true, _gib, _rdma_provider


def _nics_per_rank(facts: dict) -> int:
    prov = _rdma_provider(facts)
    gpus = len(facts.get("gpus") or []) or 1
    return max(1, len(_domains(facts, prov)) // gpus) if prov else 1


def check_memlock(facts: dict) -> Check:
    """RLIMIT_MEMLOCK: an RDMA registration pins its pages and counts them against it (per registration:
    the proxy registers the host-staged segment once per NIC it opens)."""
    name = "memlock"
    soft = (facts.get("memlock") or {}).get("soft", -1)
    shown = "unlimited" if soft == -1 else f"{soft // 1024} KiB"
    seg = (facts.get("sizes") or {}).get("host_segment_bytes")
    fix = ("ulimit -l unlimited before starting (limits.conf: '* - memlock unlimited'; docker: --ulimit memlock=-1; "
           "systemd: LimitMEMLOCK=infinity)")
    if _rdma_provider(facts) is None and not facts.get("rdma_devices"):
        return Check(name, "ok", f"RLIMIT_MEMLOCK {shown}: tcp and shm do not pin memory (on an RDMA host it must "
                                 f"cover every registration: set it unlimited)")
    if soft == -1:
        return Check(name, "ok", "RLIMIT_MEMLOCK unlimited")
    need = seg * _nics_per_rank(facts) if seg else None
    if need is None or soft < need:
        return Check(name, "fail", f"RLIMIT_MEMLOCK {shown}" + (f" < {_gib(need)} that one rank pins host-staged "
                                   f"(segment x {_nics_per_rank(facts)} NIC(s))" if need else "") +
                     ": registrations fail with -FI_ENOMEM / -FI_EFAULT", fix)
    return Check(name, "warn", f"RLIMIT_MEMLOCK {shown} covers the segment ({_gib(seg)} x {_nics_per_rank(facts)} "
                               f"NIC(s)) but the provider's own buffers pin memory too", fix)




# The variables that matter, what they do (documented in docs/transport.md, "Environment variables").
ENV_NOTES = {
    "FI_PROVIDER": "restricts the providers libfabric loads",
    "FI_EFA_USE_DEVICE_RDMA": "efa: use the device's RDMA (0: every write emulated with sends)",
    "FI_EFA_FORK_SAFE": "efa: fork support (the proxy forks nothing; small cost, no huge pages)",
    "FI_EFA_IFACE": "efa: only these devices are visible",
    "FI_EFA_ENABLE_SHM_TRANSFER": "efa: shm for same-host peers (moe_a2a asks remote-only: not opened)",
    "FI_EFA_USE_HUGE_PAGE": "efa: huge pages for the provider's buffers",
    "FI_HMEM_CUDA_USE_GDRCOPY": "copies to/from GPU memory through gdrcopy (/dev/gdrdrv)",
    "FI_HMEM_CUDA_USE_DMABUF": "register CUDA memory through DMA-BUF",
    "FI_HMEM_DISABLE_P2P": "no peer-to-peer to GPU memory (the NIC cannot write it directly)",
    "FI_EFA_SET_CUDA_SYNC_MEMOPS": "efa: 0 lets libfabric 1.18 / 1.19 register cuMem GPU buffers (>= 1.20 needs none)",
    "FI_VERBS_IFACE": "verbs: only devices on this interface",
    "FI_LOG_LEVEL": "libfabric's logging (debug/trace slow the data path)",
    "MOE_A2A_LIBFABRIC": "the libfabric.so moe_a2a loads (else the EFA installer's, else the system's)",
    "MOE_A2A_PROXY_CPUS": "CPUs the proxies are pinned to ('none': not pinned)",
    "MOE_A2A_EMULATED_NIC": "latency/bandwidth of transport='emulated'",
    "MOE_A2A_HOST_ATOMICS": "'libatomic': host flags through libatomic",
    "MOE_A2A_MAX_REGISTRATION_BYTES": "bytes one registration may span (larger buffers: in chunks); else the provider's",
    "CUDA_VISIBLE_DEVICES": "GPUs this process sees (NIC choice matches GPUs by UUID/PCI, not ordinal)",
}


def _env_problems(env: dict, facts: dict) -> tuple[list[str], list[str], list[str]]:
    """(fails, warns, fixes) for the variables set."""
    fails, warns, fixes = [], [], []
    efa_host = bool(_devices(facts, "efa"))
    rdma = _rdma_provider(facts) is not None
    prov = env.get("FI_PROVIDER")
    if prov is not None:  # "a,b": only these providers; "^a,b": all but these
        excluding = prov.strip().startswith("^")
        named = {p.strip() for p in prov.strip().lstrip("^").split(",")}
        blocked = [k for k in RDMA_PROVIDERS if _devices(facts, k) and (k in named) == excluding]
        if blocked:
            warns.append(f"FI_PROVIDER={prov} hides {', '.join(blocked)}, whose devices are here")
            fixes.append("unset FI_PROVIDER (moe_a2a picks the provider itself)")
    rdma_flag = _env_true(env.get("FI_EFA_USE_DEVICE_RDMA"))
    if efa_host and rdma_flag is False:
        warns.append("FI_EFA_USE_DEVICE_RDMA=0: every RDMA write is emulated with sends (slow)")
        fixes.append("unset FI_EFA_USE_DEVICE_RDMA (API >= 1.18 uses the device's RDMA where it has it)")
    if _env_true(env.get("FI_EFA_FORK_SAFE")):
        warns.append("FI_EFA_FORK_SAFE=1: not needed (the proxy is started by exec and forks nothing), costs a "
                     "little per registration and rules out huge pages")
        fixes.append("unset FI_EFA_FORK_SAFE")
    if env.get("FI_EFA_IFACE") and efa_host:
        warns.append(f"FI_EFA_IFACE={env['FI_EFA_IFACE']}: only those EFA devices are visible to every rank")
        fixes.append("unset FI_EFA_IFACE: nics='auto' gives each rank the NICs next to its GPU")
    if _env_true(env.get("FI_HMEM_CUDA_USE_GDRCOPY")) and not facts.get("gdrdrv"):
        warns.append("FI_HMEM_CUDA_USE_GDRCOPY=1 but /dev/gdrdrv is absent")
        fixes.append("load the gdrdrv module (gdrcopy) or unset FI_HMEM_CUDA_USE_GDRCOPY")
    if _env_true(env.get("FI_HMEM_DISABLE_P2P")) and rdma and facts.get("gpus"):
        warns.append("FI_HMEM_DISABLE_P2P=1: the NIC may not write GPU memory directly (copies, or no FI_HMEM)")
        fixes.append("unset FI_HMEM_DISABLE_P2P")
    level = (env.get("FI_LOG_LEVEL") or "").lower()
    if level in ("debug", "trace"):
        warns.append(f"FI_LOG_LEVEL={level}: logging slows libfabric's data path")
        fixes.append("unset FI_LOG_LEVEL outside debugging")
    path = env.get("MOE_A2A_LIBFABRIC")
    if path and not os.path.exists(path) and os.sep in path:
        fails.append(f"MOE_A2A_LIBFABRIC={path}: no such file")
        fixes.append("point MOE_A2A_LIBFABRIC at an existing libfabric.so.1, or unset it")
    cpus = env.get("MOE_A2A_PROXY_CPUS")
    if cpus is not None and facts.get("source") == "this host":
        from ..proxy.topology import parse_proxy_cpus

        try:
            parse_proxy_cpus(cpus)
        except ValueError as e:
            fails.append(str(e))
            fixes.append("fix or unset MOE_A2A_PROXY_CPUS (every AllToAll refuses to start with it)")
    emu = env.get("MOE_A2A_EMULATED_NIC")
    if emu is not None:
        try:
            from ..proxy.nic_settings import parse_nic_settings

            parse_nic_settings(emu)
        except ValueError as e:
            fails.append(str(e))
            fixes.append("fix or unset MOE_A2A_EMULATED_NIC (e.g. '12us,25GBps')")
        except Exception:  # noqa: BLE001 - the module did not import here: nothing to say of the value
            pass
    atomics = env.get("MOE_A2A_HOST_ATOMICS")
    if atomics not in (None, "", "libatomic"):
        fails.append(f"MOE_A2A_HOST_ATOMICS={atomics!r}: the only accepted value is 'libatomic'")
        fixes.append("unset MOE_A2A_HOST_ATOMICS or set it to 'libatomic'")
    return fails, warns, fixes


def check_environment(facts: dict) -> Check:
    env, name = facts.get("env") or {}, "environment"
    fails, warns, fixes = _env_problems(env, facts)
    shown = [f"{k}={v}" + (f" ({ENV_NOTES[k]})" if k in ENV_NOTES else "") for k, v in env.items()]
    detail = ("set: " + "; ".join(shown)) if shown else "no FI_* or MOE_A2A_* variable set (the defaults)"
    if fails or warns:
        return Check(name, "fail" if fails else "warn", "; ".join(fails + warns) + f" [{detail}]", "; ".join(fixes))
    return Check(name, "ok", detail)

