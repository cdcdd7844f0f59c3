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
