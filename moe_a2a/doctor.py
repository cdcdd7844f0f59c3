"""`moe-a2a doctor`: what to run first on a new cluster. Is this host ready for moe_a2a, and if not, why?

Two halves:

- **Facts** (`collect_facts`): a JSON-able dict of what this host has, gathered without starting any
  process: the libfabric loaded (`proxy.libfabric.library_info`) and the EFA installer's prefix, what
  `fi_getinfo` answers for tcp, shm, efa and verbs to the hints the engine itself uses (domains, fabric,
  API, caps, mr_mode, PCI address of each NIC, `FI_HMEM`), the RDMA devices of `/sys/class/infiniband`
  and their `/dev/infiniband/uverbs*` nodes, the kernel modules of `/proc/modules` that matter
  (efa, ib_core, nvidia_peermem, ...), the kernel's DMA-BUF and peer-memory symbols (`/proc/kallsyms`, as
  libfabric's verbs provider reads them), `/dev/gdrdrv`, the GPUs NVML lists with their PCIe bridges
  (sysfs), the NICs' bridges, `RLIMIT_MEMLOCK`, the page size, the `FI_*` / `MOE_A2A_*` variables, and the
  registration sizes of a configuration (`config.A2AConfig` / `Layout`; default DeepSeek-V3 decode at 64
  ranks, 8 per node).
- **Checks** (`run_checks`): pure functions of the facts, each returning a `Check` (name, verdict
  "ok" / "warn" / "fail", detail, fix). Tests drive them with recorded facts (tests/data/doctor/: a p5
  and a ConnectX node written from documentation and libfabric's source, not captured on hardware).

Exit status of `moe-a2a doctor`: 0 when no check fails (warnings allowed: a CPU machine without RDMA
devices exits 0 with a warning), 1 when at least one check fails, 2 for a bad flag. docs/transport.md,
"Bring-up checklist", shows the expected output per host kind.

torch is imported only to size the registrations (`A2AConfig` validates its dtypes with torch); the GPU
facts come from NVML (pynvml), not torch.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import resource
from dataclasses import asdict, dataclass

SCHEMA = 1
VERDICTS = ("ok", "warn", "fail")
PROVIDERS = ("tcp", "shm", "efa", "verbs")
RDMA_PROVIDERS = ("efa", "verbs")

# EFA: one memory registration that allows remote write may span at most 2^20 pages (4 GiB at 4 KiB pages),
# libfabric PR #10402 ("The EFA limit for single MR that enables remote write is 1M pages aka 4GB for
# regular pages"). The device reports its own byte limit too (ibv max_mr_size = max_mr_pages * PAGE_SIZE,
# Linux drivers/infiniband/hw/efa/efa_verbs.c), not read here.
EFA_REMOTE_WRITE_MR_MAX_PAGES = 1 << 20
EFA_INSTALLER_PREFIX = "/opt/amazon/efa"
EFA_INSTALLER_MANIFEST = "/opt/amazon/efa_installed_packages"  # "# EFA installer version: X" on its first lines

# The sizes registered by default: DeepSeek-V3 decode (as `moe-a2a bench kernels --preset decode`).
DEFAULT_WORLD, DEFAULT_NODE, DEFAULT_TOKENS = 64, 8, 128
DECODE = dict(num_experts=256, experts_per_token=8, hidden_dim=7168)

# Kernel modules that matter, as /proc/modules names them.
MODULES = ("efa", "efa_nv_peermem", "ib_core", "ib_uverbs", "mlx5_core", "mlx5_ib", "nvidia", "nvidia_peermem",
           "nv_peer_mem", "gdrdrv")
PEER_MEMORY_MODULES = ("nvidia_peermem", "nv_peer_mem", "efa_nv_peermem")
# Kernel symbols libfabric's verbs provider looks for (prov/verbs/include/linux/verbs_osd.h): the peer-memory
# API of MLNX_OFED (what nvidia-peermem plugs into) and DMA-BUF memory registration (Linux >= 5.12).
KSYM_PEER_MEMORY, KSYM_DMABUF = "ib_register_peer_memory_client", "ib_umem_dmabuf_get"

# fi_info caps and mr_mode bits by name (rdma/fabric.h), for facts a person can read.
CAP_BITS = {"FI_MSG": 1, "FI_RMA": 2, "FI_TAGGED": 3, "FI_ATOMIC": 4, "FI_MULTICAST": 5, "FI_COLLECTIVE": 6,
            "FI_READ": 8, "FI_WRITE": 9, "FI_RECV": 10, "FI_SEND": 11, "FI_REMOTE_READ": 12,
            "FI_REMOTE_WRITE": 13, "FI_MULTI_RECV": 16, "FI_TRIGGER": 20, "FI_FENCE": 21, "FI_AV_USER_ID": 41,
            "FI_PEER": 43, "FI_HMEM": 47, "FI_VARIABLE_MSG": 48, "FI_RMA_PMEM": 49, "FI_SOURCE_ERR": 50,
            "FI_LOCAL_COMM": 51, "FI_REMOTE_COMM": 52, "FI_SHARED_AV": 53, "FI_RMA_EVENT": 56, "FI_SOURCE": 57,
            "FI_NAMED_RX_CTX": 58, "FI_DIRECTED_RECV": 59}
MR_MODE_BITS = {"FI_MR_BASIC": 0, "FI_MR_SCALABLE": 1, "FI_MR_LOCAL": 2, "FI_MR_RAW": 3, "FI_MR_VIRT_ADDR": 4,
                "FI_MR_ALLOCATED": 5, "FI_MR_PROV_KEY": 6, "FI_MR_MMU_NOTIFY": 7, "FI_MR_RMA_EVENT": 8,
                "FI_MR_ENDPOINT": 9, "FI_MR_HMEM": 10, "FI_MR_COLLECTIVE": 11}


def bit_names(value: int, table: dict[str, int]) -> list[str]:
    """Names of the bits set in `value` (unknown bits as "0x..")."""
    names = [name for name, bit in table.items() if value >> bit & 1]
    rest = value & ~sum(1 << b for b in table.values())
    return names + ([hex(rest)] if rest else [])


@dataclass(frozen=True)
class Check:
    """One verdict: `name`, `verdict` ("ok", "warn", "fail"), `detail` (what was found), `fix` (what to
    do; empty when nothing)."""
    name: str
    verdict: str
    detail: str
    fix: str = ""

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"Check {self.name}: verdict {self.verdict!r} not in {VERDICTS}")


# ==================================================================================================
# Facts of this host
# ==================================================================================================
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


_PCI = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def library_facts(environ) -> dict:
    """Which libfabric loads (path, source, version, API requested) and which would be tried."""
    from .proxy import libfabric as lf

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
    from .proxy import libfabric as lf

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
    from .proxy import libfabric as lf

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
    from .proxy import libfabric as lf

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


def rdma_device_facts(sysfs: str = "/sys", dev: str = "/dev") -> list[dict]:
    """The devices of /sys/class/infiniband: driver (efa, mlx5_core...), PCI address, port state, link
    layer, their uverbs nodes and whether this process may open them (read and write)."""
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
        out.append({
            "name": name,
            "driver": os.path.basename(os.path.realpath(driver)) if os.path.exists(driver) else None,
            "pci": last if _PCI.fullmatch(last) else None,
            "state": _read(os.path.join(base, name, "ports", "1", "state")),
            "link_layer": _read(os.path.join(base, name, "ports", "1", "link_layer")),
            "uverbs": nodes,
            "uverbs_ok": bool(nodes) and all(os.access(os.path.join(dev, "infiniband", u), os.R_OK | os.W_OK)
                                             for u in nodes),
        })
    return out


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
    from .proxy import topology

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

        from .config import A2AConfig

        cfg = A2AConfig(max_num_tokens=tokens, **DECODE, in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16)
        lay = cfg.layout(world, node)
    except (ImportError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    from .proxy.worker import largest_write_bytes

    out.update(host_segment_bytes=lay.segment_bytes(True), gpu_recv_bytes=lay.recv_bytes,
               gpu_send_bytes=lay.send_bytes, largest_write_bytes=largest_write_bytes(lay))
    return out


def collect_facts(*, world: int = DEFAULT_WORLD, node: int = DEFAULT_NODE, tokens: int = DEFAULT_TOKENS,
                  environ=None, sysfs: str = "/sys", proc: str = "/proc", dev: str = "/dev",
                  efa_prefix: str = EFA_INSTALLER_PREFIX) -> dict:
    """Everything the checks read, from this host (see the module docstring). Starts no process."""
    from .proxy import topology

    env = dict(os.environ if environ is None else environ)
    facts: dict = {"schema": SCHEMA, "source": "this host"}
    facts["libfabric"] = library_facts(env)
    facts["efa_installer"] = efa_installer_facts(efa_prefix)
    if "error" in facts["libfabric"]:
        facts["providers"], facts["fi_getinfo"] = [], {p: {"provider": p, "domains": [], "error": "no libfabric",
                                                           "hmem_error": None} for p in PROVIDERS}
    else:
        from .proxy import libfabric as lf

        facts["providers"] = lf.list_providers()
        facts["fi_getinfo"] = {p: provider_facts(p) for p in PROVIDERS}
    facts["rdma_devices"] = rdma_device_facts(sysfs, dev)
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


# ==================================================================================================
# Checks: pure functions of the facts
# ==================================================================================================
def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _devices(facts: dict, kind: str) -> list[dict]:
    """RDMA devices of `kind`: "efa" (driver efa) or "verbs" (any other driver: mlx5_core, ...)."""
    devs = facts.get("rdma_devices") or []
    return [d for d in devs if (d.get("driver") == "efa") == (kind == "efa")]


def _domains(facts: dict, provider: str) -> list[dict]:
    return (facts.get("fi_getinfo", {}).get(provider) or {}).get("domains") or []


def _rdma_provider(facts: dict) -> str | None:
    """The RDMA provider moe_a2a would use here: efa, else verbs, else None."""
    return next((p for p in RDMA_PROVIDERS if _domains(facts, p)), None)


def _version(text: str | None) -> tuple[int, int]:
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return 0, 0


def _env_true(value: str | None) -> bool | None:
    """libfabric's boolean parsing (1/true/yes/on, 0/false/no/off); None when unset or unreadable."""
    if value is None:
        return None
    v = value.strip().lower()
    return True if v in ("1", "true", "yes", "on", "y") else False if v in ("0", "false", "no", "off", "n") else None


def check_libfabric(facts: dict) -> Check:
    lib, inst = facts.get("libfabric") or {}, facts.get("efa_installer") or {}
    name = "libfabric"
    if "error" in lib:
        return Check(name, "fail", f"cannot load libfabric: {lib['error']}",
                     "Debian/Ubuntu: apt-get install libfabric1 (tcp, shm); EFA hosts: run the EFA installer "
                     "(/opt/amazon/efa); or point MOE_A2A_LIBFABRIC at a libfabric.so.1 >= 1.17")
    where = f"libfabric {lib.get('version')} (API {lib.get('api_version')} requested) from {lib.get('path')} " \
            f"({lib.get('source')})"
    if not _devices(facts, "efa"):
        return Check(name, "ok", where)
    if _version(lib.get("version")) < (1, 18):
        return Check(name, "fail", f"{where}: the efa provider needs libfabric >= 1.18 (hardware RDMA write, "
                                   f"FI_HMEM); moe_a2a refuses efa below it",
                     "use the EFA installer's libfabric (/opt/amazon/efa/lib*/libfabric.so.1, preferred when present) "
                     "or set MOE_A2A_LIBFABRIC to a libfabric >= 1.18 built with efa and CUDA")
    if lib.get("source") == "EFA installer" or lib.get("source") == "MOE_A2A_LIBFABRIC":
        return Check(name, "ok", where)
    if inst.get("libfabric"):
        return Check(name, "warn", f"{where}, although the EFA installer's is at {inst['libfabric']} (it did not "
                                   f"load: see the log line of moe_a2a.proxy)",
                     "check that the EFA installer's library loads (ldd on it), or set MOE_A2A_LIBFABRIC on purpose")
    return Check(name, "warn", f"{where} on an EFA host without the EFA installer: a distribution's libfabric "
                               f"may lack CUDA support (FI_HMEM) or the newest efa fixes",
                 "install the EFA installer (it puts libfabric under /opt/amazon/efa, which moe_a2a prefers)")


def check_local_provider(facts: dict, provider: str) -> Check:
    """tcp or shm: what local runs (LocalCluster, tests, benchmarks) and same-host peers use."""
    gi = (facts.get("fi_getinfo") or {}).get(provider) or {}
    name = f"provider {provider}"
    use = {"tcp": "local runs and tests (127.0.0.1); between hosts only at socket speed",
           "shm": "peers on this host (LocalCluster, simulated nodes)"}[provider]
    if gi.get("domains"):
        doms = ", ".join(d["name"] for d in gi["domains"])
        api = gi["domains"][0].get("api")
        return Check(name, "ok", f"{gi.get('provider')} usable (API {api}; domains {doms}): {use}")
    return Check(name, "warn", f"{gi.get('provider', provider)} not usable: {gi.get('error') or 'no domain'}",
                 f"transport={provider!r} and LocalCluster runs over it will be refused; a libfabric built "
                 f"with the {provider} provider (Debian: libfabric1) has it; check FI_PROVIDER")


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


def check_rdma_provider(facts: dict, provider: str) -> Check:
    """efa or verbs: the provider must list the devices of its kind."""
    devs, gi = _devices(facts, provider), (facts.get("fi_getinfo") or {}).get(provider) or {}
    doms = gi.get("domains") or []
    name = f"provider {provider}"
    if not devs and not doms:
        return Check(name, "ok", f"not applicable: no {provider} device here")
    if not doms:
        fix = ("use the EFA installer's libfabric (>= 1.18, built with efa) or point MOE_A2A_LIBFABRIC at one; "
               "check FI_PROVIDER and FI_EFA_IFACE" if provider == "efa" else
               "use a libfabric built with verbs (rdma-core installed); check FI_PROVIDER and FI_VERBS_IFACE")
        return Check(name, "fail", f"{len(devs)} {provider} device(s) but {gi.get('provider', provider)} offers "
                                   f"no RDM endpoint with RMA writes: {gi.get('error') or 'no domain'}", fix)
    fabric = sorted({d.get("fabric") or "?" for d in doms})
    detail = (f"{gi.get('provider')}: {len(doms)} domain(s) ({', '.join(d['name'] for d in doms[:4])}"
              f"{', ...' if len(doms) > 4 else ''}), fabric {', '.join(fabric)}, API {doms[0].get('api')}")
    if devs and len(doms) < len(devs):
        return Check(name, "warn", f"{detail}: {len(doms)} domains for {len(devs)} devices",
                     "a device whose port is down, or FI_EFA_IFACE / FI_VERBS_IFACE hides some: each rank uses only "
                     "the NICs listed")
    return Check(name, "ok", detail)


def check_efa_installer(facts: dict) -> Check:
    inst, mods = facts.get("efa_installer") or {}, facts.get("modules") or {}
    name = "efa-installer"
    if not _devices(facts, "efa"):
        return Check(name, "ok", "not applicable: not an EFA host" +
                     (f" (installer present at {inst.get('prefix')})" if inst.get("present") else ""))
    if not inst.get("present"):
        return Check(name, "warn", f"EFA devices but no EFA installer at {inst.get('prefix')}",
                     "install it (aws-efa-installer: efa kernel driver, rdma-core, libfabric with efa and CUDA)")
    efa_v = (mods.get("versions") or {}).get("efa")
    return Check(name, "ok", f"EFA installer {inst.get('version') or '(version unknown)'} at {inst.get('prefix')}, "
                             f"libfabric {inst.get('libfabric')}, efa driver {efa_v or '(version unknown)'}")


def check_transport(facts: dict) -> Check:
    """What AllToAll(transport="auto") picks here (runtime/wiring.py choose_transport, engine.auto_provider)."""
    name = "transport"
    usable = [p for p in PROVIDERS if _domains(facts, p)]
    if not usable:
        return Check(name, "fail", "no provider usable: none of tcp, shm, efa, verbs offers RDM endpoints with "
                                   "RMA writes and remote CQ data", "see the provider checks above")
    if "efa" in usable:
        return Check(name, "ok", "transport='auto' picks efa (between hosts)")
    auto = "shm on one host, tcp between hosts" if "shm" in usable else "tcp"
    if "verbs" in usable:  # auto never picks verbs: the user says so (not a fault of the host)
        return Check(name, "ok", f"transport='auto' picks {auto}, never verbs: pass transport='verbs' to AllToAll "
                                 f"on this host")
    return Check(name, "ok", f"transport='auto' picks {auto}: local runs only (no RDMA provider)")


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


def check_nic_map(facts: dict) -> Check:
    """The GPU -> NIC plan of nics='auto' (proxy/topology.py plan_nics) over the facts' PCIe tree."""
    from .proxy import topology

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


def check_registration(facts: dict) -> Check:
    """The registrations of one rank against EFA's per-registration page limit: a buffer over it is
    registered in overlapping chunks (`proxy.fabric_chunks.registration_chunks`), each within the limit."""
    from .proxy.fabric import EFA_MAX_WRITE_BYTES, MAX_REGISTRATION_ENV, max_registration_from_env, registration_chunks

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
        from .proxy.topology import parse_proxy_cpus

        try:
            parse_proxy_cpus(cpus)
        except ValueError as e:
            fails.append(str(e))
            fixes.append("fix or unset MOE_A2A_PROXY_CPUS (every AllToAll refuses to start with it)")
    emu = env.get("MOE_A2A_EMULATED_NIC")
    if emu is not None:
        try:
            from .proxy.nic_settings import parse_nic_settings

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


def run_checks(facts: dict) -> list[Check]:
    """Every check, in the order shown."""
    return [check_libfabric(facts), check_local_provider(facts, "tcp"), check_local_provider(facts, "shm"),
            check_rdma_devices(facts), check_rdma_provider(facts, "efa"), check_rdma_provider(facts, "verbs"),
            check_efa_installer(facts), check_transport(facts), check_gpus(facts), check_fi_hmem(facts),
            check_gpu_peer_memory(facts), check_nic_map(facts), check_memlock(facts), check_registration(facts),
            check_environment(facts)]


def exit_code(checks: list[Check]) -> int:
    """1 when a check fails, else 0 (warnings do not change the exit status)."""
    return 1 if any(c.verdict == "fail" for c in checks) else 0


def summary(facts: dict, checks: list[Check]) -> str:
    failed = [c.name for c in checks if c.verdict == "fail"]
    warned = [c.name for c in checks if c.verdict == "warn"]
    prov = _rdma_provider(facts)
    if failed:
        return f"{len(failed)} check(s) failed ({', '.join(failed)}): fix them before running moe_a2a here."
    if prov is None:
        return ("No EFA or verbs device: moe_a2a runs on this host only (LocalCluster, tests, benchmarks over "
                "shm/tcp); nothing failed, so the exit status is 0.")
    return f"Ready for inter-node runs over {prov}" + (f", with warnings ({', '.join(warned)})." if warned else ".")


def report(facts: dict, checks: list[Check] | None = None) -> dict:
    """The `--json` document: schema, exit_code, summary, counts, checks, facts."""
    checks = run_checks(facts) if checks is None else checks
    return {"schema": SCHEMA, "exit_code": exit_code(checks), "summary": summary(facts, checks),
            "counts": {v: sum(c.verdict == v for c in checks) for v in VERDICTS},
            "checks": [asdict(c) for c in checks], "facts": facts}


def format_text(doc: dict) -> str:
    """The human-readable report: one line per check (details of several lines indented), the fix under
    anything not ok, then the summary."""
    width = max(len(c["name"]) for c in doc["checks"])
    out = [f"moe-a2a doctor ({doc['facts'].get('source', 'facts')})"]
    for c in doc["checks"]:
        first, *rest = c["detail"].splitlines() or [""]
        out.append(f"  {c['verdict']:<4}  {c['name']:<{width}}  {first}")
        out += [f"  {'':<4}  {'':<{width}}    {line}" for line in rest]
        if c["verdict"] != "ok" and c["fix"]:
            out.append(f"  {'':<4}  {'':<{width}}  fix: {c['fix']}")
    n = doc["counts"]
    out.append(f"{n['ok']} ok, {n['warn']} warn, {n['fail']} fail. {doc['summary']} (exit {doc['exit_code']})")
    return "\n".join(out)


def load_facts(path: str) -> dict:
    """Recorded facts (e.g. tests/data/doctor/p5_efa.json); keys starting with "_" are notes."""
    try:
        with open(path) as f:
            facts = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--facts {path}: {e}") from None
    if not isinstance(facts, dict) or facts.get("schema") != SCHEMA:
        raise ValueError(f"--facts {path}: not facts of schema {SCHEMA} (a --json report's 'facts')")
    facts.setdefault("source", f"recorded: {path}")
    return facts


def run(args) -> int:
    """`moe-a2a doctor` (args from cli.py): print the report, return the exit status."""
    if args.facts:
        facts = load_facts(args.facts)
        if "sizes" not in facts:
            facts["sizes"] = registration_sizes(args.world, args.node, args.tokens)
    else:
        facts = collect_facts(world=args.world, node=args.node, tokens=args.tokens)
    doc = report(facts)
    print(json.dumps(doc, indent=1) if args.json else format_text(doc))
    return doc["exit_code"]
