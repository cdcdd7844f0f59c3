"""Nothing outlives the processes that own it, whoever launched them: ranks built with a plain
torch.distributed group (no LocalCluster to clean up after them), killed outright, leave nothing in
/dev/shm and no process behind."""
import os
import signal
import time

import pytest

from moe_a2a.protocol.memory import process_shm_files

pytestmark = [pytest.mark.slow]  # ranks started with multiprocessing, killed outright


def _rank(rank: int, world: int, store: str, transport: str, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.distributed as dist

    from moe_a2a import A2AConfig, AllToAll

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=16, in_dtype=torch.bfloat16)
    # Two simulated nodes: the proxies are up and their provider regions exist.
    a2a = AllToAll(cfg, node_group=1, transport=transport, device="cpu", timeout_s=30, buffers="staged")
    queue.put((rank, os.getpid(), [h.proc.pid for h in a2a.proxies]))
    time.sleep(600)  # until killed


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ranks_killed_under_a_plain_launch_leave_nothing_in_dev_shm(tmp_path, transport):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, world = ctx.Queue(), 2
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp_path / "store"), transport, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        pids = {}
        for _ in range(world):
            rank, pid, proxies = queue.get(timeout=150)
            pids[rank] = [pid] + proxies
        # Built: the segments are already unlinked (every peer and proxy mapped them first).
        assert [f for r in pids for f in process_shm_files(pids[r][0], libfabric=False)] == []
        for rank in range(world):  # one rank at a time, as a crash would
            os.kill(pids[rank][0], signal.SIGKILL)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(map(_gone, pids[rank])):
                time.sleep(0.05)
            assert [p for p in pids[rank] if not _gone(p)] == [], f"rank {rank}: a process outlived its rank"
            left = [f for p in pids[rank] for f in process_shm_files(p)]
            assert left == [], f"rank {rank} killed: left {left}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
