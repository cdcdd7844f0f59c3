"""Same-node synchronisation inside the kernels (`node_sync.py`), over simulated ranks of one node.

Every rank's buffers live in one arena (harness.SimWorld), as on a GPU every mapped peer buffer lives
in one address space. The node-local pipeline (route with epoch advance -> pack that publishes ->
unpack that waits -> combine pack that publishes -> reduce that waits) must give exactly what the
proxy-path pipeline of the harness gives (itself checked against `reference.py` by test_dispatch and
test_combine), call after call; a wait for a peer that never publishes must record which peer was
missing, leave the outputs untouched and stop every later kernel of that rank from moving data.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from moe_a2a.triton_kernels.combine import pack_combine_by_source, reduce_combined_tokens
from moe_a2a.triton_kernels.dispatch import pack_tokens_by_expert, unpack_tokens_by_expert
from moe_a2a.protocol.words import Flag, flag_word
from moe_a2a.protocol.words import decode_wait_status
from moe_a2a.triton_kernels.node_sync import NodeSync
from moe_a2a.triton_kernels.routing import route_tokens

from ..conftest import TEST_DEVICE, examples
from .harness import POISON, Case, cases, make_inputs, run_combine, run_dispatch, bound_tensor


def sync_at(world) -> list[int]:
    """Each simulated rank's sync area: at the end of its recv buffer (the all-on-one-node layout)."""
    return [r + world.layout.recv_sync_offset_bytes for r in world.recv_bytes]


def node_syncs(world, timeout_s: float = 30.0, spins: int = 1 << 16, wait_apart: bool = False) -> list[NodeSync]:
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
            num_experts=lay.num_experts, timeout_s=timeout_s, interpreter_spins=spins, wait_apart=wait_apart))
    return out


def status(sync: NodeSync, flag: Flag) -> int:
    return int(sync.flags[flag_word(flag)])


def counts_view(world, r: int) -> torch.Tensor:
    lay = world.layout
    at = sync_at(world)[r] + lay.node_counts_offset_bytes
    return world.arena[at: at + lay.routing_bytes].view(torch.int32).view(lay.world_size, lay.num_experts)


def node_local_call(world, syncs, xs, scales, indices, bound_ms, weights, expert_y_of):
    """One dispatch + combine over every rank, node-local. Returns (num_tokens, expert_x, out_tokens)."""
    cfg, lay, W, dev = world.cfg, world.layout, world.world_size, world.arena.device
    slots = []
    for r in range(W):
        slot = torch.empty(indices[r].shape, dtype=torch.int32, device=dev)
        route_tokens(indices[r].to(dev), cfg.num_experts, out_counts=counts_view(world, r)[r], out_route_slot=slot,
                     bound_m=bound_tensor(bound_ms[r], dev), epoch=syncs[r].epoch)
        pack_tokens_by_expert(xs[r].to(dev), None if scales[r] is None else scales[r].to(dev), slot, world.arena,
                              world.send_bytes[r], cfg, bound_m=bound_tensor(bound_ms[r], dev), node=syncs[r])
        slots.append(slot)
    nums, exs = [], []
    for me in range(W):
        n = torch.full((lay.num_local_experts,), -7, dtype=torch.int32, device=dev)
        ex = torch.full((lay.max_dispatch_rows, cfg.hidden_dim * cfg.in_itemsize), POISON, dtype=torch.uint8,
                        device=dev).view(cfg.in_dtype)
        exs_ = (torch.full((lay.max_dispatch_rows, cfg.num_scales), float("nan"), device=dev)
                if cfg.has_scales else None)
        unpack_tokens_by_expert(n, ex, exs_, counts_view(world, me), me, world.arena,
                                world.peer_table(me, world.send_bytes), world.recv_bytes[me], cfg, lay, node=syncs[me])
        nums.append(n)
        exs.append(ex)
    for me in range(W):
        pack_combine_by_source(expert_y_of(me, exs[me]), counts_view(world, me), me, world.arena,
                               world.peer_table(me, world.recv_bytes),
                               world.send_bytes[me] + lay.combine_stage_offset_bytes, cfg, lay, node=syncs[me])
    outs = []
    for r in range(W):
        out = torch.full((indices[r].shape[0], cfg.hidden_dim * cfg.out_itemsize), POISON, dtype=torch.uint8,
                         device=dev).view(cfg.out_dtype)
        reduce_combined_tokens(out, slots[r], weights[r].to(dev), world.arena,
                               world.recv_bytes[r] + lay.combine_recv_offset_bytes, cfg,
                               bound_m=bound_tensor(bound_ms[r], dev), node=syncs[r])
        outs.append(out)
    return nums, exs, outs


def toy_y(cfg, rank: int, ex: torch.Tensor) -> torch.Tensor:
    """A deterministic expert output from the rows' bytes (any payload dtype, NaNs included)."""
    y = ex.view(torch.uint8)[:, : cfg.hidden_dim].float() / 64 + rank
    return y.to(cfg.out_dtype).contiguous()


@pytest.mark.timeout(300)
@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_world=4))
def test_node_synchronised_calls_equal_the_harness_path(case: Case) -> None:
    case = dataclasses.replace(case, node_size=case.world_size)
    cfg, W = case.cfg, case.world_size
    xs, scales, indices = make_inputs(case)
    bound_ms = list(case.bound_m)
    gen = torch.Generator().manual_seed(case.seed + 1)
    weights = [torch.rand(T, cfg.experts_per_token, generator=gen) for T in case.num_tokens]

    ref_world = case.world(TEST_DEVICE)
    want = run_dispatch(ref_world, [x.to(TEST_DEVICE) for x in xs],
                        [s if s is None else s.to(TEST_DEVICE) for s in scales], indices, bound_ms)
    want_out = run_combine(ref_world, want, [w.to(TEST_DEVICE) for w in weights],
                           [toy_y(cfg, r, want.expert_x[r]) for r in range(W)], bound_ms=bound_ms)

    world = case.world(TEST_DEVICE)
    syncs = node_syncs(world)
    for call in (1, 2):  # the second call reuses every buffer, flag and counter (epoch 2)
        nums, exs, outs = node_local_call(world, syncs, xs, scales, indices, bound_ms, weights,
                                          lambda me, ex: toy_y(cfg, me, ex))
        for r in range(W):
            assert torch.equal(nums[r].cpu(), want.num_tokens[r].cpu()), (call, r)
            assert torch.equal(exs[r].view(torch.uint8).cpu(), want.expert_x[r].view(torch.uint8).cpu()), (call, r)
            assert torch.equal(outs[r].view(torch.uint8).cpu(), want_out[r].view(torch.uint8).cpu()), (call, r)
            assert int(syncs[r].epoch) == call and int(syncs[r].counter) == 0
            assert int(syncs[r].failed) == 0 and not bool(syncs[r].flags.any())


@pytest.mark.timeout(120)
def test_waits_in_a_kernel_of_their_own_give_the_same_calls() -> None:
    """`wait_apart` (words in host memory): one small kernel waits before each data kernel."""
    case = Case(world_size=3, node_size=3, max_num_tokens=8, num_tokens=(5, 0, 7), bound_m=(None, None, 4))
    cfg, W = case.cfg, case.world_size
    xs, scales, indices = make_inputs(case)
    weights = [torch.rand(T, cfg.experts_per_token, generator=torch.Generator().manual_seed(T)) for T in case.num_tokens]
    outs = {}
    for apart in (False, True):
        world = case.world(TEST_DEVICE)
        syncs = node_syncs(world, wait_apart=apart)
        for _ in (1, 2):
            outs[apart] = node_local_call(world, syncs, xs, scales, indices, list(case.bound_m), weights,
                                          lambda me, ex: toy_y(cfg, me, ex))
        assert all(int(s.failed) == 0 and int(s.epoch) == 2 for s in syncs)
    for a, b in zip(outs[False], outs[True]):
        for r in range(W):
            assert torch.equal(a[r].view(torch.uint8).cpu(), b[r].view(torch.uint8).cpu())


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
