"""A rank killed outright (SIGKILL, no launcher to notice) mid-call is known to every peer within 2 s, naming
it, not after the peers' own timeout (20 s here): its proxy, told of the death by the kernel, says so before it
exits, in the node peers' segments (their host waits raise at once) and on the failure board (remote peers'
watch threads). Between real processes (`tests/proxy/_peers.run_peers`), on one node and across nodes."""
from __future__ import annotations

import os
import time

import pytest
import torch

from ..conftest import interpreter_only
from ..proxy._peers import Died, run_peers

pytestmark = [pytest.mark.slow]  # ranks in processes of their own, one of them killed

TIMEOUT_S = 20.0  # the peers' own timeout: without the report they would raise after 16 s (proxy) or 20 s
BOUND_S = 2.0     # README's Errors bullet: a killed rank is known to its peers within 2 s


def _rank(comm, store: str, node_size: int, transport: str, victim: int, device: str = "cpu", relay: bool = False,
          proxies="auto"):
    """One rank; on a GPU (`device="cuda"`) with kernel waits: the peers' waits are kernels, and `check()`
    after the combine says what they saw."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from moe_a2a import A2AConfig, AllToAll

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=comm.rank, world_size=comm.size)
    if device == "cuda":
        device = torch.device("cuda", comm.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    rows = dict(dispatch_rows="rank", combine_rows="rank", relay=True) if relay else {}
    cfg = A2AConfig(max_num_tokens=2, num_experts=2 * comm.size, experts_per_token=2, hidden_dim=16,
                    in_dtype=torch.bfloat16, **rows)
    a2a = AllToAll(cfg, node_group=node_size, transport=transport, device=device, timeout_s=TIMEOUT_S,
                   proxies=proxies, **({} if str(device) == "cpu" else {"gpu_wait": "kernel"}))
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(2, 16, generator=g).to(torch.bfloat16).to(device)
    idx = torch.tensor([[(comm.rank + 1) % cfg.num_experts, (2 * comm.rank + 3) % cfg.num_experts]] * 2).to(device)
    w = torch.ones(2, 2, device=device)
    num, ex, exs = a2a.empty_dispatch_outputs()
    out = torch.zeros(2, 16, dtype=cfg.out_dtype, device=device)

    def call(die: bool = False) -> None:
        a2a.dispatch(num, ex, exs, x, None, idx, **({"weights": w} if relay else {}))
        if die:
            comm.allgather("dispatched")
            comm.die()  # SIGKILL mid-call: the peers are in this call's combine, waiting for this rank
        elif die is None:
            comm.allgather("dispatched")
        a2a.combine(out, idx, w, ex.to(cfg.out_dtype))
        a2a.check()  # kernel waits: what they recorded (a no-op after host waits that passed)

    try:
        call()  # a whole call first: the kernels are built, every proxy is in its loop
        start = time.monotonic()
        try:
            call(True if comm.rank == victim else None)
        except Exception as exc:  # noqa: BLE001 - what matters is how fast, and what it says
            return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
        return time.monotonic() - start, None
    finally:
        a2a.close()


@interpreter_only("its ranks run on the CPU (the GPU's kernel waits: the test below)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("node_size,transport,world", [(3, "shm", 3), (1, "shm", 3), (1, "tcp", 2)],
                         ids=["one-node-shm", "across-nodes-shm", "across-nodes-tcp"])
def test_a_rank_killed_outright_is_known_to_its_peers_within_two_seconds(tmp_path, node_size, transport, world):
    victim = 1
    results = run_peers(world, _rank, str(tmp_path / "store"), node_size, transport, victim, timeout_s=100)
    assert isinstance(results[victim], Died), results[victim]
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        elapsed, err = result
        assert err is not None and f"rank {victim}" in err and "missing peers [1]" in err, (rank, elapsed, err)
        if transport != "tcp":  # over tcp the peer's proxy may see the connection drop first, and say that
            assert "its model process (pid" in err, (rank, elapsed, err)
        assert elapsed < BOUND_S, (rank, elapsed, err)


@pytest.mark.gpu(reason="kernel waits on node peers: run on the GPU machine under MPS (benchmarks/gpu/run.sh mps)")
@pytest.mark.timeout(120)
def test_a_rank_killed_outright_is_known_to_kernel_waits_within_two_seconds(tmp_path):
    """GPU, every rank on one node, kernel waits (no proxy flag in them): the waits look at the ERROR word
    the dead rank's proxy writes, so they stop within 2 s naming it, not at `timeout_s`. Three ranks: three
    GPUs, or one shared under MPS."""
    from moe_a2a.runtime.wiring import mps_enabled

    if torch.cuda.device_count() < 3 and not mps_enabled(torch.device("cuda", 0)):
        pytest.skip("needs 3 GPUs, or MPS on this one (benchmarks/gpu/run.sh mps): ranks sharing a GPU "
                    "without MPS wait on the host")
    victim = 1
    results = run_peers(3, _rank, str(tmp_path / "store"), 3, "shm", victim, "cuda", timeout_s=100)
    assert isinstance(results[victim], Died), results[victim]
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        elapsed, err = result
        print(f"rank {rank}: {elapsed:.3f} s: {err}")
        assert err is not None and f"rank {victim}" in err and "missing peers [1]" in err, (rank, elapsed, err)
        assert elapsed < BOUND_S, (rank, elapsed, err)


@interpreter_only("its ranks run on the CPU")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("proxies", [1, 2])
def test_a_relay_killed_outright_is_known_to_every_rank_within_two_seconds(tmp_path, proxies):
    """W = 4 as 2 nodes of 2 through the relay (`A2AConfig(relay=True)`): rank 1 dies mid-call. It is the relay of
    rank 3 on node 0 and holds partials rank 0's relay reduce waits for; ranks 2 and 3 wait only for their relays'
    rows (with 2 proxies a rank, each write in 2 pieces: rank 3's two proxies each wait for one of the dead rank's).
    Every rank knows within 2 s, naming rank 1."""
    victim = 1
    results = run_peers(4, _rank, str(tmp_path / "store"), 2, "shm", victim, "cpu", True, proxies, timeout_s=100)
    assert isinstance(results[victim], Died), results[victim]
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        elapsed, err = result
        assert err is not None and f"rank {victim}" in err, (rank, elapsed, err)
        assert elapsed < BOUND_S, (rank, elapsed, err)
