"""W simulated ranks of several nodes in one arena running the relay's data path (docs/protocol.md, 3.8) with
the real kernels, the proxy's writes done with torch slice copies of `plan`'s relay writes (as `harness.py` does
for route rows). For tests only; not a transport.

    run = RelayRun.create(cfg, world_size=4, node_size=2)
    out = run.dispatch(xs, x_scales, indices, weights)      # route, stamp, pack, relay writes, expand
    tokens = run.combine(expert_ys)                          # reduce by source, relayed rows, writes, by token
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from moe_a2a.config import PAGE_BYTES, A2AConfig, Layout
from moe_a2a.protocol import plan
from moe_a2a.triton_kernels.dispatch import pack_tokens_by_expert
from moe_a2a.triton_kernels.rank_rows import (expand_rank_rows, reduce_rank_rows_by_source, reduce_rank_rows_by_token,
                                              route_tokens_by_rank, row_meta_args)
from moe_a2a.triton_kernels.relay import reduce_relayed_rows
from moe_a2a.triton_kernels.routing import route_tokens

from ..conftest import TEST_DEVICE
from .harness import POISON, SimWorld


@dataclass
class RelayRun:
    """One call through the relay: `world`'s buffers (a relay `Layout`), and what the send half left."""

    world: SimWorld
    count_rows: torch.Tensor = None        # [W, E + W] int32: every rank's count row (E counts, W rows per rank)
    rank_slot: list = field(default_factory=list)  # per rank [T, K] int32: the row each route opened (-1: none)
    writes: list = field(default_factory=list)     # (phase, sender, receiver, rows) of every wire write
    row_plans: list = None  # per rank the expand's row plan, which the reduce by source reads (None: not kept)

    @classmethod
    def create(cls, cfg: A2AConfig, world_size: int, node_size: int, device=TEST_DEVICE,
               row_plan: bool = True) -> "RelayRun":
        lay = cfg.layout(world_size, node_size, relay=True)
        per_rank = lay.send_bytes + lay.recv_bytes
        arena = torch.full((PAGE_BYTES + world_size * per_rank,), POISON, dtype=torch.uint8, device=device)
        send = [PAGE_BYTES + r * per_rank for r in range(world_size)]
        plans = ([torch.full((lay.max_recv_rank_rows, lay.experts_per_token), -7, dtype=torch.int32, device=device)
                  for _ in range(world_size)] if row_plan else None)
        return cls(SimWorld(cfg, lay, arena, send, [s + lay.send_bytes for s in send]), row_plans=plans)

    @property
    def layout(self) -> Layout:
        return self.world.layout

    def rows(self) -> np.ndarray:
        """[W, W] int64: rows[s, q] = rows source s sent rank q (the count rows' last W ints)."""
        return self.count_rows[:, self.layout.num_experts:].cpu().numpy().astype(np.int64)

    def dispatch(self, xs, x_scales, indices, weights) -> list:
        """Send half on every rank, the relay writes, the expand on every rank: per rank (num, x, x_scale)."""
        w, lay, cfg = self.world, self.layout, self.world.cfg
        W, E, dev = lay.world_size, lay.num_experts, w.arena.device
        self.count_rows = torch.zeros(W, E + W, dtype=torch.int32, device=dev)
        for r in range(W):
            idx = indices[r].to(dev).contiguous()
            T, K = idx.shape
            slot = torch.empty(T, K, dtype=torch.int32, device=dev)
            opened, send_row = (torch.empty(T, K, dtype=torch.int32, device=dev) for _ in range(2))
            route_tokens(idx, E, out_counts=self.count_rows[r, :E], out_route_slot=slot)
            route_tokens_by_rank(idx, lay, self.count_rows[r, E:], opened, rank=r, out_send_row=send_row,
                                 private_stage=(lay, r))
            meta = row_meta_args(idx, slot, self.count_rows[r, :E], weights[r].to(dev), cfg, lay, rank=r)
            pack_tokens_by_expert(xs[r].to(dev), None if x_scales[r] is None else x_scales[r].to(dev), send_row,
                                  w.arena, w.send_bytes[r], cfg, max_slots=lay.send_rows + lay.private_stage_rows,
                                  row_meta=meta)
            self.rank_slot.append(opened)
        # The proxies: each private write carries the whole count row (the plan kernel's copy) then the rows.
        rows = self.rows()
        header = self.count_rows.cpu().contiguous().view(torch.uint8).to(dev)
        for r in range(W):
            for peer, src, length, dst in plan.relay_private_writes(rows, r, lay).tolist():
                at = w.send_bytes[r] + src
                w.arena[at:at + lay.routing_row_bytes] = header[r]
                w.copy(w.send_bytes[r], w.recv_bytes[peer], (peer, src, length, dst))
                self.writes.append(("private", r, peer, min(int(rows[r, peer]), lay.private_rows)))
            for peer, src, length, dst in plan.relay_remainder_writes(rows, r, lay).tolist():
                w.copy(w.send_bytes[r], w.recv_bytes[peer], (peer, src, length, dst))
                self.writes.append(("remainder", r, peer, length // lay.dispatch_stride_bytes))
        out = []
        counts = self.count_rows[:, :E]
        for d in range(W):
            R = lay.max_dispatch_rows
            num = torch.full((lay.num_local_experts,), -7, dtype=torch.int32, device=dev)
            ex = torch.full((R, cfg.hidden_dim * cfg.in_itemsize), POISON, dtype=torch.uint8, device=dev)
            ex = ex.view(cfg.in_dtype)
            exs = torch.full((R, cfg.num_scales), float("nan"), device=dev) if cfg.has_scales else None
            expand_rank_rows(num, ex, exs, counts, self.count_rows[:, E:], d, w.arena, w.peer_table(d, w.send_bytes),
                             w.recv_bytes[d], cfg, lay, peer_recv_bytes=w.peer_table(d, w.recv_bytes),
                             out_row_plan=self.row_plans[d] if self.row_plans else None)
            out.append((num, ex, exs))
        return out

    def combine(self, expert_ys) -> list:
        """Reduce by source on every rank, the relays' reduce, the relay combine writes, the reduce by token on
        every home: per home rank `[T, H]` out_dtype."""
        w, lay, cfg = self.world, self.layout, self.world.cfg
        W, E, dev = lay.world_size, lay.num_experts, w.arena.device
        rank_rows = self.count_rows[:, E:]
        partial = [s + lay.relay_partial_offset_bytes for s in w.send_bytes]
        stage = [s + lay.combine_stage_offset_bytes for s in w.send_bytes]
        for d in range(W):
            reduce_rank_rows_by_source(expert_ys[d].to(dev), self.count_rows[:, :E], rank_rows, d, w.arena,
                                       w.peer_table(d, w.send_bytes), w.peer_table(d, w.recv_bytes), w.recv_bytes[d],
                                       stage[d], cfg, lay, partial_bytes=partial[d],
                                       row_plan=self.row_plans[d] if self.row_plans else None)
        for q in range(W):
            reduce_relayed_rows(rank_rows, q, w.arena, w.peer_table(q, partial), w.recv_bytes[q], stage[q], cfg, lay)
        rows = self.rows()
        for q in range(W):
            for write in plan.relay_combine_writes(rows, q, lay).tolist():
                w.copy(w.send_bytes[q], w.recv_bytes[write[0]], write)
                self.writes.append(("combine", q, write[0], write[2] // lay.combine_stride_bytes))
        outs = []
        for s in range(W):
            T = self.rank_slot[s].shape[0]
            out = torch.full((T, cfg.hidden_dim * cfg.out_itemsize), POISON, dtype=torch.uint8, device=dev)
            out = out.view(cfg.out_dtype)
            reduce_rank_rows_by_token(out, self.rank_slot[s], w.arena, w.recv_bytes[s] + lay.combine_recv_offset_bytes,
                                      cfg)
            outs.append(out)
        return outs
