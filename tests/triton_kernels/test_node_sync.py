"""Same-node synchronisation inside the kernels (`node_sync.py`), over simulated ranks of one node.

Every rank's buffers live in one arena (harness.SimWorld), as on a GPU every mapped peer buffer lives
in one address space. The node-local pipeline (route with epoch advance -> pack that publishes ->
unpack that waits -> combine pack that publishes -> reduce that waits) is checked, call after call,
against what node sync must produce, computed without any kernel or harness transport: `reference.py`'s
dispatch (received rows and scales bitwise, padding rows untouched) and combine (weighted sums), the
count matrix every rank's sync area must hold (each source's per-expert counts, a bincount), and the
epoch words every rank's area must hold (docs/protocol.md, 1: `dispatch_ready[s]`, `combine_ready[s]`).
A wait for a peer that never publishes must record which peer was missing, leave the outputs untouched
and stop every later kernel of that rank from moving data.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from moe_a2a import reference
from moe_a2a.config import round_up
from moe_a2a.triton_kernels.combine import pack_combine_by_source, reduce_combined_tokens
from moe_a2a.triton_kernels.dispatch import pack_tokens_by_expert, unpack_tokens_by_expert
from moe_a2a.protocol.words import Flag, flag_word
from moe_a2a.protocol.words import decode_wait_status
from moe_a2a.triton_kernels.node_sync import NodeSync, launch_wait_apart
from moe_a2a.triton_kernels.routing import route_tokens

from ..conftest import TEST_DEVICE, examples
from .harness import FP8, POISON, Case, cases, make_inputs, bound_tensor

# One rounding of out_dtype (relative): compiled kernels may contract the fp32 sum into FMAs (test_combine).
RTOL = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}


def sync_at(world) -> list[int]:
    """Each simulated rank's sync area: at the end of its recv buffer (the all-on-one-node layout)."""
    return [r + world.layout.recv_sync_offset_bytes for r in world.recv_bytes]


def node_syncs(world, timeout_s: float = 30.0, spins: int = 1 << 16, wait_apart: bool = False,
               masks: list | None = None) -> list[NodeSync]:
    lay, dev = world.layout, world.arena.device
    out = []
    for r in range(world.world_size):
        out.append(NodeSync(
            epoch=torch.zeros(1, dtype=torch.int64, device=dev), failed=torch.zeros(1, dtype=torch.int64, device=dev),
            counter=torch.zeros(1, dtype=torch.int32, device=dev),
            flags=torch.zeros(flag_word(Flag.NUM_FLAGS), dtype=torch.int64, device=dev),
            peer_sync_bytes=world.peer_table(r, sync_at(world)), sync_bytes=sync_at(world)[r], rank=r, node_first=0,
            node_size=world.world_size, dispatch_ready_bytes=lay.dispatch_ready_offset_bytes,
            combine_ready_bytes=lay.combine_ready_offset_bytes, counts_bytes=lay.node_counts_offset_bytes,
            num_experts=lay.num_experts, timeout_s=timeout_s, interpreter_spins=spins, wait_apart=wait_apart,
            rank_mask=None if masks is None else masks[r]))
    return out


def status(sync: NodeSync, flag: Flag) -> int:
    return int(sync.flags[flag_word(flag)])


def counts_view(world, r: int) -> torch.Tensor:
    lay = world.layout
    at = sync_at(world)[r] + lay.node_counts_offset_bytes
    return world.arena[at: at + lay.routing_bytes].view(torch.int32).view(lay.world_size, lay.num_experts)


def node_local_call(world, syncs, xs, scales, indices, bound_ms, weights, expert_y_of, ranks=None, before_reduce=None):
    """One dispatch + combine over every rank (or over `ranks`, the others silent), node-local. Returns
    (num_tokens, expert_x, expert_x_scale, out_tokens), each per rank (None for a silent rank).
    `before_reduce(r, slot)`: called between rank r's combine wait and its reduce (shrink mode)."""
    cfg, lay, W, dev = world.cfg, world.layout, world.world_size, world.arena.device
    ranks = list(range(W)) if ranks is None else ranks
    slots = [None] * W
    for r in ranks:
        slot = torch.empty(indices[r].shape, dtype=torch.int32, device=dev)
        route_tokens(indices[r].to(dev), cfg.num_experts, out_counts=counts_view(world, r)[r], out_route_slot=slot,
                     bound_m=bound_tensor(bound_ms[r], dev), epoch=syncs[r].epoch)
        pack_tokens_by_expert(xs[r].to(dev), None if scales[r] is None else scales[r].to(dev), slot, world.arena,
                              world.send_bytes[r], cfg, bound_m=bound_tensor(bound_ms[r], dev), node=syncs[r])
        slots[r] = slot
    nums, exs, exss = [None] * W, [None] * W, [None] * W
    for me in ranks:
        n = torch.full((lay.num_local_experts,), -7, dtype=torch.int32, device=dev)
        ex = torch.full((lay.max_dispatch_rows, cfg.hidden_dim * cfg.in_itemsize), POISON, dtype=torch.uint8,
                        device=dev).view(cfg.in_dtype)
        exs_ = (torch.full((lay.max_dispatch_rows, cfg.num_scales), float("nan"), device=dev)
                if cfg.has_scales else None)
        unpack_tokens_by_expert(n, ex, exs_, counts_view(world, me), me, world.arena,
                                world.peer_table(me, world.send_bytes), world.recv_bytes[me], cfg, lay, node=syncs[me])
        nums[me], exs[me], exss[me] = n, ex, exs_
    for me in ranks:
        pack_combine_by_source(expert_y_of(me, exs[me]), counts_view(world, me), me, world.arena,
                               world.peer_table(me, world.recv_bytes),
                               world.send_bytes[me] + lay.combine_stage_offset_bytes, cfg, lay, node=syncs[me])
    outs = [None] * W
    for r in ranks:
        out = torch.full((indices[r].shape[0], cfg.hidden_dim * cfg.out_itemsize), POISON, dtype=torch.uint8,
                         device=dev).view(cfg.out_dtype)
        if before_reduce is not None:
            launch_wait_apart(syncs[r], "combine_recv", world.arena)
            before_reduce(r, slots[r])
        reduce_combined_tokens(out, slots[r], weights[r].to(dev), world.arena,
                               world.recv_bytes[r] + lay.combine_recv_offset_bytes, cfg,
                               bound_m=bound_tensor(bound_ms[r], dev), node=syncs[r])
        outs[r] = out
    return nums, exs, exss, outs


def toy_y(cfg, rank: int, ex: torch.Tensor) -> torch.Tensor:
    """A deterministic expert output from the rows' bytes (any payload dtype, NaNs included)."""
    y = ex.view(torch.uint8)[:, : cfg.hidden_dim].float() / 64 + rank
    return y.to(cfg.out_dtype).contiguous()


def live(indices: torch.Tensor, bound_m: int | None) -> torch.Tensor:
    """The routes that exist: tokens at or past bound_m route nowhere (the reference has no bound_m)."""
    out = indices.clone()
    if bound_m is not None:
        out[bound_m:] = -1
    return out


@dataclasses.dataclass
class Expected:
    """What one node-synchronised call must leave, from `reference.py` and plain torch only."""

    counts: torch.Tensor        # [W, E] int32: row s = source s's live routes per expert
    dispatched: list            # per rank: reference.dispatch's (num_tokens, expert_x, expert_x_scale)
    starts: list[list[int]]     # per rank: first row of each local expert's segment
    outs: list[torch.Tensor]    # per rank: reference.combine's out_tokens
    n_live: list[int]           # per rank: tokens below bound_m (the rest must stay poison)


def expected_call(case: Case, xs, scales, indices, weights) -> Expected:
    cfg, W = case.cfg, case.world_size
    lives = [live(idx, b) for idx, b in zip(indices, case.bound_m)]
    counts = torch.stack([torch.bincount(idx[idx >= 0].long(), minlength=cfg.num_experts)
                          for idx in lives]).to(torch.int32)
    dispatched = reference.dispatch(cfg, xs, scales if cfg.has_scales else None, lives)
    starts = []
    for n, _, _ in dispatched:  # reference.dispatch's layout: padded segments one after another, or l * C
        seg = [cfg.expert_capacity] * len(n) if cfg.expert_capacity is not None else \
            [round_up(int(c), cfg.expert_padding) for c in n]
        starts.append([sum(seg[:l]) for l in range(len(n))])
    ys = [toy_y(cfg, r, ex) for r, (_, ex, _) in enumerate(dispatched)]
    outs = reference.combine(cfg, lives, weights, ys)
    n_live = [T if b is None else min(b, T) for T, b in zip(case.num_tokens, case.bound_m)]
    return Expected(counts, dispatched, starts, outs, n_live)


def check_call(case: Case, want: Expected, world, syncs, got, call: int) -> None:
    """Every rank's outputs and sync area after call number `call` (its epoch) against `want`."""
    cfg, lay, W = case.cfg, world.layout, case.world_size
    nums, exs, exss, outs = got
    for r in range(W):
        n_ref, x_ref, s_ref = want.dispatched[r]
        at = (call, r)
        assert torch.equal(nums[r].cpu(), n_ref), at
        # Received rows bitwise; padding rows and rows past the received ones never written.
        x_u8, written = exs[r].view(torch.uint8).cpu(), torch.zeros(lay.max_dispatch_rows, dtype=torch.bool)
        for l, a in enumerate(want.starts[r]):
            n = int(n_ref[l])
            written[a:a + n] = True
            assert torch.equal(x_u8[a:a + n], x_ref[a:a + n].view(torch.uint8)), (*at, l)
            if cfg.has_scales:
                assert torch.equal(exss[r][a:a + n].cpu().view(torch.int32), s_ref[a:a + n].view(torch.int32)), (*at, l)
        assert bool((x_u8[~written] == POISON).all()), at
        if cfg.has_scales:
            assert bool(exss[r][~written].isnan().all()), at
        # The weighted sum: bitwise in the interpreter (same fp32 order as the reference), else one rounding.
        n_live, o = want.n_live[r], outs[r].cpu()
        if TEST_DEVICE == "cpu":
            assert torch.equal(o[:n_live].view(torch.uint8), want.outs[r][:n_live].view(torch.uint8)), at
        else:
            torch.testing.assert_close(o[:n_live].float(), want.outs[r][:n_live].float(),
                                       rtol=RTOL[cfg.out_dtype], atol=1e-5, msg=str(at))
        assert bool((o[n_live:].view(torch.uint8) == POISON).all()), at
        # The sync area: every source's count row, and every node rank's two epoch words at this call.
        assert torch.equal(counts_view(world, r).cpu(), want.counts), at
        area = sync_at(world)[r]
        for off in (lay.dispatch_ready_offset_bytes, lay.combine_ready_offset_bytes):
            words = world.arena[area + off: area + off + 8 * W].view(torch.int64).cpu()
            assert words.tolist() == [call] * W, (*at, off, words.tolist())
        assert int(syncs[r].epoch) == call and int(syncs[r].counter) == 0, at
        assert int(syncs[r].failed) == 0 and not bool(syncs[r].flags.any()), at


def check_node_calls(case: Case, wait_apart: bool = False, calls: int = 2) -> None:
    case = dataclasses.replace(case, node_size=case.world_size)
    cfg = case.cfg
    xs, scales, indices = make_inputs(case)
    gen = torch.Generator().manual_seed(case.seed + 1)
    weights = [torch.rand(T, cfg.experts_per_token, generator=gen) for T in case.num_tokens]
    want = expected_call(case, xs, scales, indices, weights)
    world = case.world(TEST_DEVICE)
    syncs = node_syncs(world, wait_apart=wait_apart)
    for call in range(1, calls + 1):  # later calls reuse every buffer, flag and counter (epoch 2, ...)
        got = node_local_call(world, syncs, xs, scales, indices, list(case.bound_m), weights,
                              lambda me, ex: toy_y(cfg, me, ex))
        check_call(case, want, world, syncs, got, call)


@pytest.mark.timeout(300)
@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_world=4))
def test_node_synchronised_calls_match_the_reference(case: Case) -> None:
    check_node_calls(case)


# Named cases, always run: what hypothesis may not draw.
EDGE_CASES = [
    # Four ranks, fp8 with scales, masked routes, a dead tail on two ranks, one rank with no tokens.
    pytest.param(Case(world_size=4, node_size=4, num_local_experts=2, experts_per_token=3, max_num_tokens=5,
                      num_tokens=(5, 0, 3, 5), bound_m=(2, None, None, 4), hidden_dim=24, in_dtype=FP8,
                      scale_block=16, expert_padding=4, mask_percent=30, seed=3), id="W4-FP8-S2-MASKED-BOUND"),
    # Fixed capacity per expert (segments at l * C) and every route to one expert.
    pytest.param(Case(world_size=3, node_size=3, num_local_experts=1, experts_per_token=2, max_num_tokens=3,
                      num_tokens=(3, 3, 2), bound_m=(None,) * 3, routing="one_expert", expert_capacity=18,
                      out_dtype=torch.float32), id="W3-CAPACITY-ONE_EXPERT"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", EDGE_CASES)
def test_node_synchronised_edge_cases(case: Case) -> None:
    check_node_calls(case)


@pytest.mark.timeout(120)
def test_waits_in_a_kernel_of_their_own_give_the_reference_calls() -> None:
    """`wait_apart` (words in host memory): one small kernel waits before each data kernel."""
    check_node_calls(Case(world_size=3, node_size=3, max_num_tokens=8, num_tokens=(5, 0, 7), bound_m=(None, None, 4)),
                     wait_apart=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait_apart", [False, True], ids=["prologue", "apart"])
def test_a_missing_peer_is_named_and_stops_the_rank(wait_apart: bool) -> None:
    case = Case(world_size=3, node_size=3, num_tokens=(4, 4, 4), bound_m=(None,) * 3)
    cfg, lay = case.cfg, case.world().layout
    world = case.world(TEST_DEVICE)
    syncs = node_syncs(world, timeout_s=0.05, spins=3, wait_apart=wait_apart)
    xs, scales, indices = make_inputs(case)
    dev = world.arena.device
    slot = torch.empty(indices[0].shape, dtype=torch.int32, device=dev)
    for r in (0, 1):  # rank 2 never publishes
        route_tokens(indices[r].to(dev), cfg.num_experts, out_counts=counts_view(world, r)[r], out_route_slot=slot,
                     epoch=syncs[r].epoch)
        pack_tokens_by_expert(xs[r].to(dev), None, slot, world.arena, world.send_bytes[r], cfg, node=syncs[r])
    n = torch.full((lay.num_local_experts,), -7, dtype=torch.int32, device=dev)
    ex = torch.full((lay.max_dispatch_rows, cfg.hidden_dim), 3.0, dtype=cfg.in_dtype, device=dev)
    unpack_tokens_by_expert(n, ex, None, counts_view(world, 0), 0, world.arena,
                            world.peer_table(0, world.send_bytes), world.recv_bytes[0], cfg, lay, node=syncs[0])
    code = status(syncs[0], Flag.STATUS_DISPATCH_RECV)
    assert decode_wait_status(code, 0) == ([2], False), code
    assert int(syncs[0].failed) == 1
    assert bool((n.cpu() == -7).all()) and bool((ex.cpu() == 3.0).all())  # nothing written

    # A failed rank neither moves data nor tells its peers anything any more.
    ready_at = sync_at(world)[1] + lay.combine_ready_offset_bytes
    before = world.arena[ready_at: ready_at + 8 * 3].clone()
    y = torch.zeros(lay.max_dispatch_rows, cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
    pack_combine_by_source(y, counts_view(world, 0), 0, world.arena, world.peer_table(0, world.recv_bytes),
                           world.send_bytes[0], cfg, lay, node=syncs[0])
    assert torch.equal(world.arena[ready_at: ready_at + 8 * 3], before)
    assert int(syncs[0].counter) == 0  # the epilogue still ran to the end (counter reset)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_shrink_masks_a_silent_peer_in_the_kernels_own_wait(in_dtype) -> None:
    """Shrink mode with kernel waits (`NodeSync.rank_mask`): rank 2 stops; the separate waits of ranks 0
    and 1 mask it at their deadline instead of failing, zero its count row (garbage planted there), and
    the call goes on without it: received rows and combined tokens equal the reference's with rank 2's
    tokens absent and the routes to its experts dropped. The next call passes without waiting for it."""
    case = Case(world_size=3, node_size=3, max_num_tokens=6, num_tokens=(5, 4, 6), bound_m=(None,) * 3, in_dtype=in_dtype,
                hidden_dim=32, scale_block=16 if in_dtype == FP8 else None, seed=11)
    cfg = case.cfg
    world = case.world(TEST_DEVICE)
    lay, dev, L = world.layout, world.arena.device, world.layout.num_local_experts
    masks = [torch.zeros(3, dtype=torch.int32, device=dev) for _ in range(3)]
    syncs = node_syncs(world, timeout_s=0.05, spins=3, wait_apart=True, masks=masks)
    xs, scales, indices = make_inputs(case)
    gen = torch.Generator().manual_seed(5)
    weights = [torch.rand(T, cfg.experts_per_token, generator=gen) for T in case.num_tokens]
    for r in (0, 1):
        counts_view(world, r)[2] = 5  # what a stopped peer may have left: must not be read
    silent = [idx.clone() for idx in indices]
    silent[2] = torch.full_like(indices[2], -1)  # rank 2 sends nothing
    want = expected_call(dataclasses.replace(case), xs, scales, silent, weights)
    dropped = [torch.where((idx >= 0) & (idx // L == 2), -1, idx) for idx in silent]
    outs_ref = reference.combine(cfg, dropped, weights,
                                 [toy_y(cfg, r, ex) for r, (_, ex, _) in enumerate(want.dispatched)])

    def drop_slots(r, slot):
        slot.masked_fill_((indices[r].to(dev) >= 0) & (masks[r][(indices[r].to(dev) // L).clamp(min=0)] != 0), -1)

    for call in (1, 2):
        nums, exs, exss, outs = node_local_call(world, syncs, xs, scales, indices, [None] * 3, weights,
                                                lambda me, ex: toy_y(cfg, me, ex), ranks=[0, 1],
                                                before_reduce=drop_slots)
        for r in (0, 1):
            at = (call, r)
            assert masks[r].tolist() == [0, 0, 1], at
            assert int(syncs[r].failed) == 0 and not bool(syncs[r].flags.any()), at
            assert counts_view(world, r)[2].tolist() == [0] * lay.num_experts, at
            n_ref, x_ref, s_ref = want.dispatched[r]
            assert torch.equal(nums[r].cpu(), n_ref), at
            for l, a in enumerate(want.starts[r]):
                n = int(n_ref[l])
                assert torch.equal(exs[r].view(torch.uint8).cpu()[a:a + n], x_ref[a:a + n].view(torch.uint8)), (*at, l)
                if cfg.has_scales:
                    assert torch.equal(exss[r][a:a + n].cpu(), s_ref[a:a + n]), (*at, l)
            o = outs[r].cpu()
            if TEST_DEVICE == "cpu":
                assert torch.equal(o.view(torch.uint8), outs_ref[r].view(torch.uint8)), at
            else:
                torch.testing.assert_close(o.float(), outs_ref[r].float(), rtol=RTOL[cfg.out_dtype], atol=1e-5)
