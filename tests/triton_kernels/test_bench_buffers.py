"""`moe-a2a bench kernels` gives the kernels synthetic buffers (one rank of a many-rank layout, its
same-node peers aliasing one buffer pair): every byte the kernels write must land inside them. A
combine pack into a recv buffer too short for the layout's combine region was an illegal memory access
on a GPU; in the interpreter the same write lands in guard bytes behind `base`, which this test checks."""
from __future__ import annotations

import pytest
import torch

from moe_a2a.bench.kernels import _rank_setup
from moe_a2a.config import A2AConfig
from moe_a2a.triton_kernels import combine, dispatch, routing

from ..conftest import TEST_DEVICE, interpreter_only

GUARD = 0x5A


@pytest.mark.timeout(120)
@interpreter_only("guard bytes past `base` catch stray writes only there; on a GPU such a write is an "
                  "illegal memory access")
def test_bench_buffers_hold_every_byte_the_kernels_write() -> None:
    # The bench's shape (fp8 payload with scales, bf16 combine, rank 0 of 8 ranks, 4 per node), small.
    cfg = A2AConfig(max_num_tokens=16, num_experts=16, experts_per_token=4, hidden_dim=256,
                    in_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16)
    lay = cfg.layout(8, 4)
    r, L, T, H = 0, lay.num_local_experts, cfg.max_num_tokens, cfg.hidden_dim
    sets, counts_cpu, max_rows, buf = _rank_setup(cfg, lay, r, 2, TEST_DEVICE)
    n = buf.base.numel()
    # Guard room for any offset the layout can produce past the buffers' end.
    arena = torch.full((n + lay.send_bytes + lay.recv_bytes,), GUARD, dtype=torch.uint8)
    arena[:n] = buf.base
    base = arena[:n]

    x, x_scale, indices, weights, _ = sets[0]
    counts = counts_cpu[0]
    _, slot = routing.route_tokens(indices, cfg.num_experts)
    dispatch.pack_tokens_by_expert(x, x_scale, slot, base, buf.send_off, cfg)
    dispatch.unpack_tokens_by_expert(torch.zeros(L, dtype=torch.int32), torch.empty(max_rows, H, dtype=cfg.in_dtype),
                                     torch.empty(max_rows, cfg.num_scales), counts, r, base, buf.peer_send,
                                     buf.recv_off, cfg, lay)
    combine.pack_combine_by_source(torch.ones(max_rows, H, dtype=cfg.out_dtype), counts, r, base, buf.peer_recv,
                                   buf.stage_off, cfg, lay)
    combine.reduce_combined_tokens(torch.empty(T, H, dtype=cfg.out_dtype), slot, weights, base, buf.recv_off, cfg)
    past = arena[n:]
    assert bool((past == GUARD).all()), f"{int((past != GUARD).sum())} bytes written past base (first at " \
        f"offset {n + int(torch.nonzero(past != GUARD)[0])}, base is {n} bytes)"
