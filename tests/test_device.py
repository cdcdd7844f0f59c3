"""A device is normalised once where it is taken (AllToAll, the DeepEP facade's Buffer, LocalCluster, the CLI),
or refused there: "cuda" is the current CUDA device, "cpu:0" is "cpu", so tensors (which report `cpu` and
`cuda:N`) match it (issue 31: `AllToAll(device="cuda")` refused every tensor on cuda:0, and
`AllToAll(device="cpu:0")` refused its own `empty_dispatch_outputs()`)."""
from __future__ import annotations

import pytest
import torch

from moe_a2a import LocalCluster
from moe_a2a.all_to_all import canonical_device
from moe_a2a.config import A2AConfig
from moe_a2a.local import cluster_device
from .conftest import interpreter_only


@pytest.mark.parametrize("given", ["cpu", "cpu:0", "cpu:3", torch.device("cpu"), torch.device("cpu", 0)])
def test_every_cpu_spelling_is_cpu(given):
    assert canonical_device(given) == torch.device("cpu") and canonical_device(given).index is None
    assert cluster_device(given) == "cpu"


def test_cuda_is_the_current_cuda_device(monkeypatch):
    """The CUDA branch, without a GPU: torch.cuda's answers replaced (2 devices, the current one 1)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for given in ("cuda", torch.device("cuda"), None):
        assert canonical_device(given) == torch.device("cuda", 1), given
    for given in ("cuda:0", torch.device("cuda", 0), 0):
        assert canonical_device(given) == torch.device("cuda", 0), given
    with pytest.raises(ValueError, match="sees 2 CUDA device"):
        canonical_device("cuda:2")
    assert cluster_device("cuda") == cluster_device(torch.device("cuda")) == "cuda"
    with pytest.raises(ValueError, match="rank i on GPU i % num_gpus"):
        cluster_device("cuda:1")


def test_cuda_without_cuda_and_other_devices_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert canonical_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match="needs CUDA"):
        canonical_device("cuda")
    for bad in ("meta", "tpu", "gpu", "", True, 1.5, [0]):
        with pytest.raises(ValueError, match="device"):
            canonical_device(bad)
        with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
            cluster_device(bad)


def test_cli_demo_device_spellings():
    from moe_a2a.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["demo", "--device", "cpu:0"]).device == "cpu"
    assert parse(["demo", "--device", "CPU"]).device == "cpu"
    assert parse(["demo", "--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        parse(["demo", "--device", "cuda:1"])


CFG = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=32, in_dtype=torch.bfloat16)


def _cpu0_instances(a2a, rank):
    """An AllToAll and a facade Buffer built with device "cpu:0" / torch.device("cpu", 0): each takes its
    own outputs and the model's CPU tensors (one call each)."""
    from moe_a2a.all_to_all import AllToAll
    from moe_a2a.bench.demo import make_inputs
    from moe_a2a.compat import Buffer
    from moe_a2a.oracle import fill_sentinel, record_call, toy_expert

    from .compat.test_deep_ep import _inputs

    with AllToAll(a2a.cfg, node_group=a2a.layout.node_size, transport="shm", device="cpu:0", timeout_s=20) as mine:
        num, ex, exs = mine.empty_dispatch_outputs()
        x, xs, idx, w = make_inputs(mine.cfg, rank, mine.cfg.max_num_tokens, 5)
        fill_sentinel(ex, exs)
        mine.dispatch(num, ex, exs, x, xs, idx)
        res = torch.zeros(x.shape[0], mine.cfg.hidden_dim, dtype=mine.cfg.out_dtype)
        mine.combine(res, idx, w, toy_expert(ex, exs, mine.cfg))
        call = record_call(mine.cfg, x, xs, idx, w, num, ex, exs, res)
        device = str(mine.device)
    with Buffer(transport="shm", timeout_s=20.0, node_group=a2a.layout.node_size, device=torch.device("cpu", 0)) as buf:
        bx, bidx, bw = _inputs(rank, 9, 4, "random")
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(bx, bidx, 4, 8, use_fp8=False)
        combined, _, _ = buf.low_latency_combine((2 * recv_x.float()).to(torch.bfloat16), bidx, bw, handle)
        facade = {"device": str(buf._slots[0].a2a.device), "count": count.clone(), "combined": combined.clone()}
    return device, call, facade


@interpreter_only("its ranks run on the CPU (--device cpu / device='cpu')")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu0_cluster_all_to_all_and_buffer_work_against_the_oracle():
    from moe_a2a import reference
    from moe_a2a.oracle import check_against_reference, combine_problems, default_max_ulps

    from .compat.test_deep_ep import E, K, H, T_MAX, _inputs

    with LocalCluster(CFG, world_size=2, node_size=2, transport="shm", device=torch.device("cpu", 0),
                      timeout_s=60) as cl:
        assert cl.device == "cpu"
        got = cl.run(_cpu0_instances)
    assert [g[0] for g in got] == ["cpu", "cpu"], [g[0] for g in got]
    assert check_against_reference(CFG, [{"calls": [g[1]]} for g in got]) == []
    assert all(g[2]["device"] == "cpu" for g in got)
    cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                    expert_capacity=2 * T_MAX)
    ins = [_inputs(r, 9, T_MAX, "random") for r in range(2)]
    want = reference.dispatch(cfg, [x for x, _, _ in ins], None, [i for _, i, _ in ins])
    outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins],
                             [(2 * x_ref.float()).to(torch.bfloat16) for _, x_ref, _ in want])
    for r in range(2):
        assert torch.equal(got[r][2]["count"], want[r][0]), r
        assert combine_problems(got[r][2]["combined"], outs[r], default_max_ulps("cpu")) == [], r


def test_internal_checks_read_cuda_as_the_current_device(monkeypatch):
    """The tensor checks below the API (runtime/checks.py, the launchers' `_checks.tensor`) take "cuda" and
    "cpu:0" as `canonical_device` does (issue 42: `check_dispatch_outputs` given `torch.device("cuda")`
    refused tensors on cuda:0), and never raise on a device string they cannot parse."""
    from moe_a2a.runtime.checks import check_tensor
    from moe_a2a.triton_kernels import _checks

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    same = _checks.same_device
    assert same(torch.device("cuda", 1), torch.device("cuda")) and same(torch.device("cuda", 1), "cuda")
    assert not same(torch.device("cuda", 0), "cuda") and not same(torch.device("cuda", 0), "cuda:1")
    assert same(torch.device("cpu"), "cpu:0") and same(torch.device("cpu"), torch.device("cpu", 0))
    assert not same(torch.device("cpu"), "cuda") and not same(torch.device("cpu"), "not a device")
    t = torch.zeros(2, 3)
    check_tensor("x", t, (2, 3), torch.float32, torch.device("cpu", 0))
    _checks.tensor("x", t, dtypes=(torch.float32,), shape=(2, 3), device=torch.device("cpu", 0))
    with pytest.raises(ValueError, match="x: expected device cuda, got cpu"):
        check_tensor("x", t, (2, 3), torch.float32, torch.device("cuda"))
