"""The protocol as it was before 2026-11-30 (commit 4a5e29b), timed and traced the way
`moe-a2a bench e2e --graph` times today's: one CUDA graph per half, replayed back to back, decode sizes,
2 ranks on 2 GPUs; then one traced graph call (the model's kernel-side stamps and the proxy's steps,
read raw: that version's `trace()` matched stamps to the host's epoch, which graph replays do not
advance). It gave the "before" numbers of docs/benchmarks.md (docs/results/before_graph_x2.json). Run from
inside old_pkg/, because the proxy is started with `python -m moe_a2a.proxy.worker`, which takes the
package of the working directory first (2 GPUs):

    mkdir old_pkg && git archive 4a5e29b moe_a2a | tar -x -C old_pkg
    cd old_pkg && PYTHONPATH=$PWD python3 ../benchmarks/gpu/before_graph.py out.json
"""
import json
import statistics
import sys

import torch

from moe_a2a import LocalCluster
from moe_a2a.config import TRACE_EVENTS, MODEL_TRACE_EVENTS, A2AConfig
from moe_a2a.demo import make_inputs

DECODE = dict(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=7168)


def _stats(v):
    s = sorted(v)
    return {"median": statistics.median(s), "p10": s[len(s) // 10], "p90": s[9 * len(s) // 10], "n": len(s)}


def rank_fn(a2a, rank, iters=200, warmup=20, sets=4):
    cfg, dev = a2a.cfg, a2a.device
    T = cfg.max_num_tokens
    num, ex, exs = a2a.empty_dispatch_outputs()
    y = torch.zeros(ex.shape, dtype=cfg.out_dtype, device=dev)
    bound = torch.tensor([T], dtype=torch.int32, device=dev)
    inputs = [tuple(t if t is None else t.to(dev) for t in make_inputs(cfg, rank, T, i)) for i in range(sets)]
    outs = [torch.zeros(T, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev) for _ in range(sets)]

    def dispatch(i):
        x, xs, idx, _ = inputs[i]
        a2a.dispatch(num, ex, exs, x, xs, idx, bound_m=bound)

    def combine(i):
        a2a.combine(outs[i], inputs[i][2], inputs[i][3], y, bound_m=bound)

    for i in range(2):
        dispatch(i)
        combine(i)
    torch.cuda.synchronize()
    a2a.set_tracing(True)  # before capture: the stamp kernels are part of the graphs
    graphs = []
    for i in range(sets):
        pair = (torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph())
        with torch.cuda.graph(pair[0]):
            dispatch(i)
        with torch.cuda.graph(pair[1]):
            combine(i)
        graphs.append(pair)
    torch.cuda.synchronize()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(warmup + iters)]
    for it, ev in enumerate(events):
        ev[0].record()
        graphs[it % sets][0].replay()
        ev[1].record()
        graphs[it % sets][1].replay()
        ev[2].record()
    torch.cuda.synchronize()
    d = [e[0].elapsed_time(e[1]) * 1e3 for e in events[warmup:]]
    c = [e[1].elapsed_time(e[2]) * 1e3 for e in events[warmup:]]
    import time
    time.sleep(0.2)  # the proxy's last steps of the last call
    lay = a2a.layout
    stamps = a2a._model_trace_host[: lay.clock_calibration_word].reshape(-1, 2, 2).tolist()
    epoch = max(e0 for (e0, _), _ in stamps)
    offset = a2a._clock_offset_ns or 0
    model = {n: (t0 + offset, t1 + offset) for n, ((e0, t0), (e1, t1)) in zip(MODEL_TRACE_EVENTS, stamps)
             if e0 == e1 == epoch}
    raw = a2a.segment.numpy(lay.trace_offset_bytes, 2 * len(TRACE_EVENTS), "int64").reshape(-1, 2)
    proxy = {n: int(t) for n, (e, t) in zip(TRACE_EVENTS, raw) if e == epoch}
    return {"dispatch": _stats(d), "combine": _stats(c), "total": _stats([a + b for a, b in zip(d, c)]),
            "trace": {"rank": rank, "epoch": epoch, "model": model, "proxy": proxy}}


if __name__ == "__main__":
    cfg = A2AConfig(**DECODE, in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16)
    with LocalCluster(cfg, world_size=2, node_size=2, device="cuda", timeout_s=60, gpu_wait="kernel") as cl:
        res = cl.run(rank_fn)
    for r in res:
        print({k: round(r[k]["median"], 1) for k in ("dispatch", "combine", "total")})
    with open(sys.argv[1], "w") as f:
        json.dump({"commit": "4a5e29b", "config": str(cfg), "per_rank": res}, f, indent=1)
