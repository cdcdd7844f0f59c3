"""test_collective_faults' node-local case on the GPU: the whole message, how long, and rank 0's signal state
(SigCgt, each thread's SigBlk; SIGUSR1 = bit 9) 5 s into the run. FIX=0: the abort signal armed at start-up only."""
import os, sys, threading, time
sys.path.insert(0, ".")
import moe_a2a.local.rank as rank_mod
from tests.e2e.test_collective_faults import CFG, _raise_between_dispatch_and_combine

if os.environ.get("FIX", "1") == "0":
    _orig, _done = rank_mod._arm_abort_signal, []
    def _once(handler):
        if not _done:
            _done.append(1)
            _orig(handler)
    rank_mod._arm_abort_signal = _once


def fn(a2a, rank, culprit):
    return _raise_between_dispatch_and_combine(a2a, rank, culprit)


def sample(pid, out):
    time.sleep(5)
    try:
        st = open(f"/proc/{pid}/status").read().splitlines()
        out.append([l for l in st if l.startswith(("SigCgt", "SigBlk", "SigIgn", "SigPnd", "ShdPnd"))])
        for tid in sorted(os.listdir(f"/proc/{pid}/task")):
            t = open(f"/proc/{pid}/task/{tid}/status").read().splitlines()
            out.append((tid, [l for l in t if l.startswith(("Name", "SigBlk", "SigPnd"))]))
    except OSError as exc:
        out.append(repr(exc))


if __name__ == "__main__":
    from moe_a2a import LocalCluster
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    world, node, transport = (int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]) if len(sys.argv) > 4 else (2, 2, "shm")
    with LocalCluster(CFG, world_size=world, node_size=node, transport=transport, device=dev, timeout_s=20.0) as cl:
        got = []
        th = threading.Thread(target=sample, args=(cl._procs[0].pid, got), daemon=True)
        t0 = time.monotonic(); th.start()
        try:
            cl.run(fn, world - 1)
        except RuntimeError as exc:
            print(f"FIX={os.environ.get('FIX', '1')} took {time.monotonic() - t0:.1f} s: {exc}")
        th.join(10)
        for g in got:
            print(g)
