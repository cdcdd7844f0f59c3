"""Where an eager dispatch + combine spends its host time (2 ranks, one per GPU, decode sizes).

For each half: the host time of the Python call (perf_counter, no device sync inside the loop), then a
cProfile of 50 calls on rank 0 (top entries by own time). Needs 2 GPUs:

    python3 benchmarks/gpu/profile_eager.py [calls, default 200]
"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from moe_a2a import LocalCluster
from moe_a2a.bench.demo import call_tensors
from moe_a2a.bench.kernels import PRESETS
from moe_a2a.config import A2AConfig


def rank_fn(a2a, rank, iters):
    x, xs, idx, w, num, ex, exs, y, out = call_tensors(a2a, rank, 0)
    bound = torch.tensor([a2a.cfg.max_num_tokens], dtype=torch.int32, device=a2a.device)

    def halves():
        t = [time.perf_counter()]
        a2a.dispatch(num, ex, exs, x, xs, idx, bound_m=bound, do_recv=False)
        t.append(time.perf_counter())
        a2a.dispatch(num, ex, exs, x, xs, idx, bound_m=bound, do_send=False)
        t.append(time.perf_counter())
        a2a.combine(out, idx, w, y, do_recv=False)
        t.append(time.perf_counter())
        a2a.combine(out, idx, w, y, do_send=False)
        t.append(time.perf_counter())
        return [(b - a) * 1e6 for a, b in zip(t, t[1:])]

    for _ in range(10):
        halves()
    torch.cuda.synchronize()
    host = [halves() for _ in range(iters)]
    torch.cuda.synchronize()
    # GPU time of back-to-back eager calls (no host sync between calls): events around each call.
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        halves()
        b.record()
    torch.cuda.synchronize()
    per_call = [a.elapsed_time(b) * 1e3 for a, b in ev]
    prof = ""
    if rank == 0:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            halves()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        prof = s.getvalue()
    med = [statistics.median(h[i] for h in host) for i in range(4)]
    return {"host_us": med, "back_to_back_call_us": statistics.median(per_call), "profile": prof}


if __name__ == "__main__":
    cfg = A2AConfig(**PRESETS["decode"], in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16)
    with LocalCluster(cfg, world_size=2, node_size=2, device="cuda", timeout_s=60) as cl:
        res = cl.run(rank_fn, int(sys.argv[1]) if len(sys.argv) > 1 else 200)
    for r, x in enumerate(res):
        print(f"rank {r}: host µs per half (dispatch send, recv, combine send, recv) "
              f"{[round(v, 1) for v in x['host_us']]}; back-to-back eager call {x['back_to_back_call_us']:.1f} µs")
    print(res[0]["profile"])
