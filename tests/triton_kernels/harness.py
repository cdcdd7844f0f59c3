"""W simulated ranks in one process, with a plain-torch "transport", to test the data-movement kernels.

Every rank's send and recv buffers are slices of ONE uint8 arena, so a single base tensor (the arena)
addresses all of them, as the one UVA space does on a GPU: a same-node peer's buffer is just another
byte offset. What the proxy would do over the network (`plan.private_writes`, `plan.remainder_writes`,
`plan.combine_writes`) is done here with torch slice copies. This harness exists only for tests (the
kernels' and, later, a whole-pipeline one); it is not a transport.

Buffers live on the device the tests run on (`TEST_DEVICE`: the CPU under the interpreter, `cuda` with
MOE_A2A_TEST_DEVICE=cuda), since compiled kernels cannot reach CPU tensors; `make_inputs` builds the
seeded inputs on the CPU, where the reference computes, and the callers move them.

    world = SimWorld.create(cfg, world_size=4, node_size=2)
    result = run_dispatch(world, xs, x_scales, indices, bound_ms)    # pack, transport, unpack
    outs = run_combine(world, result, weights, expert_ys)             # pack, transport, reduce
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st
import torch

from moe_a2a.protocol import plan
from moe_a2a.config import PAGE_BYTES, A2AConfig, Layout
from moe_a2a.triton_kernels.combine import pack_combine_by_source, reduce_combined_tokens
from moe_a2a.triton_kernels.dispatch import pack_tokens_by_expert, unpack_tokens_by_expert

from ..conftest import TEST_DEVICE

# Fill byte of fresh buffers and outputs: a row the kernels should not write keeps it, so tests can
# tell "left untouched" from "written with zeros".
POISON = 0xA5


@dataclass
class SimWorld:
    """Buffers of W ranks in one arena. `send_bytes[r]` / `recv_bytes[r]`: offsets of rank r's send
    and recv buffers from `arena.data_ptr()`, page aligned, sizes from `Layout`."""

    cfg: A2AConfig
    layout: Layout
    arena: torch.Tensor          # 1-D uint8: the base of every byte offset
    send_bytes: list[int]
    recv_bytes: list[int]

    @classmethod
    def create(cls, cfg: A2AConfig, world_size: int, node_size: int, device=TEST_DEVICE) -> "SimWorld":
        lay = cfg.layout(world_size, node_size)
        per_rank = lay.send_bytes + lay.recv_bytes
        lead = PAGE_BYTES  # nothing at offset 0, so a forgotten offset shows up as a wrong row
        arena = torch.full((lead + world_size * per_rank,), POISON, dtype=torch.uint8, device=device)
        send = [lead + r * per_rank for r in range(world_size)]
        recv = [s + lay.send_bytes for s in send]
        return cls(cfg, lay, arena, send, recv)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def peer_table(self, rank: int, offsets: list[int]) -> torch.Tensor:
        """[W] int64: offsets[s] for the ranks on `rank`'s node (itself included), -1 for remote ones."""
        return torch.tensor([offsets[s] if self.layout.same_node(rank, s) else -1
                             for s in range(self.world_size)], dtype=torch.int64, device=self.arena.device)

    def copy(self, src_buffer: int, dst_buffer: int, write: plan.Write) -> None:
        """One RDMA write of `plan`: (peer, src offset, length, dst offset) between two buffers."""
        _, src, length, dst = write
        a, b = src_buffer + src, dst_buffer + dst
        self.arena[b:b + length] = self.arena[a:a + length].clone()


def route_slots(indices: torch.Tensor, num_experts: int,
                bound_m: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the routing kernel computes, in plain torch: (counts int32 [E], route_slot int32 [T, K]).

    A live route is (t, k) with indices[t, k] >= 0 and t < bound_m; its slot is its position when
    live routes are sorted stably (row-major order kept) by expert; dead routes get -1."""
    T, K = indices.shape
    idx = live_indices(indices, bound_m).to(torch.int64).reshape(-1)
    live = torch.nonzero(idx >= 0).squeeze(1)
    order = torch.argsort(idx[live], stable=True)
    slot = torch.full((T * K,), -1, dtype=torch.int32)
    slot[live[order]] = torch.arange(len(live), dtype=torch.int32)
    counts = torch.bincount(idx[live], minlength=num_experts).to(torch.int32)
    return counts, slot.reshape(T, K)


def live_indices(indices: torch.Tensor, bound_m: int | None) -> torch.Tensor:
    """indices with the rows of tokens t >= bound_m set to -1 (their routes do not exist)."""
    if bound_m is None:
        return indices
    out = indices.clone()
    out[bound_m:] = -1
    return out


def bound_tensor(bound_m: int | None, device=TEST_DEVICE) -> torch.Tensor | None:
    return None if bound_m is None else torch.tensor([bound_m], dtype=torch.int32, device=device)


@dataclass
class DispatchResult:
    counts: torch.Tensor                # [W, E] int32, the routing matrix every rank holds
    route_slot: list[torch.Tensor]      # per rank [T_r, K] int32
    num_tokens: list[torch.Tensor]      # per rank [L] int32
    expert_x: list[torch.Tensor]        # per rank [max_dispatch_rows, H] in_dtype (poison where unwritten)
    expert_x_scale: list[torch.Tensor | None]
    source_ranges: list[torch.Tensor] | None = None  # per rank [L, W] int64 (unpack's out_source_ranges)


def to_device(result: DispatchResult, device) -> DispatchResult:
    """The same result with every tensor on `device`."""
    move = lambda ts: [t if t is None else t.to(device) for t in ts]  # noqa: E731
    return DispatchResult(result.counts.to(device), move(result.route_slot), move(result.num_tokens),
                          move(result.expert_x), move(result.expert_x_scale),
                          None if result.source_ranges is None else move(result.source_ranges))


def to_cpu(result: DispatchResult) -> DispatchResult:
    return to_device(result, "cpu")


def run_dispatch(world: SimWorld, xs, x_scales, indices, bound_ms=None) -> DispatchResult:
    """pack on every rank, transport (private then remainder writes), unpack on every rank."""
    cfg, lay, W = world.cfg, world.layout, world.world_size
    bound_ms = bound_ms or [None] * W
    dev = world.arena.device
    counts_rows, slots = [], []
    for r in range(W):
        row, slot = route_slots(indices[r].cpu(), cfg.num_experts, bound_ms[r])
        counts_rows.append(row)
        slots.append(slot.to(dev))
        # As the route kernel's send rows: a remote peer's first P routes go to its private staging slot.
        stage = torch.from_numpy(plan.private_stage_rows(row.numpy().astype(np.int64), r, lay))
        rows = torch.where(slot >= 0, stage[slot.clamp(min=0).long()], -1).to(torch.int32).to(dev)
        pack_tokens_by_expert(xs[r], x_scales[r], rows, world.arena, world.send_bytes[r], cfg,
                              bound_m=bound_tensor(bound_ms[r], dev),
                              max_slots=lay.max_routes + lay.private_stage_rows)
    counts_np = torch.stack(counts_rows).numpy().astype(np.int64)
    counts = torch.stack(counts_rows).to(dev)
    plan.validate_counts(counts_np, lay)

    # The proxy's part: remote peers only (same-node peers are pulled by unpack). A private write is one
    # range of the sender's private staging region: the count row (the plan kernel puts it there), then
    # the rows the pack put there.
    routes = plan.route_matrix(counts_np, lay)
    row_bytes = lay.routing_row_bytes
    for r in range(W):
        header = torch.from_numpy(counts_np[r].astype(np.int32)).view(torch.uint8).to(dev)
        for peer, src, length, dst in plan.private_writes(counts_np[r], r, lay).tolist():
            at = world.send_bytes[r] + src
            world.arena[at: at + row_bytes] = header
            world.copy(world.send_bytes[r], world.recv_bytes[peer], (peer, src, length, dst))
        for w in plan.remainder_writes(routes, r, lay).tolist():
            world.copy(world.send_bytes[r], world.recv_bytes[w[0]], w)

    R = lay.max_dispatch_rows
    num_tokens, expert_x, expert_x_scale, ranges = [], [], [], []
    for me in range(W):
        n = torch.full((lay.num_local_experts,), -7, dtype=torch.int32, device=dev)
        ex = torch.full((R, cfg.hidden_dim * cfg.in_itemsize), POISON, dtype=torch.uint8,
                        device=dev).view(cfg.in_dtype)
        exs = None
        if cfg.has_scales:
            # Strided on purpose: columns of a wider tensor (the kernel takes any strides for scales).
            exs = torch.full((R, cfg.num_scales + 3), float("nan"), device=dev)[:, 1:1 + cfg.num_scales]
        rng = torch.full((lay.num_local_experts, W), -1, dtype=torch.int64, device=dev)
        unpack_tokens_by_expert(n, ex, exs, counts, me, world.arena,
                                world.peer_table(me, world.send_bytes), world.recv_bytes[me], cfg, lay,
                                out_source_ranges=rng)
        ranges.append(rng)
        num_tokens.append(n)
        expert_x.append(ex)
        expert_x_scale.append(exs)
    return DispatchResult(counts, slots, num_tokens, expert_x, expert_x_scale, ranges)


def run_combine(world: SimWorld, dispatched: DispatchResult, weights, expert_ys, out_tokens=None,
                accumulate: bool = False, bound_ms=None) -> list[torch.Tensor]:
    """pack_combine on every rank, transport (combine writes), reduce on every home rank.

    expert_ys: per rank `[R, H]` out_dtype, rows as dispatch laid them out. out_tokens: per home rank
    `[T, H]` initial contents (required when accumulate; else poison). Returns the out_tokens."""
    cfg, lay, W = world.cfg, world.layout, world.world_size
    bound_ms = bound_ms or [None] * W
    counts_np = dispatched.counts.cpu().numpy().astype(np.int64)
    dev = world.arena.device
    for me in range(W):
        pack_combine_by_source(expert_ys[me], dispatched.counts, me, world.arena,
                               world.peer_table(me, world.recv_bytes),
                               world.send_bytes[me] + lay.combine_stage_offset_bytes, cfg, lay)
    for me in range(W):
        for w in plan.combine_writes(plan.route_matrix(counts_np, lay), me, lay).tolist():
            world.copy(world.send_bytes[me], world.recv_bytes[w[0]], w)  # src includes the stage offset
    outs = []
    for r in range(W):
        T = dispatched.route_slot[r].shape[0]
        if out_tokens is not None:
            out = out_tokens[r].clone()
        else:
            out = torch.full((T, cfg.hidden_dim * cfg.out_itemsize), POISON,
                             dtype=torch.uint8, device=dev).view(cfg.out_dtype)
        reduce_combined_tokens(out, dispatched.route_slot[r], weights[r], world.arena,
                               world.recv_bytes[r] + lay.combine_recv_offset_bytes,
                               cfg, accumulate=accumulate, bound_m=bound_tensor(bound_ms[r], dev))
        outs.append(out)
    return outs


# ================================================================================================
# Test cases: a named configuration and its deterministic inputs
# ================================================================================================
@dataclass(frozen=True)
class Case:
    """One simulated world and its inputs (drawn by hypothesis or written by hand)."""

    world_size: int = 2
    node_size: int = 1
    num_local_experts: int = 3
    experts_per_token: int = 2
    max_num_tokens: int = 4
    num_tokens: tuple[int, ...] = (4, 4)        # T of each rank (<= max_num_tokens; 0 allowed)
    bound_m: tuple[int | None, ...] = (None, None)  # live tokens of each rank (None: all)
    hidden_dim: int = 40
    in_dtype: torch.dtype = torch.bfloat16
    scale_block: int | None = None
    out_dtype: torch.dtype = torch.bfloat16
    expert_padding: int = 1
    max_private_tokens: int | None = None
    index_dtype: torch.dtype = torch.int64
    routing: str = "random"                      # random | topk | one_expert | duplicates
    mask_percent: int = 0                        # share of slots set to -1
    seed: int = 0
    expert_capacity: int | None = None           # fixed rows per local expert (needs expert_padding 1)

    @property
    def cfg(self) -> A2AConfig:
        return A2AConfig(
            max_num_tokens=self.max_num_tokens, num_experts=self.world_size * self.num_local_experts,
            experts_per_token=self.experts_per_token, hidden_dim=self.hidden_dim, in_dtype=self.in_dtype,
            scale_block=self.scale_block, out_dtype=self.out_dtype, expert_padding=self.expert_padding,
            max_private_tokens=self.max_private_tokens, expert_capacity=self.expert_capacity)

    def world(self, device=TEST_DEVICE) -> SimWorld:
        return SimWorld.create(self.cfg, self.world_size, self.node_size, device)


def make_indices(case: Case, gen: torch.Generator, T: int) -> torch.Tensor:
    """[T, K] expert indices of one rank, by `case.routing`, then masked by `case.mask_percent`."""
    E, K = case.world_size * case.num_local_experts, case.experts_per_token
    if case.routing == "random":            # independent draws: duplicates happen naturally
        idx = torch.randint(0, E, (T, K), generator=gen)
    elif case.routing == "topk":            # distinct experts per token where K <= E (a real top-k)
        rows = [torch.randperm(E, generator=gen)[:K] if K <= E else torch.randint(0, E, (K,), generator=gen)
                for _ in range(T)]
        idx = torch.stack(rows) if rows else torch.zeros(0, K, dtype=torch.int64)
    elif case.routing == "one_expert":      # every route of every rank to one expert: private
        idx = torch.full((T, K), E // 2)     # region overflows, the remainder path carries the rest
    elif case.routing == "duplicates":      # each token picks among two experts: repeated in a row
        pair = torch.randint(0, E, (T, 2), generator=gen)
        idx = torch.gather(pair, 1, torch.randint(0, 2, (T, K), generator=gen))
    else:
        raise ValueError(case.routing)
    if case.mask_percent:
        idx[torch.randint(0, 100, (T, K), generator=gen) < case.mask_percent] = -1
    return idx.to(case.index_dtype)


def make_inputs(case: Case, payload: str = "bytes"):
    """(xs, x_scales, indices) of every rank. payload="bytes": random bit patterns (NaNs included:
    the data movement is opaque bytes); "values": finite values, for the combine's arithmetic."""
    cfg = case.cfg
    gen = torch.Generator().manual_seed(case.seed)
    xs, scales, indices = [], [], []
    for T in case.num_tokens:
        if payload == "bytes":
            raw = torch.randint(0, 256, (T, cfg.hidden_dim * cfg.in_itemsize), dtype=torch.uint8, generator=gen)
            xs.append(raw.view(cfg.in_dtype))
        else:
            xs.append((torch.randn(T, cfg.hidden_dim, generator=gen) * 2).to(cfg.in_dtype))
        if cfg.has_scales:
            bits = torch.randint(-2**31, 2**31 - 1, (T, cfg.num_scales), dtype=torch.int32, generator=gen)
            scales.append(bits.view(torch.float32) if payload == "bytes"
                          else torch.rand(T, cfg.num_scales, generator=gen) + 0.5)
        else:
            scales.append(None)
        indices.append(make_indices(case, gen, T))
    return xs, scales, indices


# ================================================================================================
# Hypothesis strategy over cases (sizes bounded so the interpreter stays fast)
# ================================================================================================
FP8 = torch.float8_e4m3fn


@st.composite
def cases(draw, max_world: int = 8) -> Case:
    W = draw(st.sampled_from([w for w in (1, 2, 3, 4, 6, 8) if w <= max_world]))
    node_size = draw(st.sampled_from([d for d in range(1, W + 1) if W % d == 0]))  # 1: all remote, W: all pulled
    L = draw(st.integers(1, 3))                 # E = W*L: rarely a power of two (W=3, 6; L=3)
    K = draw(st.integers(1, 9))
    T_max = draw(st.integers(1, 6))
    num_tokens = tuple(draw(st.sampled_from([0, T_max, draw(st.integers(0, T_max))])) for _ in range(W))
    bound_m = tuple(draw(st.one_of(st.none(), st.integers(0, T))) for T in num_tokens)  # bound_m < T: dead rows
    H = draw(st.sampled_from([1, 5, 24, 40, 100, 136]))   # 1/5: 1-byte words; none a multiple of 128
    in_dtype, scale_block = draw(st.sampled_from([
        (FP8, 128), (FP8, 16), (FP8, None), (torch.bfloat16, None), (torch.bfloat16, 32),
        (torch.float32, None), (torch.float16, 8)]))
    case = Case(
        world_size=W, node_size=node_size, num_local_experts=L, experts_per_token=K, max_num_tokens=T_max,
        num_tokens=num_tokens, bound_m=bound_m, hidden_dim=H, in_dtype=in_dtype, scale_block=scale_block,
        out_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        expert_padding=draw(st.sampled_from([1, 4, 16, 128])),
        # 0: every remote row takes the remainder path; 1: both paths; None: default; 10**6: capped at T*K
        max_private_tokens=draw(st.sampled_from([0, 1, None, 10**6])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        routing=draw(st.sampled_from(["random", "topk", "one_expert", "duplicates"])),
        mask_percent=draw(st.sampled_from([0, 0, 30, 100])),   # 100: nothing routed at all
        seed=draw(st.integers(0, 2**16)),
    )
    # A fixed capacity large enough for anything (every route of every rank to one expert), or none.
    if draw(st.sampled_from([False, False, True])):
        case = dataclasses.replace(case, expert_padding=1, expert_capacity=W * T_max * K)
    return case
