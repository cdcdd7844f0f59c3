"""The checks of libfabric and its providers: the library, tcp and shm, efa and verbs, the EFA installer,
what transport='auto' picks."""
from __future__ import annotations

from .common import PROVIDERS, Check, _devices, _domains, _version


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

