"""`moe-a2a doctor` (moe_a2a/doctor/): the checks over recorded facts of a p5 (EFA) and a ConnectX (verbs)
node, each with the one fact that breaks it; the live collector over a fake sysfs/proc/dev tree and on this
host (tcp and shm, no RDMA device: warnings, exit 0); the command line.

The recorded facts (tests/data/doctor/) were written from libfabric's source and public documentation, not
captured on hardware: their `_provenance` says where each fact comes from.
"""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_a2a import doctor
from moe_a2a.doctor import Check

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "doctor"
P5, CONNECTX = DATA / "p5_efa.json", DATA / "connectx_verbs.json"
NAMES = ["libfabric", "provider tcp", "provider shm", "rdma-devices", "provider efa", "provider verbs", "rdma-cm",
         "efa-installer", "transport", "gpus", "fi-hmem", "gpu-peer-memory", "gpu-registration", "proxy-gpu",
         "nic-map", "memlock", "registration", "environment"]
# Sizes as registration_sizes gives them, fixed here so the rules are tested apart from config.py's layout.
SIZES = {"world": 64, "node": 8, "tokens": 128, "config": "test sizes", "host_segment_bytes": 3 << 30,
         "gpu_recv_bytes": 1 << 30, "gpu_send_bytes": 2 << 30}


def load(path) -> dict:
    facts = doctor.load_facts(str(path))
    facts["sizes"] = dict(SIZES)
    return facts


@pytest.fixture
def p5():
    return load(P5)


@pytest.fixture
def cx():
    return load(CONNECTX)


def verdicts(facts) -> dict[str, str]:
    return {c.name: c.verdict for c in doctor.run_checks(facts)}


def by_name(facts, name) -> Check:
    [c] = [c for c in doctor.run_checks(facts) if c.name == name]
    return c


# ---- recorded hosts, healthy ---------------------------------------------------------------------------
def test_healthy_p5_passes_every_check(p5):
    checks = doctor.run_checks(p5)
    assert [c.name for c in checks] == NAMES
    assert {c.name: c.verdict for c in checks} == dict.fromkeys(NAMES, "ok"), [c for c in checks if c.verdict != "ok"]
    assert doctor.exit_code(checks) == 0
    assert doctor.summary(p5, checks) == "Ready for inter-node runs over efa."
    assert "32 domain(s)" in by_name(p5, "provider efa").detail and "API 1.22" in by_name(p5, "provider efa").detail
    assert "FI_HMEM offered by efa on all 32 domains" in by_name(p5, "fi-hmem").detail
    assert "picks efa" in by_name(p5, "transport").detail


def test_p5_nic_map_gives_each_gpu_the_four_nics_of_its_switch(p5):
    lines = by_name(p5, "nic-map").detail.splitlines()[1:]
    assert len(lines) == 8
    for g, line in enumerate(lines):
        bus = 0x4F + 0x11 * g  # the sample's first NIC bus of switch g (names: rdmap<bus in decimal>s0)
        want = ", ".join(f"rdmap{bus + k}s0-rdm" for k in range(4))
        assert line == f"GPU {g} ({p5['gpus'][g]['pci']}) -> {want} [switch]", line


def test_healthy_connectx_node_passes_and_says_to_ask_for_verbs(cx):
    assert verdicts(cx) == dict.fromkeys(NAMES, "ok")
    assert "pass transport='verbs'" in by_name(cx, "transport").detail
    # verbs' fi_info->nic has no PCI address: the map comes from sysfs (each GPU and its own NIC)
    assert all(d["pci"] is None for d in cx["fi_getinfo"]["verbs"]["domains"])
    lines = by_name(cx, "nic-map").detail.splitlines()[1:]
    assert lines == [f"GPU {g} ({cx['gpus'][g]['pci']}) -> mlx5_{g} [switch]" for g in range(8)]
    assert "peer memory (nvidia_peermem)" in by_name(cx, "gpu-peer-memory").detail


def test_recorded_facts_say_where_they_come_from_and_are_consistent():
    for path in (P5, CONNECTX):
        raw = json.loads(path.read_text())
        assert "NOT captured on hardware by us" in raw["_provenance"]["what"]
        assert len(raw["_provenance"]["sources"]) >= 8
        prov = "efa" if path == P5 else "verbs"
        doms, devs = raw["fi_getinfo"][prov]["domains"], raw["rdma_devices"]
        assert len(doms) == len(devs) == len(raw["nics"][prov]) and len(raw["gpus"]) == 8
        for d in doms:
            assert set(d["caps"]) <= set(doctor.CAP_BITS) and set(d["mr_mode"]) <= set(doctor.MR_MODE_BITS)
            assert "FI_HMEM" in d["caps"] and d["hmem"]
    p5 = json.loads(P5.read_text())
    assert len(p5["rdma_devices"]) == 32
    for dom, dev in zip(p5["fi_getinfo"]["efa"]["domains"], p5["rdma_devices"]):
        assert dom["name"] == dev["name"] + "-rdm" and dom["pci"] == dev["pci"]
        assert int(dev["name"][len("rdmap"):-len("s0")]) == int(dev["pci"].split(":")[1], 16)  # bus in decimal


def test_name_tables_agree_with_the_shim():
    from moe_a2a.proxy import libfabric as lf

    for name in ("FI_RMA", "FI_WRITE", "FI_REMOTE_WRITE", "FI_HMEM", "FI_LOCAL_COMM", "FI_REMOTE_COMM", "FI_READ"):
        assert 1 << doctor.CAP_BITS[name] == getattr(lf, name), name
    for name in ("FI_MR_LOCAL", "FI_MR_VIRT_ADDR", "FI_MR_ALLOCATED", "FI_MR_PROV_KEY", "FI_MR_HMEM"):
        assert 1 << doctor.MR_MODE_BITS[name] == getattr(lf, name), name
    assert doctor.bit_names(lf.FI_RMA | lf.FI_HMEM | 1 << 62, doctor.CAP_BITS) == ["FI_RMA", "FI_HMEM", hex(1 << 62)]


# ---- recorded hosts, each broken by one fact -------------------------------------------------------------
def _efa_domains(facts):
    return facts["fi_getinfo"]["efa"]["domains"]


def test_old_libfabric_on_efa_fails(p5):
    p5["libfabric"].update(version="1.17", api_version="1.17", source="system", path="/usr/lib/libfabric.so.1")
    p5["fi_getinfo"]["efa"].update(domains=[], error="provider efa needs libfabric >= 1.18")
    v = verdicts(p5)
    assert v["libfabric"] == v["provider efa"] == "fail" and doctor.exit_code(doctor.run_checks(p5)) == 1
    assert "needs libfabric >= 1.18" in by_name(p5, "libfabric").detail
    assert "MOE_A2A_LIBFABRIC" in by_name(p5, "libfabric").fix
    assert doctor.summary(p5, doctor.run_checks(p5)).startswith("2 check(s) failed (libfabric, provider efa)")


def test_distribution_libfabric_on_efa_without_installer_warns(p5):
    p5["libfabric"].update(source="system", path="/usr/lib/x86_64-linux-gnu/libfabric.so.1")
    p5["efa_installer"].update(present=False, libfabric=None)
    v = verdicts(p5)
    assert v["libfabric"] == v["efa-installer"] == "warn" and doctor.exit_code(doctor.run_checks(p5)) == 0
    p5["efa_installer"].update(present=True, libfabric="/opt/amazon/efa/lib/libfabric.so.1")
    assert "did not load" in by_name(p5, "libfabric").detail


def test_no_fi_hmem_warns_that_gpu_rows_are_staged(p5):
    for d in _efa_domains(p5):
        d["hmem"] = False
    c = by_name(p5, "fi-hmem")
    assert c.verdict == "warn" and "on 0 of 32 domains" in c.detail and "host staging" in c.detail
    assert "built with CUDA" in c.fix
    p5["gpus"] = []  # no GPU: nothing to register
    assert by_name(p5, "fi-hmem").verdict == "ok"


def test_dmabuf_needs_api_1_20(p5):
    assert "available" in by_name(p5, "fi-hmem").detail
    p5["libfabric"]["api_version"] = "1.18"
    assert "not at API 1.18" in by_name(p5, "fi-hmem").detail


def test_gpu_memory_path(p5, cx):
    p5["kallsyms"][doctor.KSYM_DMABUF] = False
    c = by_name(p5, "gpu-peer-memory")
    assert c.verdict == "warn" and "cannot be registered" in c.detail and "EFA" in c.fix
    p5["modules"]["loaded"].append("efa_nv_peermem")
    assert by_name(p5, "gpu-peer-memory").verdict == "ok"
    cx["kallsyms"][doctor.KSYM_DMABUF] = False  # nvidia_peermem alone is enough
    assert by_name(cx, "gpu-peer-memory").verdict == "ok"
    cx["modules"]["loaded"].remove("nvidia_peermem")
    c = by_name(cx, "gpu-peer-memory")
    assert c.verdict == "warn" and "nvidia-peermem" in c.fix
    cx["kallsyms"] = None
    assert "unreadable" in by_name(cx, "gpu-peer-memory").detail


def test_uverbs_not_accessible_fails(p5):
    p5["rdma_devices"][3]["uverbs_ok"] = False
    c = by_name(p5, "rdma-devices")
    assert c.verdict == "fail" and "rdmap82s0" in c.detail and "--device" in c.fix
    assert doctor.exit_code(doctor.run_checks(p5)) == 1


def test_port_down_or_module_missing_warns(p5):
    p5["rdma_devices"][0]["state"] = "1: DOWN"
    assert by_name(p5, "rdma-devices").verdict == "warn" and "rdmap79s0" in by_name(p5, "rdma-devices").detail
    p5["rdma_devices"][0]["state"] = "4: ACTIVE"
    p5["modules"]["loaded"].remove("efa")
    assert by_name(p5, "rdma-devices").verdict == "warn" and "efa" in by_name(p5, "rdma-devices").detail


def test_provider_missing_devices(p5):
    del _efa_domains(p5)[4:]
    c = by_name(p5, "provider efa")
    assert c.verdict == "warn" and "4 domains for 32 devices" in c.detail


def test_memlock(p5):
    p5["memlock"]["soft"] = 64 << 10
    c = by_name(p5, "memlock")
    assert c.verdict == "fail" and "64 KiB" in c.detail and "x 4 NIC(s)" in c.detail and "ulimit -l" in c.fix
    p5["memlock"]["soft"] = 64 << 30  # covers 4 x 3 GiB
    assert by_name(p5, "memlock").verdict == "warn"
    p5["memlock"]["soft"] = 8 << 30
    assert by_name(p5, "memlock").verdict == "fail"


def test_registration_against_efa_limit(p5, cx):
    c = by_name(p5, "registration")
    assert c.verdict == "ok" and "(75%)" in c.detail and "each buffer in one registration" in c.detail
    p5["sizes"]["host_segment_bytes"] = (4 << 30) + 4096  # one page over 2^20 pages of 4 KiB: two chunks
    c = by_name(p5, "registration")
    assert c.verdict == "ok" and "the host-staged segment in 2 registrations" in c.detail, c.detail
    assert "1,073,741,824 B" in c.detail  # not sized: chunks overlap by EFA's bound on one write (1 GiB)
    p5["sizes"].update(host_segment_bytes=int(14.2 * 2**30), gpu_recv_bytes=5 << 30, largest_write_bytes=4 << 20)
    c = by_name(p5, "registration")  # issue 30's 128 ranks x 512 tokens; chunks overlap by the largest write
    assert c.verdict == "ok" and "segment in 4 registrations, the GPU recv buffer in 2 registrations" in c.detail
    p5["sizes"]["host_segment_bytes"] = 4 << 30  # exactly at the limit
    assert "segment in" not in by_name(p5, "registration").detail
    cx["sizes"]["host_segment_bytes"] = 10 << 30  # EFA's limit is not verbs'
    c = by_name(cx, "registration")
    assert c.verdict == "ok" and "verbs: each buffer in one registration" in c.detail
    p5["env"] = {"MOE_A2A_MAX_REGISTRATION_BYTES": str(1 << 30)}  # forced: 1 GiB chunks, 4 MiB overlap
    c = by_name(p5, "registration")
    assert c.verdict == "ok" and "segment in 5 registrations" in c.detail and "=1073741824 sets the limit" in c.detail
    p5["env"] = {"MOE_A2A_MAX_REGISTRATION_BYTES": str(4 << 20)}  # not over the largest write: the proxy refuses
    c = by_name(p5, "registration")
    assert c.verdict == "fail" and "largest write (4194304 B)" in c.detail and "MOE_A2A_MAX_REGISTRATION_BYTES" in c.fix
    p5["env"] = {"MOE_A2A_MAX_REGISTRATION_BYTES": "4G"}
    assert by_name(p5, "registration").verdict == "fail"
    del p5["sizes"]["host_segment_bytes"]
    assert by_name(p5, "registration").verdict == "warn"


def test_registration_sizes_are_the_layouts():
    import torch

    from moe_a2a.config import A2AConfig

    s = doctor.registration_sizes(32, 8, 256)
    lay = A2AConfig(max_num_tokens=256, num_experts=256, experts_per_token=8, hidden_dim=7168,
                    in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16).layout(32, 8)
    assert (s["host_segment_bytes"], s["gpu_recv_bytes"], s["gpu_send_bytes"]) == \
        (lay.segment_bytes(True), lay.recv_bytes, lay.send_bytes)
    assert s["largest_write_bytes"] == max(lay.routing_row_bytes + lay.private_rows * lay.dispatch_stride_bytes,
                                           lay.max_routes * max(lay.dispatch_stride_bytes, lay.combine_stride_bytes))
    assert doctor.registration_sizes(128, 8, 512)["host_segment_bytes"] > 4 << 30  # issue 30's example is over
    assert "error" in doctor.registration_sizes(48, 8, 128)  # 256 experts over 48 ranks


def test_nic_map_without_topology_or_gpu_warns(p5):
    for n in p5["nics"]["efa"]:
        n["bridges"], n["numa"] = None, None
    c = by_name(p5, "nic-map")
    assert c.verdict == "warn" and "[round-robin]" in c.detail and "sysfs" in c.fix
    p5["gpus"] = []
    c = by_name(p5, "nic-map")
    assert c.verdict == "warn" and "round robin by local rank" in c.detail
    assert by_name(p5, "gpus").verdict == "warn"


@pytest.mark.parametrize("env, verdict, words", [
    ({"FI_EFA_USE_DEVICE_RDMA": "0"}, "warn", "emulated"),
    ({"FI_EFA_USE_DEVICE_RDMA": "1"}, "ok", "FI_EFA_USE_DEVICE_RDMA=1"),
    ({"FI_PROVIDER": "tcp"}, "warn", "hides efa"),
    ({"FI_PROVIDER": "^efa"}, "warn", "hides efa"),
    ({"FI_PROVIDER": "efa"}, "ok", "restricts the providers"),
    ({"FI_EFA_FORK_SAFE": "1"}, "warn", "forks nothing"),
    ({"FI_EFA_IFACE": "rdmap79s0"}, "warn", "only those EFA devices"),
    ({"FI_HMEM_CUDA_USE_GDRCOPY": "1"}, "ok", "gdrcopy"),
    ({"FI_HMEM_DISABLE_P2P": "1"}, "warn", "may not write GPU memory"),
    ({"FI_LOG_LEVEL": "debug"}, "warn", "slows"),
    ({"MOE_A2A_LIBFABRIC": "/nowhere/libfabric.so.1"}, "fail", "no such file"),
    ({"MOE_A2A_HOST_ATOMICS": "plain"}, "fail", "only accepted value"),
    ({"MOE_A2A_EMULATED_NIC": "fast"}, "fail", "MOE_A2A_EMULATED_NIC"),
    ({"SOMETHING_ELSE": "1"}, "ok", "no FI_* or MOE_A2A_* variable set"),
])
def test_environment(p5, env, verdict, words):
    p5["env"] = {k: v for k, v in env.items() if k.startswith(("FI_", "MOE_A2A_"))}
    c = by_name(p5, "environment")
    assert c.verdict == verdict and words in c.detail, c
    assert (c.fix != "") == (verdict != "ok")


def test_gdrcopy_asked_without_its_device(p5):
    p5["env"], p5["gdrdrv"] = {"FI_HMEM_CUDA_USE_GDRCOPY": "1"}, False
    assert by_name(p5, "environment").verdict == "warn"


def test_no_provider_at_all_fails(p5):
    for p in doctor.PROVIDERS:
        p5["fi_getinfo"][p].update(domains=[], error="no data")
    v = verdicts(p5)
    assert v["transport"] == "fail" and v["provider tcp"] == v["provider shm"] == "warn"
    p5["libfabric"] = {"error": "cannot load libfabric: tried libfabric.so.1"}
    assert by_name(p5, "libfabric").verdict == "fail" and "apt-get install libfabric1" in by_name(p5, "libfabric").fix


def test_cpu_host_facts_give_local_runs_only(p5):
    """The p5 with everything RDMA and GPU taken away reads as this CI machine: tcp and shm ok, one
    warning (no RDMA device), exit 0."""
    p5.update(rdma_devices=[], gpus=[], nics={}, kallsyms=None, gpu_error="NVMLError_LibraryNotFound")
    p5["fi_getinfo"]["efa"].update(domains=[], error="no data")
    p5["memlock"]["soft"] = 8 << 20
    checks = doctor.run_checks(p5)
    assert {c.name: c.verdict for c in checks} == {**dict.fromkeys(NAMES, "ok"), "rdma-devices": "warn"}
    assert doctor.exit_code(checks) == 0 and "runs on this host only" in doctor.summary(p5, checks)
    assert "not applicable" in by_name(p5, "nic-map").detail and "8192 KiB" in by_name(p5, "memlock").detail


# ---- issue 44: what would fail on a p5 / p5en / ConnectX-7 with GPU buffers -------------------------------
@pytest.fixture
def p5en(p5):
    """A p5en as far as the checks below read it: 8 H200, 16 EFA devices (a PCIe switch holds 2 GPUs and 4
    NICs, tests/proxy/test_topology.py's shape), DMA-BUF in the kernel and no peer-memory module."""
    p5en = copy.deepcopy(p5)
    del p5en["rdma_devices"][16:], p5en["fi_getinfo"]["efa"]["domains"][16:], p5en["nics"]["efa"][16:]
    return p5en


@pytest.mark.parametrize("version, api, env, verdict, words", [
    ("1.18", "1.18", {}, "warn", "libfabric 1.18 < 1.20: efa rejects cuMem GPU buffers"),
    ("1.19", "1.19", {}, "warn", "the proxy refuses GPU buffers up front"),
    ("1.19", "1.19", {"FI_EFA_SET_CUDA_SYNC_MEMOPS": "0"}, "warn", "FI_MR_DMABUF needs API 1.20"),  # DMA-BUF only
    ("1.20", "1.20", {}, "ok", "the proxy registers by DMA-BUF fd (FI_MR_DMABUF)"),
    ("2.4", "1.22", {}, "ok", "libfabric 2.4 < 2.5: by address the registration would fail"),
    ("2.5", "1.22", {}, "ok", "registered by DMA-BUF fd where the driver gives one"),
])
def test_gpu_registration_floor_and_dmabuf_only_on_p5en(p5en, version, api, env, verdict, words):
    p5en["libfabric"].update(version=version, api_version=api)
    p5en["env"] = env
    c = by_name(p5en, "gpu-registration")
    assert c.verdict == verdict and words in c.detail, c
    if verdict == "warn":
        assert "1.20" in c.fix
    if version == "2.5":
        assert "DMA-BUF only" not in c.detail


def test_gpu_registration_with_a_peer_memory_module_and_without_cudart(p5):
    p5["libfabric"].update(version="1.19", api_version="1.19")
    p5["modules"]["loaded"].append("efa_nv_peermem")
    p5["env"] = {"FI_EFA_SET_CUDA_SYNC_MEMOPS": "0"}  # the floor's way out
    c = by_name(p5, "gpu-registration")
    assert c.verdict == "ok" and "peer memory (efa_nv_peermem)" in c.detail, c
    p5["cudart"] = {"name": "libcudart.so", "loadable": False, "path": None,
                    "error": "libcudart.so: cannot open shared object file"}
    c = by_name(p5, "gpu-registration")
    assert c.verdict == "warn" and "unversioned name" in c.detail and "LD_LIBRARY_PATH" in c.fix
    p5["gpus"] = []
    assert by_name(p5, "gpu-registration").verdict == "ok"  # nothing to register


def test_rdma_cm_and_an_address_on_every_connectx7_hca(cx, p5):
    c = by_name(cx, "rdma-cm")
    assert c.verdict == "ok" and "mlx5_0: 10.10.0.11" in c.detail
    cx["rdma_devices"][3]["ips"] = []
    c = by_name(cx, "rdma-cm")
    assert c.verdict == "warn" and "no IP address on mlx5_3" in c.detail and "IPoIB" in c.fix
    for d in cx["rdma_devices"]:
        d["ips"] = []
    assert by_name(cx, "rdma-cm").verdict == "fail"
    cx["rdma_cm"] = {"path": "/dev/infiniband/rdma_cm", "present": False, "ok": False}
    c = by_name(cx, "rdma-cm")
    assert c.verdict == "fail" and "rdma_cm missing" in c.detail and "rdma_ucm" in c.fix
    cx["rdma_cm"]["present"] = True
    assert "not read/writable" in by_name(cx, "rdma-cm").detail
    assert by_name(p5, "rdma-cm").verdict == "ok"  # efa needs no rdma_cm (the p5's facts have none)


@pytest.mark.parametrize("visible, verdict, words", [
    (None, "ok", "unset: the proxies see all 8 GPUs"),
    ("3", "ok", "the proxies see 1 GPU(s)"),
    ("GPU-00000000-0000-0000-0000-000000000005,1", "ok", "see 2 GPU(s)"),
    ("", "warn", "hides every GPU"),
    ("0,9", "warn", "9 not a GPU of this host"),
    ("1,1", "warn", "1 not a GPU of this host (or repeated)"),
])
def test_proxy_gpu_sees_its_gpu(p5, cx, visible, verdict, words):
    for facts in (p5, cx):
        facts["env"] = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        if facts is cx and visible and "GPU-" in visible:
            continue
        c = by_name(facts, "proxy-gpu")
        assert c.verdict == verdict and words in c.detail, c
    assert "context current before libfabric initialises CUDA" in by_name(p5, "proxy-gpu").detail or verdict == "warn"


def test_collectors_read_rdma_cm_interfaces_and_cudart(tmp_path):
    roots = _fake_host(tmp_path)
    net = Path(roots["sysfs"]) / "devices" / "pci0000:4c" / "0000:4c:01.0" / "0000:4d:00.0" / "0000:4e:00.0" / \
        "0000:4f:00.0" / "net" / "ib0"
    net.mkdir(parents=True)
    (Path(roots["proc"]) / "net").mkdir()
    (Path(roots["proc"]) / "net" / "if_inet6").write_text(
        "fe800000000000000000000000000001 02 40 20 80     ib0\n00000000000000000000000000000001 01 80 10 80       lo\n")
    [d] = doctor.rdma_device_facts(roots["sysfs"], roots["dev"], roots["proc"])
    assert d["netdevs"] == ["ib0"] and d["ips"] == ["fe80:0000:0000:0000:0000:0000:0000:0001"]
    assert doctor.rdma_cm_facts(roots["dev"]) == {"path": roots["dev"] + "/infiniband/rdma_cm", "present": False,
                                                  "ok": False}
    (Path(roots["dev"]) / "infiniband" / "rdma_cm").write_text("")
    assert doctor.rdma_cm_facts(roots["dev"])["present"] is True
    assert doctor.cudart_facts("libnot-a-cuda-runtime.so")["loadable"] is False
    assert "127.0.0.1" in doctor.interface_addresses("lo")


def test_check_refuses_unknown_verdicts():
    with pytest.raises(ValueError, match="verdict"):
        Check("x", "maybe", "detail")


# ---- the live collector over a fake tree -----------------------------------------------------------------
def _fake_host(tmp_path: Path, open_uverbs: bool = True, uverbs_node: bool = True) -> dict:
    sysfs, proc, dev = tmp_path / "sys", tmp_path / "proc", tmp_path / "dev"
    pci_dev = sysfs / "devices" / "pci0000:4c" / "0000:4c:01.0" / "0000:4d:00.0" / "0000:4e:00.0" / "0000:4f:00.0"
    (pci_dev / "driver").parent.mkdir(parents=True)
    (sysfs / "bus" / "pci" / "drivers" / "efa").mkdir(parents=True)
    os.symlink(sysfs / "bus" / "pci" / "drivers" / "efa", pci_dev / "driver")
    ib = sysfs / "class" / "infiniband" / "rdmap79s0"
    (ib / "ports" / "1").mkdir(parents=True)
    os.symlink(pci_dev, ib / "device")
    (ib / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    (ib / "ports" / "1" / "link_layer").write_text("Unknown\n")
    (sysfs / "class" / "infiniband_verbs" / "uverbs0").mkdir(parents=True)
    (sysfs / "class" / "infiniband_verbs" / "uverbs0" / "ibdev").write_text("rdmap79s0\n")
    (dev / "infiniband").mkdir(parents=True)
    if uverbs_node:  # a container started without the device has the sysfs entries but not the node
        (dev / "infiniband" / "uverbs0").write_text("")
        os.chmod(dev / "infiniband" / "uverbs0", 0o600 if open_uverbs else 0o000)
    (sysfs / "module" / "efa").mkdir(parents=True)
    (sysfs / "module" / "efa" / "version").write_text("2.17.1g\n")
    proc.mkdir()
    (proc / "modules").write_text("efa 151552 0 - Live 0x0\nib_uverbs 200704 1 efa, Live 0x0\n"
                                  "ib_core 491520 2 efa,ib_uverbs, Live 0x0\nnvidia 1 0 - Live 0x0\n")
    (proc / "kallsyms").write_text("0000000000000000 T ib_umem_get\n0000000000000000 T ib_umem_dmabuf_get\n")
    return {"sysfs": str(sysfs), "proc": str(proc), "dev": str(dev)}


def test_collectors_read_a_fake_efa_host(tmp_path):
    roots = _fake_host(tmp_path)
    [d] = doctor.rdma_device_facts(roots["sysfs"], roots["dev"])
    assert d == {"name": "rdmap79s0", "driver": "efa", "pci": "0000:4f:00.0", "state": "4: ACTIVE",
                 "link_layer": "Unknown", "uverbs": ["uverbs0"], "uverbs_ok": True, "netdevs": [], "ips": []}
    mods = doctor.module_facts(roots["proc"], roots["sysfs"])
    assert mods == {"loaded": ["efa", "ib_core", "ib_uverbs", "nvidia"], "versions": {"efa": "2.17.1g"}}
    assert doctor.kallsyms_facts(roots["proc"]) == {doctor.KSYM_PEER_MEMORY: False, doctor.KSYM_DMABUF: True}
    assert doctor.kallsyms_facts(str(tmp_path / "none")) is None
    assert doctor.rdma_device_facts(str(tmp_path / "none"), roots["dev"]) == []


def test_collector_sees_a_missing_uverbs_node(tmp_path):
    roots = _fake_host(tmp_path, uverbs_node=False)
    [d] = doctor.rdma_device_facts(roots["sysfs"], roots["dev"])
    assert d["uverbs"] == ["uverbs0"] and d["uverbs_ok"] is False


@pytest.mark.skipif(os.geteuid() == 0, reason="root opens any file: a closed device node cannot be simulated")
def test_collector_sees_a_closed_uverbs_node(tmp_path):
    roots = _fake_host(tmp_path, open_uverbs=False)
    [d] = doctor.rdma_device_facts(roots["sysfs"], roots["dev"])
    assert d["uverbs_ok"] is False


def test_collector_reads_the_efa_installer(tmp_path):
    prefix = tmp_path / "efa"
    (prefix / "lib64").mkdir(parents=True)
    (prefix / "lib64" / "libfabric.so.1").write_text("")
    manifest = tmp_path / "efa_installed_packages"
    manifest.write_text("# EFA installer version: 1.43.1\n# Debug packages installed: no\n")
    assert doctor.efa_installer_facts(str(prefix), str(manifest)) == {
        "prefix": str(prefix), "present": True, "version": "1.43.1", "libfabric": str(prefix / "lib64" / "libfabric.so.1")}
    assert doctor.efa_installer_facts(str(tmp_path / "none"), str(tmp_path / "none2"))["present"] is False


# ---- this host ------------------------------------------------------------------------------------------
def _assert_local_host(facts, checks):
    got = {c.name: c for c in checks}
    assert list(got) == NAMES
    assert got["provider tcp"].verdict == "ok" and "tcp;ofi_rxm usable" in got["provider tcp"].detail
    assert got["provider shm"].verdict == "ok" and "shm usable" in got["provider shm"].detail
    if not facts["rdma_devices"]:  # CI and the H200 machine have none
        assert got["rdma-devices"].verdict == "warn" and "runs on this host only" in got["rdma-devices"].detail
        assert got["provider efa"].verdict == got["provider verbs"].verdict == "ok"
        assert "local runs only" in got["transport"].detail


def test_this_host(monkeypatch):
    for k in [k for k in os.environ if k.startswith(("FI_", "MOE_A2A_"))]:
        monkeypatch.delenv(k)
    facts = doctor.collect_facts()
    checks = doctor.run_checks(facts)
    _assert_local_host(facts, checks)
    assert json.loads(json.dumps(facts)) == facts  # JSON-able as it is
    assert facts["libfabric"]["path"] and facts["sizes"]["host_segment_bytes"] > 0
    if not any(c.verdict == "fail" for c in checks):
        assert doctor.exit_code(checks) == 0


def test_cli_over_recorded_facts(capsys, tmp_path):
    from moe_a2a.cli import main

    assert main(["doctor", "--facts", str(P5), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 0 and doc["counts"] == {"ok": len(NAMES), "warn": 0, "fail": 0}
    assert doc["facts"]["sizes"]["world"] == 64 and doc["facts"]["source"] == f"recorded: {P5}"
    broken = json.loads(P5.read_text())
    broken["memlock"]["soft"] = 65536
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert main(["doctor", "--facts", str(tmp_path / "broken.json")]) == 1
    out = capsys.readouterr().out
    assert "  fail  memlock " in out and "fix: ulimit -l unlimited" in out and out.rstrip().endswith("(exit 1)")
    assert main(["doctor", "--facts", str(tmp_path / "missing.json")]) == 2
    assert "--facts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--world", "48"])
    assert e.value.code == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_doctor_json_command_here():
    """`moe-a2a doctor --json` as a user runs it on this CPU machine: tcp and shm ok, exit 0."""
    script = Path(sys.executable).with_name("moe-a2a")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "moe_a2a.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FI_", "MOE_A2A_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run(argv + ["doctor", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    doc = json.loads(r.stdout)
    assert set(doc) == {"schema", "exit_code", "summary", "counts", "checks", "facts"}
    assert r.returncode == doc["exit_code"] == (1 if doc["counts"]["fail"] else 0), r.stderr
    for c in doc["checks"]:
        assert set(c) == {"name", "verdict", "detail", "fix"} and c["verdict"] in doctor.VERDICTS, c
    assert sum(doc["counts"].values()) == len(doc["checks"])
    checks = [Check(**c) for c in doc["checks"]]
    _assert_local_host(doc["facts"], checks)
    if not doc["facts"]["rdma_devices"]:
        assert r.returncode == 0 and "runs on this host only" in doc["summary"]
