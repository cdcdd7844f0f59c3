"""Ranks built with different configurations are refused at bootstrap, on every rank, before any buffer
exists (`moe_a2a.fingerprint`): each mismatch between real processes (a plain gloo group: LocalCluster
gives every rank the same configuration), over shm and tcp; no process crashes, and the group stays
usable (a matching AllToAll built afterwards gives exact results)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_a2a import fingerprint
from moe_a2a.config import A2AConfig
from .conftest import interpreter_only

BASE = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=64, in_dtype=torch.bfloat16)

# (what differs, rank 0's change, rank 1's change): config fields as A2AConfig arguments, the rest as
# AllToAll arguments. Rank 1 keeps the base value unless it says otherwise.
MISMATCHES = [
    ("max_num_tokens", {"max_num_tokens": 8}, {}),
    ("num_experts", {"num_experts": 4}, {}),
    ("experts_per_token", {"experts_per_token": 3}, {}),
    ("hidden_dim", {}, {"hidden_dim": 128}),
    ("in_dtype", {"in_dtype": torch.float32}, {}),
    ("scale_block", {"in_dtype": torch.float8_e4m3fn, "scale_block": 16},
     {"in_dtype": torch.float8_e4m3fn, "scale_block": 32}),
    ("out_dtype", {"out_dtype": torch.float32}, {}),
    ("expert_padding", {"expert_padding": 4}, {}),
    ("max_private_tokens", {"max_private_tokens": 2}, {}),
    ("expert_capacity", {"expert_capacity": 8}, {}),
    ("buffers", {"buffers": "memfd"}, {}),
    ("transport", {"transport": "shm"}, {"transport": "tcp"}),
    ("node size", {"node_group": 1}, {"node_group": 2}),
    ("proxies", {"proxies": 1}, {"proxies": "auto"}),
]
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(A2AConfig)}


def _build_args(change: dict, transport: str, node_group: int):
    cfg_args = {k: v for k, v in change.items() if k in _CONFIG_FIELDS}
    args = {"transport": transport, "node_group": node_group}
    args.update({k: v for k, v in change.items() if k not in _CONFIG_FIELDS})
    return dataclasses.replace(BASE, **cfg_args), args


def _rank(rank: int, world: int, store: str, transport: str, node_group: int, queue) -> None:
    """Every mismatch in turn (what each construction raised), then a matching instance and one call."""
    import datetime
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from moe_a2a import AllToAll
    from moe_a2a.bench.demo import rank_roundtrip
    from moe_a2a.local import _dumps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    seen = {}
    for name, change0, change1 in MISMATCHES:
        cfg, args = _build_args(change0 if rank == 0 else change1, transport, node_group)
        try:
            AllToAll(cfg, device="cpu", timeout_s=30, **args).close()
            seen[name] = "built"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            seen[name] = f"{type(exc).__name__}: {exc}"
    with AllToAll(BASE, device="cpu", timeout_s=30, transport=transport, node_group=node_group) as a2a:
        result = rank_roundtrip(a2a, rank, BASE.max_num_tokens, 5, 2)
    queue.put((rank, seen, _dumps(result["calls"])))  # raw bytes: this process exits right after
    dist.barrier()  # neither rank tears the group down under the other
    dist.destroy_process_group()


@interpreter_only("its ranks run on the CPU (device='cpu')")
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport,node_group", [("shm", 2), ("tcp", 1)], ids=["shm-node-local", "tcp-remote"])
def test_every_mismatch_is_refused_on_every_rank_and_nothing_crashes(tmp_path, transport, node_group):
    import multiprocessing as mp

    from moe_a2a.oracle import check_against_reference
    from moe_a2a.local import _loads

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = 2
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp_path / "store"), transport, node_group, queue),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(world):
            rank, seen, calls = queue.get(timeout=240)
            got[rank] = (seen, _loads(calls))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode is not None and p.exitcode >= 0 for p in procs), \
        f"a rank process crashed (killed by a signal): exit codes {[p.exitcode for p in procs]}"
    for name, _, _ in MISMATCHES:
        for rank in range(world):
            msg = got[rank][0][name]
            assert msg.startswith(f"ValueError: rank {rank}: AllToAll was built with different configurations"), \
                (name, rank, msg)
            assert "before any buffer was allocated" in msg
            # The differing field, with which rank had which value.
            line = next((ln.strip() for ln in msg.splitlines() if ln.strip().startswith(f"{name}:")), None)
            assert line is not None and "on rank 0" in line and "on rank 1" in line, (name, msg)
    assert "hidden_dim: 64 on rank 0; 128 on rank 1" in got[0][0]["hidden_dim"]
    assert "transport: 'shm' on rank 0; 'tcp' on rank 1" in got[1][0]["transport"]
    assert "proxies: 1 on rank 0; 'auto' on rank 1 (every rank must run the same number of proxy processes)" \
        in got[0][0]["proxies"]
    # Only what differs is named (scale_block differs; in_dtype is fp8 on both ranks).
    assert "in_dtype" not in got[0][0]["scale_block"]
    assert check_against_reference(BASE, [{"calls": got[r][1]} for r in range(world)]) == []


# ---- the check itself, without processes ---------------------------------------------------------
def _fp(cfg=BASE, **kw):
    args = dict(node_group="auto", transport="shm", buffers="auto", proxies="auto", device="cpu")
    args.update(kw)
    return fingerprint.of(cfg, **args)


def test_equal_fingerprints_pass_and_every_config_field_is_covered():
    fingerprint.check([_fp(), _fp(node_group=3), _fp(device=torch.device("cpu"))], ["h", "h", "h"], 0)
    for f in dataclasses.fields(A2AConfig):
        if f.init:
            assert f.name in _fp(), f.name


def test_differences_name_each_field_and_group_the_ranks():
    table = [_fp(), _fp(dataclasses.replace(BASE, hidden_dim=128)), _fp(), _fp(transport="tcp")]
    with pytest.raises(ValueError) as info:
        fingerprint.check(table, ["h"] * 4, 2)
    msg = str(info.value)
    assert msg.startswith("rank 2: AllToAll was built with different configurations")
    assert "hidden_dim: 64 on ranks 0, 2, 3; 128 on rank 1" in msg
    assert "transport: 'shm' on ranks 0, 1, 2; 'tcp' on rank 3" in msg
    assert "max_num_tokens" not in msg and "node size" not in msg


def test_node_size_auto_is_compared_as_resolved_from_the_hosts():
    hosts = ["a", "a", "b", "b"]
    fingerprint.check([_fp(), _fp(node_group=2), _fp(), _fp()], hosts, 0)  # "auto" is 2 here
    with pytest.raises(ValueError, match=r"node size: 2 on ranks 0, 2, 3; 4 on rank 1"):
        fingerprint.check([_fp(), _fp(node_group=4), _fp(), _fp()], hosts, 0)
    with pytest.raises(ValueError, match="node size: 'auto' \\(hosts not grouped"):
        fingerprint.check([_fp(), _fp(node_group=1), _fp(), _fp()], ["a", "b", "a", "b"], 0)


def test_a_table_entry_that_is_not_a_fingerprint_is_refused_not_crashed_on():
    with pytest.raises(ValueError, match="not a fingerprint: str"):
        fingerprint.check([_fp(), "host-only"], ["h", "h"], 0)
