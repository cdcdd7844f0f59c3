"""proxy.topology: each rank of a node gets its own NICs, all NICs are used, none twice; each proxy gets
the CPU MOE_A2A_PROXY_CPUS names, else a core of its own near its GPU, else (CPU runs) none."""
import os
import types

import pytest
from hypothesis import given, strategies as st

from moe_a2a.proxy import topology
from moe_a2a.proxy.topology import choose_proxy_cpus, nics_for_rank, parse_proxy_cpus


def test_p5_like_node_gives_each_gpu_four_nics_in_order():
    nics = [f"rdmap{i}-rdm" for i in range(32)]
    assert nics_for_rank(nics, 0, 8) == nics[:4] and nics_for_rank(nics, 7, 8) == nics[28:]


@given(n_nics=st.integers(1, 40), ranks=st.integers(1, 16))
def test_shares_are_disjoint_equal_and_cover_what_divides(n_nics, ranks):
    nics = [f"nic{i}" for i in range(n_nics)]
    shares = [nics_for_rank(nics, r, ranks) for r in range(ranks)]
    assert all(len(s) == len(shares[0]) >= 1 for s in shares)
    if n_nics >= ranks:  # each NIC used by at most one rank; only the remainder is left idle
        flat = [x for s in shares for x in s]
        assert len(flat) == len(set(flat)) == n_nics // ranks * ranks
    else:  # fewer NICs than ranks: shared round-robin, every NIC used
        assert {s[0] for s in shares} == set(nics)


def test_bad_arguments():
    with pytest.raises(ValueError, match="no NIC"):
        nics_for_rank([], 0, 1)
    with pytest.raises(ValueError, match="outside"):
        nics_for_rank(["a"], 2, 2)


# ---- proxy placement -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, cpus", [("3", [3]), ("2-5", [2, 3, 4, 5]), ("0,4,8", [0, 4, 8]),
                                        (" 8-9 , 0 ", [0, 8, 9]), ("4,4-5", [4, 5])])
def test_override_cpu_lists(text, cpus):
    assert parse_proxy_cpus(text, allowed=range(16)) == cpus


def test_override_none_means_not_pinned():
    assert parse_proxy_cpus("none") is None and parse_proxy_cpus(" None ") is None
    assert choose_proxy_cpus(0, 0, 0, 1, "none") == ([], "not pinned: MOE_A2A_PROXY_CPUS='none'")


@pytest.mark.parametrize("text", ["", "a", "3-1", "1,,2", "-1", "0-", "1:2", "0-3:2", "x,1"])
def test_malformed_override_names_the_variable(text):
    with pytest.raises(ValueError, match="MOE_A2A_PROXY_CPUS=.*expected a cpu list"):
        parse_proxy_cpus(text, allowed=range(16))


def test_override_outside_the_affinity_is_refused():
    with pytest.raises(ValueError, match=r"MOE_A2A_PROXY_CPUS='3,5-7': CPUs 3,5-7 are outside .*\(0-2,4\)"):
        parse_proxy_cpus("3,5-7", allowed={0, 1, 2, 4})
    with pytest.raises(ValueError, match="CPUs 4-1000000000000 are outside"):  # never expanded
        parse_proxy_cpus("0-1000000000000", allowed=range(4))
    mine = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="MOE_A2A_PROXY_CPUS"):  # default: this process's affinity
        parse_proxy_cpus(str(max(mine) + 1))
    assert parse_proxy_cpus(str(max(mine))) == [max(mine)]


def test_override_wins_over_the_gpu(monkeypatch):
    monkeypatch.setattr(topology, "_load_nvml", lambda: pytest.fail("NVML asked despite the override"))
    cpu = min(os.sched_getaffinity(0))
    cpus, reason = choose_proxy_cpus(0, 3, 1, 2, str(cpu))
    assert cpus == [cpu] and reason == f"pinned to CPUs {cpu} by MOE_A2A_PROXY_CPUS='{cpu}'"


def test_cpu_run_is_not_pinned(monkeypatch):
    monkeypatch.setattr(topology, "_load_nvml", lambda: pytest.fail("NVML asked on a CPU run"))
    assert choose_proxy_cpus(None, 0, 0, 1, None) == ([], "not pinned: no GPU (CPU run)")


class FakeNVML:
    """pynvml's calls that topology uses; GPU g is near CPUs 16 g .. 16 g + 15 of a 64-CPU host (with
    `one_numa`: every GPU near CPUs 0-15)."""

    def __init__(self, fail: str | None = None, one_numa: bool = False) -> None:
        self.fail, self.one_numa, self.open = fail, one_numa, 0

    def _maybe_fail(self, name):
        if self.fail == name:
            raise RuntimeError(f"fake NVML error in {name}")

    def nvmlInit(self):
        self._maybe_fail("nvmlInit")
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return types.SimpleNamespace(index=i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return types.SimpleNamespace(index=int(uuid.removeprefix("GPU-fake-")))

    def nvmlDeviceGetIndex(self, h):
        return h.index

    def nvmlDeviceGetCpuAffinity(self, h, words):
        self._maybe_fail("nvmlDeviceGetCpuAffinity")
        assert words >= 1
        mask = [0] * words
        mask[0] = 0xFFFF << (0 if self.one_numa else 16 * h.index)
        return mask


@pytest.mark.parametrize("one_numa", [False, True], ids=["numa-per-gpu", "one-numa"])
@pytest.mark.parametrize("ranks_per_gpu", [1, 2])
def test_each_proxy_gets_one_core_near_its_gpu_and_a_core_of_its_own(monkeypatch, one_numa, ranks_per_gpu):
    nvml = FakeNVML(one_numa=one_numa)
    monkeypatch.setattr(topology, "_load_nvml", lambda: nvml)
    allowed = set(range(64)) - {31}  # CPU 31 is near GPU 1 but not ours: never chosen
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(allowed))
    chosen = {}
    for rank in range(4 if one_numa else 4 * ranks_per_gpu):  # 8 proxies on 16 CPUs; else 2-4 near each GPU
        gpu = rank // ranks_per_gpu
        for shard in range(2):
            cpus, reason = choose_proxy_cpus(gpu, rank, shard, 2, None)
            near = range(16) if one_numa else range(16 * gpu, 16 * gpu + 16)
            assert len(cpus) == 1 and cpus[0] in allowed and cpus[0] in near, (rank, reason)
            assert reason.startswith(f"pinned to CPU {cpus[0]}: near GPU {gpu}"), reason
            chosen[rank, shard] = cpus[0]
    assert len(set(chosen.values())) == len(chosen), chosen  # every proxy of the host a core of its own
    assert chosen[0, 0] == 15 and chosen[0, 1] == 14  # from the high end of the GPU's CPUs
    assert nvml.open == 0  # every nvmlInit shut down


def test_the_gpu_uuid_finds_the_gpu_whatever_the_cuda_ordinal(monkeypatch):
    monkeypatch.setattr(topology, "_load_nvml", FakeNVML)
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(range(64)))
    # CUDA_VISIBLE_DEVICES=2: the rank's GPU is CUDA ordinal 0 but NVML's GPU 2 (CPUs 32-47)
    cpus, reason = choose_proxy_cpus(0, 0, 0, 1, None, gpu_uuid="GPU-fake-2")
    assert cpus == [47] and "near GPU 2" in reason, reason


def test_gpu_whose_cpus_are_all_outside_the_affinity_is_not_pinned(monkeypatch):
    monkeypatch.setattr(topology, "_load_nvml", FakeNVML)
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: {0, 1})
    cpus, reason = choose_proxy_cpus(1, 1, 0, 1, None)
    assert cpus == [] and reason.startswith("not pinned: GPU 1's CPUs (16-31) are outside"), reason


@pytest.mark.parametrize("fail", ["import", "nvmlInit", "nvmlDeviceGetCpuAffinity"])
def test_nvml_problems_never_raise(monkeypatch, fail):
    nvml = FakeNVML(fail)

    def load():
        if fail == "import":
            raise ImportError("No module named 'pynvml'")
        return nvml

    monkeypatch.setattr(topology, "_load_nvml", load)
    cpus, reason = choose_proxy_cpus(0, 0, 0, 1, None)
    assert cpus == [] and reason.startswith("not pinned: NVML unavailable: "), reason
    assert ("pynvml" if fail == "import" else f"fake NVML error in {fail}") in reason
    assert nvml.open == 0


def test_malformed_override_is_refused_in_the_model_process_before_any_proxy(monkeypatch):
    from moe_a2a.runtime import wiring

    monkeypatch.setenv("MOE_A2A_PROXY_CPUS", "0-")
    monkeypatch.setattr(wiring.placements, "choose", lambda *a: pytest.fail("went past the check"))
    layout = types.SimpleNamespace(node_size=1, world_size=2)
    with pytest.raises(ValueError, match="MOE_A2A_PROXY_CPUS='0-'"):
        wiring.Wiring(layout, None, 0, None, "tcp", None, 1, "auto", "auto", 10.0, True)


def _proxy_cpus(a2a, rank):
    tasks = [[sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{h.proc.pid}/task")]
             for h in a2a.proxies]
    return a2a.proxy_cpus, tasks


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_proxy_runs_on_the_cpu_the_override_names(monkeypatch):
    import torch

    from moe_a2a import LocalCluster
    from moe_a2a.config import A2AConfig

    from ..conftest import TEST_DEVICE

    cpu = max(os.sched_getaffinity(0))
    monkeypatch.setenv("MOE_A2A_PROXY_CPUS", str(cpu))  # the ranks inherit it, their proxies get it in the spec
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8, in_dtype=torch.float32)
    with LocalCluster(cfg, world_size=2, node_size=1, transport="tcp", device=TEST_DEVICE, timeout_s=30) as cl:
        for placed, tasks in cl.run(_proxy_cpus):
            assert placed == [(0, [cpu], f"pinned to CPUs {cpu} by MOE_A2A_PROXY_CPUS='{cpu}'")]
            assert tasks and all(t == [cpu] for t in tasks[0])  # every thread of the proxy, libfabric's too


# ---- NICs by PCIe topology (plan_nics and what feeds it) --------------------------------------------
# Synthetic hosts: per PCIe switch, a root port, the switch's upstream port and one downstream port per
# device, NICs first on the bus then GPUs, as lstopo shows a p5en (aws-ofi-nccl's test fixture).
Device = topology.Device


def _pci(bus: int, dev: int = 0) -> str:
    return f"0000:{bus:02x}:{dev:02x}.0"


def efa_host(switches: int, gpus_per_switch: int, nics_per_switch: int):
    """(GPUs in NVML order, NICs in PCI order); switch s on NUMA node s * 2 // switches."""
    gpus, nics = [], []
    for s in range(switches):
        base = 0x10 + 0x10 * s
        rp, up, numa = _pci(base), _pci(base + 1), s * 2 // switches
        for k in range(nics_per_switch + gpus_per_switch):
            bus, chain = base + 3 + k, (rp, up, _pci(base + 2, k))
            if k < nics_per_switch:
                nics.append(Device(f"rdmap{bus}s0-rdm", _pci(bus), chain, numa))
            else:
                gpus.append(Device(str(len(gpus)), _pci(bus), chain, numa, f"GPU-{len(gpus):04d}-fake"))
    return gpus, nics


def names_of(plan):
    return [list(names) for names, _, _ in plan]


@pytest.mark.parametrize("host, switches, gpus_per_switch, nics_per_switch, each", [
    ("p5", 8, 1, 4, 4), ("p5en", 4, 2, 4, 2), ("p6-b200", 4, 2, 2, 1)])
def test_efa_hosts_give_each_gpu_the_nics_of_its_switch(host, switches, gpus_per_switch, nics_per_switch, each):
    gpus, nics = efa_host(switches, gpus_per_switch, nics_per_switch)
    # listed in reverse PCI order: the listing order must not matter (today's rule gave GPU 0 the last NICs)
    plan = topology.plan_nics(gpus, nics[::-1])
    for g, (names, rule, reason) in enumerate(plan):
        s, j = divmod(g, gpus_per_switch)
        first = s * nics_per_switch + j * each
        assert list(names) == [n.name for n in nics[first:first + each]], (host, g, reason)
        assert rule == "switch" and f"GPU {g} ({gpus[g].pci})" in reason and f"{each} each" in reason
    assert len({n for names, _, _ in plan for n in names}) == len(nics)  # every NIC used, none twice


def connectx_node():
    """8 GPUs, 8 mlx5 NICs: per root port a switch with two sub-switches, each a GPU and its NIC, the NIC of
    the first sub-switch on a higher bus than the second's (PCI order is not tree order), the NICs named
    in neither order; mlx5_8/9 (storage, frontend) on a root port without a GPU."""
    gpus, nics = [], []
    for s in range(4):
        base = 0x20 + 0x20 * s
        for j in range(2):
            sub = (_pci(base), _pci(base + 1), _pci(base + 2, j), _pci(base + 3 + 4 * j))
            gpu_bus, nic_bus = base + 6 + 4 * j, base + 0xC - 4 * j
            gpus.append(Device(str(2 * s + j), _pci(gpu_bus), sub + (_pci(gpu_bus - 1),), s // 2))
            nics.append(Device(f"mlx5_{2 * s + 1 - j}", _pci(nic_bus), sub + (_pci(nic_bus - 1),), s // 2))
    nics += [Device(f"mlx5_{8 + k}", _pci(0xF0 + k), (_pci(0xE0 + k),), k) for k in range(2)]
    return gpus, sorted(nics, key=lambda n: int(n.name[5:]))  # verbs lists them by name


def test_connectx_node_pairs_each_gpu_with_the_nic_of_its_own_sub_switch():
    gpus, nics = connectx_node()
    plan = topology.plan_nics(gpus, nics)
    assert names_of(plan) == [[f"mlx5_{g + 1 - 2 * (g % 2)}"] for g in range(8)]  # GPU 0: mlx5_1, GPU 1: mlx5_0...
    assert all(rule == "switch" for _, rule, _ in plan)
    # by PCI order inside the switch (or by listing order) GPU 0 would get mlx5_0, the other sub-switch's NIC
    assert topology.nics_for_rank([n.name for n in nics], 0, 8) == ["mlx5_0"]


@given(switches=st.integers(1, 4), gps=st.integers(1, 4), nps=st.integers(0, 9), reverse=st.booleans())
def test_switch_shares_are_equal_disjoint_and_stay_under_the_switch(switches, gps, nps, reverse):
    gpus, nics = efa_host(switches, gps, nps)
    by_name = {n.name: n for n in nics}
    plan = topology.plan_nics(gpus, (nics[::-1] if reverse else nics) + [Device("far-nic")])
    for g, (names, rule, _) in enumerate(plan):
        if nps == 0:  # nothing under any switch, nothing on the NUMA node: listing order
            assert rule == "round-robin" and names == ("far-nic",)
            continue
        assert rule == "switch" and len(names) == max(1, nps // gps)
        assert all(by_name[n].bridges[0] == gpus[g].bridges[0] for n in names)  # under its own switch
    if nps >= gps:
        used = [n for names, _, _ in plan for n in names]
        assert len(used) == len(set(used)) == switches * gps * (nps // gps)


def test_fewer_nics_than_gpus_under_a_switch_are_shared_by_neighbours():
    gpus, nics = efa_host(2, 4, 2)
    plan = topology.plan_nics(gpus, nics)
    assert names_of(plan) == [[nics[0].name]] * 2 + [[nics[1].name]] * 2 + [[nics[2].name]] * 2 + [[nics[3].name]] * 2
    assert "shared" in plan[0][2]


def test_no_nic_under_the_switch_falls_back_to_the_numa_node_then_to_round_robin():
    # GPUs 0-3 with a NIC each under their switch; GPUs 4-7 on NUMA node 1 with none: the two NICs of node 1
    # on a root port of their own are shared; node 0's spare NIC is not theirs; GPU 8 (NUMA unknown): what is left
    gpus, nics = efa_host(4, 1, 1)
    gpus = [Device(g.name, g.pci, g.bridges, 0, g.uuid) for g in gpus]
    nics = [Device(n.name, n.pci, n.bridges, 0) for n in nics]
    gpus += [Device(str(4 + k), _pci(0xA0 + k), (_pci(0x90 + k),), 1) for k in range(4)] + [Device("8")]
    spare = [Device("node0-spare", _pci(0xD0), (_pci(0xC0),), 0)]
    numa1 = [Device(f"node1-{k}", _pci(0xB0 + k), (_pci(0xB8 + k),), 1) for k in range(2)]
    plan = topology.plan_nics(gpus, spare + numa1[::-1] + nics)
    assert [rule for _, rule, _ in plan] == ["switch"] * 4 + ["numa"] * 4 + ["round-robin"]
    assert names_of(plan)[:4] == [[n.name] for n in nics]
    assert names_of(plan)[4:8] == [["node1-0"], ["node1-1"], ["node1-0"], ["node1-1"]]
    assert names_of(plan)[8] == ["node0-spare"]  # round robin over what no rule gave away
    assert "NUMA node 1 shared by 4 GPU(s)" in plan[4][2] and "topology unknown" in plan[8][2]


def test_without_sysfs_or_numa_the_gpus_share_the_nics_in_listing_order():
    gpus = [Device(str(g), uuid=f"GPU-{g}") for g in range(8)]
    nics = [Device(f"rdmap{k}s0-rdm") for k in range(16)]
    plan = topology.plan_nics(gpus, nics)
    assert names_of(plan) == [[f"rdmap{2 * g}s0-rdm", f"rdmap{2 * g + 1}s0-rdm"] for g in range(8)]
    assert {rule for _, rule, _ in plan} == {"round-robin"}


def test_an_unknown_gpu_gets_todays_share_by_local_rank():
    gpus, nics = efa_host(8, 1, 4)
    choice = topology.assign_nics(gpus, nics, None, 3, 8, "no GPU (CPU run)")
    assert choice == tuple(n.name for n in nics[12:16]) and choice.rule == "round-robin"
    assert choice.reason.startswith("no GPU (CPU run): local rank 3 of 8")
    picked = topology.assign_nics(gpus, nics[::-1], 3, 0, 8)  # the GPU known: its switch, whatever the rank
    assert picked == tuple(n.name for n in nics[12:16]) and picked.rule == "switch"
    with pytest.raises(ValueError, match="no NIC"):
        topology.plan_nics(gpus, [])


def test_a_choice_is_a_tuple_that_pickles_as_a_plain_one():
    import pickle

    choice = topology.NicChoice(["a", "b"], "switch", "why")
    assert choice == ("a", "b") and choice[1::2] == ("b",) and (choice.rule, choice.reason) == ("switch", "why")
    back = pickle.loads(pickle.dumps(choice))
    assert type(back) is tuple and back == ("a", "b")  # the proxy's spec needs no topology class


@pytest.mark.parametrize("visible, ordinal, expected", [
    (None, 3, 3), ("2,3", 0, 2), ("2,3", 1, 3), ("2,3", 2, None), (" 5 , 1", 1, 1),
    ("GPU-0006-fake,GPU-0001-fake", 0, 6), ("GPU-0006-fake,GPU-0001-fake", 1, 1),
    ("gpu-0007", 0, 7),  # a unique prefix, any case
    ("GPU-000", 0, None),  # ambiguous prefix: the list ends there
    ("1,9,2", 1, None), ("1,x,2", 1, None), ("1,1", 1, None), ("MIG-abc", 0, None), ("", 0, None), ("4", -1, None)])
def test_cuda_visible_devices_maps_a_cuda_ordinal_to_an_nvml_gpu(visible, ordinal, expected):
    gpus, _ = efa_host(4, 2, 4)
    assert topology.visible_gpu(ordinal, visible, gpus) == expected


def test_a_rank_on_a_gpu_renumbered_by_cuda_visible_devices_gets_that_gpus_nics():
    gpus, nics = efa_host(4, 2, 4)  # p5en
    nvml_gpu = topology.visible_gpu(1, "2,3", gpus)  # CUDA device 1 of "2,3" is NVML's GPU 3
    choice = topology.assign_nics(gpus, nics, nvml_gpu, 1, 2)
    assert choice == tuple(n.name for n in nics[6:8])  # second GPU of the second switch: its last two NICs


@pytest.mark.parametrize("path, expected", [
    ("/sys/devices/pci0000:76/0000:76:00.0/0000:77:00.0/0000:78:02.2/0000:8b:00.0",
     ("0000:8b:00.0", ("0000:76:00.0", "0000:77:00.0", "0000:78:02.2"))),
    ("/sys/devices/pci0000:00/0000:00:04.0", ("0000:00:04.0", ())),  # on the host bridge: no switch
    ("/sys/devices/pci0000:00/0000:00:0e.0/pci10000:e0/10000:e0:06.0/10000:e1:00.0",  # behind a VMD domain
     ("10000:e1:00.0", ("0000:00:0e.0", "10000:e0:06.0"))),
    ("/sys/bus/pci/devices/0000:8b:00.0", (None, None)),  # the link did not resolve
    ("/sys/devices/pci0000:00", (None, None))])
def test_sysfs_paths_give_the_bridges_above_a_device(path, expected):
    assert topology.parse_sysfs_path(path) == expected


def test_pci_addresses_are_normalised():
    assert topology.normalize_pci("00000000:4F:00.0") == "0000:4f:00.0"
    assert topology.normalize_pci(b"00000000:8B:1F.3") == "0000:8b:1f.3"
    assert topology.normalize_pci("0000:8b:00.0") == "0000:8b:00.0"


def fake_sysfs(root, devices, rdma=()):
    """/sys/bus/pci/devices/<addr> -> /sys/devices/pci<host>/<bridges...>/<addr> with numa_node, for each
    device; `rdma`: (RDMA device name, PCI address) pairs under /sys/class/infiniband."""
    for d in devices:
        top = (d.bridges or (d.pci,))[0]
        real = root.joinpath("devices", f"pci{top[:7]}", *d.bridges, d.pci)
        real.mkdir(parents=True, exist_ok=True)
        (real / "numa_node").write_text(f"{-1 if d.numa is None else d.numa}\n")
        link = root / "bus" / "pci" / "devices" / d.pci
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(real)
    for name, pci in rdma:
        (root / "class" / "infiniband" / name).mkdir(parents=True)
        (root / "class" / "infiniband" / name / "device").symlink_to(root / "bus" / "pci" / "devices" / pci)


def test_read_pci_device_from_sysfs(tmp_path):
    gpus, nics = efa_host(1, 1, 1)
    no_numa = Device("x", _pci(0x60), (_pci(0x50),), None)
    fake_sysfs(tmp_path, gpus + nics + [no_numa])
    assert topology.read_pci_device("00000000:14:00.0", "0", str(tmp_path), "GPU-u") == \
        Device("0", "0000:14:00.0", (_pci(0x10), _pci(0x11), _pci(0x12, 1)), 0, "GPU-u")
    assert topology.read_pci_device(_pci(0x60), "x", str(tmp_path)) == no_numa  # numa_node -1: unknown
    assert topology.read_pci_device(_pci(0x70), "y", str(tmp_path)) == Device("y", _pci(0x70))  # not in sysfs


class TopoNVML:
    """pynvml's calls `describe_gpus` makes, over synthetic GPUs (NVML's busId form)."""

    def __init__(self, gpus):
        self.gpus, self.open = gpus, 0

    def nvmlInit(self):
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h):
        return h.uuid.encode()  # older pynvml: bytes

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=("0000" + h.pci).upper().encode())


def test_choose_nics_reads_libfabric_nvml_and_sysfs(monkeypatch, tmp_path):
    """The whole path with fakes at its edges: p5en's 16 NICs from fi_info (two without a PCI address,
    found through /sys/class/infiniband as EFA names them), 8 GPUs from NVML, the tree from a fake sysfs."""
    gpus, nics = efa_host(4, 2, 4)
    fake_sysfs(tmp_path, gpus + nics, rdma=[(nics[k].name.removesuffix("-rdm"), nics[k].pci) for k in (6, 7)])
    listed = [(n.name, None if k in (6, 7) else n.pci) for k, n in enumerate(nics)][::-1]
    monkeypatch.setattr(topology.lf, "list_domain_nics", lambda provider: listed if provider == "efa" else [])
    nvml = TopoNVML(gpus)
    monkeypatch.setattr(topology, "_load_nvml", lambda: nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    expect = tuple(n.name for n in nics[6:8])
    by_ordinal = topology.choose_nics("efa", 1, 2, gpu_ordinal=1, sysfs=str(tmp_path))
    assert by_ordinal == expect and by_ordinal.rule == "switch", by_ordinal.reason
    by_uuid = topology.choose_nics("efa", 0, 8, gpu_ordinal=0, gpu_uuid=gpus[3].uuid, sysfs=str(tmp_path))
    assert by_uuid == expect  # the UUID wins over the ordinal (0 would be NVML's GPU 2 here)
    assert nvml.open == 0
    # the same host without its sysfs tree: every GPU known, nothing about where: round robin by GPU
    bare = topology.choose_nics("efa", 1, 2, gpu_ordinal=1, sysfs=str(tmp_path / "none"))
    assert bare.rule == "round-robin" and bare == tuple(n for n, _ in listed[6:8])


def test_choose_nics_without_a_gpu_or_nvml_is_todays_rule(monkeypatch, tmp_path):
    _, nics = efa_host(8, 1, 4)
    monkeypatch.setattr(topology.lf, "list_domain_nics", lambda provider: [(n.name, n.pci) for n in nics])
    monkeypatch.setattr(topology, "_load_nvml", lambda: pytest.fail("NVML asked on a CPU run"))
    cpu = topology.choose_nics("efa", 5, 8, sysfs=str(tmp_path))
    assert cpu == tuple(n.name for n in nics[20:24]) and cpu.reason.startswith("no GPU (CPU run)")

    def broken():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(topology, "_load_nvml", broken)
    gpu = topology.choose_nics("efa", 5, 8, gpu_ordinal=0, sysfs=str(tmp_path))
    assert gpu == cpu and "NVML unavailable: ImportError" in gpu.reason


def test_domains_of_this_machine_have_no_pci_address_and_keep_their_order():
    from moe_a2a.proxy import libfabric as lf

    for provider in ("tcp", "shm"):
        listed = lf.list_domain_nics(provider)
        assert [name for name, _ in listed] == lf.list_domains(provider)
        assert all(pci is None for _, pci in listed)


def test_nic_pci_address_reads_fid_nic():
    import ctypes

    from moe_a2a.proxy import libfabric as lf

    bus = lf.fi_bus_attr(bus_type=lf.FI_BUS_PCI)
    bus.attr.pci = lf.fi_pci_attr(domain_id=0x1A, bus_id=0x8B, device_id=0x1F, function_id=3)
    nic = lf.fid_nic(bus_attr=ctypes.pointer(bus))
    assert lf.nic_pci_address(ctypes.addressof(nic)) == "001a:8b:1f.3"
    bus.bus_type = lf.FI_BUS_UNSPEC
    assert lf.nic_pci_address(ctypes.addressof(nic)) is None
    assert lf.nic_pci_address(ctypes.addressof(lf.fid_nic())) is None and lf.nic_pci_address(None) is None


def test_wiring_asks_the_topology_only_for_efa_and_verbs(monkeypatch):
    from moe_a2a.runtime import wiring

    layout = types.SimpleNamespace(node_size=4)
    monkeypatch.setattr(wiring.topology, "choose_nics", lambda *a: pytest.fail(f"topology asked: {a}"))
    for transport in ("tcp", "shm", "emulated"):  # as today: the provider's first domain
        assert wiring.choose_nics("auto", transport, 5, layout) is None
    assert wiring.choose_nics(["eth0", "lo"], "efa", 5, layout) == ("eth0", "lo")
    calls = []

    def record(*args):
        calls.append(args)
        return topology.NicChoice(["n1"], "numa", "because")

    monkeypatch.setattr(wiring.topology, "choose_nics", record)
    for transport in ("efa", "verbs"):
        got = wiring.choose_nics("auto", transport, 5, layout, device="cpu")
        assert got == ("n1",) and got.rule == "numa"
    assert calls == [("efa", 1, 4, None, None), ("verbs", 1, 4, None, None)]


def test_proxies_auto_is_one_per_efa_nic_and_under_the_relay_not_capped_by_the_rail():
    """`wiring.choose_proxies`: "auto" is one proxy per NIC on EFA, capped by the wire peers (a proxy needs a share
    of them), except under the relay, whose few rail writes go in a piece per proxy: EP16 as 2 nodes of 8 has one
    rail peer a rank and still gets both NICs' proxies. Elsewhere 1; an explicit count past the cap is refused."""
    from moe_a2a.runtime import wiring

    nics = ("rdmap0", "rdmap1")
    assert wiring.choose_proxies("auto", "efa", nics, 8) == 2
    assert wiring.choose_proxies("auto", "efa", nics, 1) == 1                 # one remote peer: one proxy
    assert wiring.choose_proxies("auto", "efa", nics, 1, pieces=True) == 2    # the relay: a piece per NIC
    assert wiring.choose_proxies("auto", "efa", nics, 0, pieces=True) == 1    # one node: nothing on the wire
    for transport in ("tcp", "shm", "emulated"):
        assert wiring.choose_proxies("auto", transport, None, 8, pieces=True) == 1
    assert wiring.choose_proxies(3, "shm", None, 1, pieces=True) == 3
    with pytest.raises(ValueError, match="more proxies than remote peers"):
        wiring.choose_proxies(3, "shm", None, 1)
