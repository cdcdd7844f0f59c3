"""Does loading a kernel wait for kernels already running? (GPU; docs/protocol.md, section 6, aborts)

A one-program kernel spins SPIN_S seconds on %globaltimer; while it runs, the loader times (a) an already
loaded kernel, (b) loading a new Triton variant compiled beforehand, (c) the same for a variant that spills
(local memory), (d) a PyTorch op never used before, (e) launching (c). One JSON line on stdout.

    python benchmarks/gpu/load_under_spin.py one   # the spinner on a side stream of the loader's own process
    python benchmarks/gpu/load_under_spin.py two   # the spinner in another process (run it with MPS and without)

Set CUDA_MODULE_LOADING=EAGER to compare with lazy loading (the default).
"""
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import triton
import triton.language as tl

SPIN_S = 4.0

@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

@triton.jit
def spin(out_ptr, ns):
    start = _now()
    t = start
    while t - start < ns:
        t = _now()
    tl.store(out_ptr, t - start)

@triton.jit
def small(out_ptr, V: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, 16), tl.arange(0, 16) + V)

@triton.jit
def big_local(out_ptr, idx, V: tl.constexpr):
    # 8192 int64 live across a scan in one warp: ~512 registers a thread, so it spills (local memory)
    offs = tl.arange(0, 8192)
    x = tl.load(out_ptr + offs) * V + idx
    y = tl.cumsum(x, 0)
    tl.store(out_ptr + offs, y + x)

def timed(fn):
    t = time.perf_counter(); fn(); return round(time.perf_counter() - t, 3)

def spinner(ready, go, spinning, q):
    torch.cuda.init(); out = torch.zeros(1, dtype=torch.int64, device="cuda")
    spin[(1,)](out, 1000); torch.cuda.synchronize()
    ready.set(); go.wait()
    spin[(1,)](out, int(SPIN_S * 1e9)); time.sleep(0.3); spinning.set()
    torch.cuda.synchronize(); q.put(("spinner_s", out.item() / 1e9))

def loader(ready, go, spinning, q, v):
    torch.cuda.init(); out = torch.zeros(16384, dtype=torch.int64, device="cuda")
    small[(1,)](out, V=1); torch.cuda.synchronize()  # loaded
    k_small = small.warmup(out, V=100 + v, grid=(1,))
    k_big = big_local.warmup(out, 5, V=200 + v, grid=(1,), num_warps=1)
    x = torch.randn(1000, device="cuda")
    ready.set(); go.wait(); spinning.wait()
    r = {}
    r["a_preloaded_kernel_s"] = timed(lambda: (small[(1,)](out, V=1), torch.cuda.current_stream().synchronize()))
    r["b_load_new_variant_s"] = timed(lambda: k_small._init_handles())
    r["c_load_big_local_s"] = timed(lambda: k_big._init_handles())
    r["c_big_local_spills"] = getattr(k_big, "n_spills", None)
    r["d_first_torch_op_s"] = timed(lambda: (torch.special.i0(x), torch.cuda.current_stream().synchronize()))
    r["e_launch_big_local_s"] = timed(lambda: (big_local[(1,)](out, 5, V=200 + v, num_warps=1), torch.cuda.current_stream().synchronize()))
    q.put(("loader", r))

def two_processes():
    ctx = mp.get_context("spawn")
    ready1, ready2, go, spinning, q = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    v = int(time.time()) % 1000
    ps = [ctx.Process(target=spinner, args=(ready1, go, spinning, q)),
          ctx.Process(target=loader, args=(ready2, go, spinning, q, v))]
    for p in ps: p.start()
    ready1.wait(120); ready2.wait(120); go.set()
    res = dict(q.get(timeout=60) for _ in ps)
    for p in ps: p.join(30)
    return res

def one_process():
    torch.cuda.init(); out = torch.zeros(16384, dtype=torch.int64, device="cuda")
    o1 = torch.zeros(1, dtype=torch.int64, device="cuda")
    spin[(1,)](o1, 1000); small[(1,)](out, V=1); torch.cuda.synchronize()
    v = int(time.time()) % 1000 + 1000
    k_small = small.warmup(out, V=100 + v, grid=(1,))
    k_big = big_local.warmup(out, 5, V=200 + v, grid=(1,), num_warps=1)
    x = torch.randn(1000, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        spin[(1,)](o1, int(SPIN_S * 1e9))
    time.sleep(0.3)
    r = {}
    r["a_preloaded_kernel_s"] = timed(lambda: (small[(1,)](out, V=1), torch.cuda.current_stream().synchronize()))
    r["b_load_new_variant_s"] = timed(lambda: k_small._init_handles())
    r["c_load_big_local_s"] = timed(lambda: k_big._init_handles())
    r["d_first_torch_op_s"] = timed(lambda: (torch.special.i0(x), torch.cuda.current_stream().synchronize()))
    r["e_launch_big_local_s"] = timed(lambda: (big_local[(1,)](out, 5, V=200 + v, num_warps=1), torch.cuda.current_stream().synchronize()))
    torch.cuda.synchronize()
    return r

if __name__ == "__main__":
    mode = sys.argv[1]
    res = {"mode": mode, "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "(default)"),
           "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "spin_s": SPIN_S}
    res.update(two_processes() if mode == "two" else one_process())
    print(json.dumps(res))
