"""Staging remote rows: copy engine (cudaMemcpyAsync into pinned host memory) vs SM stores (a Triton copy
kernel writing pinned host memory through its device mapping, what the pack kernels do), both ways.

Run on the GPU machine: `python3 benchmarks/gpu/staging_copy.py [out.json]`. Sizes are one remote peer's run at
decode (T=128, K=8, fp8 H=7168 + scales, E=256: ~0.9 MB to each of 7 remote ranks at EP16, ~3.7 MB to the
one peer of 2 simulated nodes) up to prefill runs. Events around each copy, median of 50 after 10 warm-up.
"""
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from _timing import median_us
from moe_a2a.protocol.memory import device_view


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_words
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def main(out_path: str | None) -> None:
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for nbytes in (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
        gpu = torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device=dev)
        host = torch.empty(nbytes // 4, dtype=torch.int32, pin_memory=True)
        host_dev = device_view(host.data_ptr(), nbytes, dev).view(torch.int32)
        n = nbytes // 4
        for programs in (sms, 4 * sms):
            grid = (min(programs, triton.cdiv(n, 2048)),)
            sm_d2h = median_us(lambda: _copy_kernel[grid](gpu, host_dev, n, BLOCK=2048, num_warps=4), 50)
            sm_h2d = median_us(lambda: _copy_kernel[grid](host_dev, gpu, n, BLOCK=2048, num_warps=4), 50)
            rows.append({"bytes": nbytes, "how": f"SM, {grid[0]} programs", "d2h_us": sm_d2h, "h2d_us": sm_h2d})
        ce_d2h = median_us(lambda: host.copy_(gpu, non_blocking=True), 50)
        ce_h2d = median_us(lambda: gpu.copy_(host, non_blocking=True), 50)
        rows.append({"bytes": nbytes, "how": "copy engine", "d2h_us": ce_d2h, "h2d_us": ce_h2d})
        assert torch.equal(host, gpu.cpu())
    print(f"{'bytes':>10} {'how':<22} {'GPU->host µs':>13} {'GB/s':>7} {'host->GPU µs':>13} {'GB/s':>7}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['how']:<22} {r['d2h_us']:>13.1f} {r['bytes'] / r['d2h_us'] / 1e3:>7.1f} "
              f"{r['h2d_us']:>13.1f} {r['bytes'] / r['h2d_us'] / 1e3:>7.1f}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
