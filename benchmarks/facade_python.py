"""The host Python of one DeepEP-facade dispatch + combine pair, without the launches (decode sizes, one
rank, fp8 calls), against `AllToAll` fed pre-quantised input.

    TRITON_INTERPRET=1 python3 benchmarks/facade_python.py [--device cpu|cuda] [--lines] [--profile]

Builds a `moe_a2a.compat.Buffer` and an `AllToAll` with fp8 rows (shm, one rank), makes one real call of
the facade, then times 20 batches of 1000 pairs of each variant (the median and the fastest batch, µs a pair):

- `facade`: the facade's own code, its `AllToAll` halves replaced by no-ops;
- `facade_in_place`: the facade and its `AllToAll` instances, with the kernel launchers, the host waits
  and the CPU-only index check replaced by no-ops: the Python an eager GPU pair runs besides its launches;
- `a2a_prequantised`: `AllToAll.dispatch` + `combine` fed fp8 input, stubbed alike (its batches
  alternate with the previous variant's).

`facade_in_place - a2a_prequantised` is the facade's share of the eager gap without the launches (whose
keys differ by one tensor and the quantisation). `--lines`: the Python lines one pair of each in-place
variant executes (sys.settrace; a count the machine's noise does not move). `--profile`: the frames of
`facade_in_place` by own time (cProfile, 20 000 pairs). `docs/perf-notes.md` has the numbers;
`benchmarks/gpu/facade_cost.py --host-split` measures the eager host time in place, launches included.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import contextlib
import io
import pstats
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

T, H, E, K = 128, 7168, 288, 8  # decode; --smoke: 4, 256, 8, 2 and 2 x 10 pairs (a test runs that)
BATCHES, PAIRS = 20, 1000


@contextlib.contextmanager
def launches_stubbed(instances):
    """The kernel launchers `AllToAll` calls, its host waits and the CPU-only index check as no-ops."""
    from moe_a2a import all_to_all
    from moe_a2a.runtime.status import Status

    modules = (all_to_all.routing, all_to_all.dispatch_kernels, all_to_all.combine_kernels, all_to_all.rank_rows)
    names = ("route_tokens", "validate_indices", "pack_tokens_by_expert", "unpack_tokens_by_expert",
             "pack_combine_by_source", "reduce_combined_tokens", "route_tokens_by_rank",
             "expand_rank_rows", "reduce_rank_rows_by_source", "reduce_rank_rows_by_token")
    saved = [(m, n, getattr(m, n)) for m in modules for n in names if hasattr(m, n)]
    for m, n, _ in saved:
        setattr(m, n, lambda *a, **k: None)
    waits = Status.host_wait
    Status.host_wait = lambda self, half, epoch: None
    try:
        yield
    finally:
        Status.host_wait = waits
        for m, n, f in saved:
            setattr(m, n, f)
        for a2a in instances:  # the stubbed calls left them idle, as a real pair does
            assert a2a._state == 0, a2a._state


def timed(pairs: dict) -> dict:
    """µs per pair of each variant: BATCHES batches of PAIRS pairs each, the variants' batches alternated
    (so a slower spell of the machine falls on all of them); prints and returns the fastest batch."""
    for pair in pairs.values():
        for _ in range(PAIRS):
            pair()
    batches = {name: [] for name in pairs}
    for _ in range(BATCHES):
        for name, pair in pairs.items():
            t0 = time.perf_counter()
            for _ in range(PAIRS):
                pair()
            batches[name].append((time.perf_counter() - t0) * 1e6 / PAIRS)
    for name, b in batches.items():
        print(f"  {name:18s} median {statistics.median(b):6.2f} µs, fastest batch {min(b):6.2f} µs")
    return {name: min(b) for name, b in batches.items()}


def lines_run(pair) -> collections.Counter:
    """Python lines one pair executes, by function (sys.settrace): a count no machine's noise moves."""
    counts: collections.Counter = collections.Counter()

    def trace(frame, event, arg):
        if event == "line":
            code = frame.f_code
            counts[f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}"] += 1
        return trace

    sys.settrace(trace)
    try:
        pair()
    finally:
        sys.settrace(None)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--lines", action="store_true", help="also the Python lines a pair of each variant executes")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and counts: that the script runs")
    args = ap.parse_args()
    global T, H, E, K, BATCHES, PAIRS
    if args.smoke:
        T, H, E, K, BATCHES, PAIRS = 4, 256, 8, 2, 2, 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from moe_a2a import A2AConfig, AllToAll
    from moe_a2a.compat import Buffer

    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    y = torch.zeros(E, T, H, dtype=torch.bfloat16, device=dev)
    cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.float8_e4m3fn,
                    out_dtype=torch.bfloat16, expert_capacity=T)
    xq = torch.zeros(T, H, dtype=torch.float8_e4m3fn, device=dev)
    xs = torch.ones(T, cfg.num_scales, dtype=torch.float32, device=dev)
    with Buffer(None, transport="shm", device=dev, timeout_s=60.0) as buf, \
            AllToAll(cfg, transport="shm", device=dev, timeout_s=60.0) as a2a:
        buf.low_latency_combine(y, idx, w, buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2], out=out)
        num, ex, exs = a2a.empty_dispatch_outputs()
        y_rows = torch.zeros_like(ex, dtype=torch.bfloat16)

        def facade_pair():
            handle = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2]
            buf.low_latency_combine(y, idx, w, handle, out=out)

        def a2a_pair():
            a2a.dispatch(num, ex, exs, xq, xs, idx)
            a2a.combine(out, idx, w, y_rows)

        print(f"{dev}: host Python per dispatch + combine pair, launches excluded")
        instances = [i for slot in buf._slots for i in slot.instances.values()]
        for i in instances:
            i.dispatch = i.combine = lambda *a, **k: None
        timed({"facade": facade_pair})
        for i in instances:  # the real halves again
            del i.dispatch, i.combine
        with launches_stubbed(instances + [a2a]):
            fastest = timed({"facade_in_place": facade_pair, "a2a_prequantised": a2a_pair})
            print(f"  facade_in_place - a2a_prequantised: "
                  f"{fastest['facade_in_place'] - fastest['a2a_prequantised']:.2f} µs (fastest batches)")
            if args.lines:
                for name, pair in (("facade_in_place", facade_pair), ("a2a_prequantised", a2a_pair)):
                    counts = lines_run(pair)
                    top = ", ".join(f"{k} {v}" for k, v in counts.most_common(6))
                    print(f"  {name}: {sum(counts.values())} lines a pair ({top}, ...)")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(BATCHES * PAIRS):
                    facade_pair()
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                print(text.getvalue())


if __name__ == "__main__":
    main()
