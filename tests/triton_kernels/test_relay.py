"""The relay's kernels (docs/protocol.md, 3.8; `triton_kernels/relay.py`) over W simulated ranks of 2-4 nodes in
one arena (relay_harness.py: the real kernels, the proxy's writes as slice copies of `plan`'s relay writes),
against reference.py: every rank's dispatch output is `reference.dispatch`'s bit for bit, the combined tokens
`reference.combine_relay`'s (bf16 and fp8 rows), the wire carries one row per (token, remote node) to the
source's relay there (`reference.dispatch_relay(...).network`) and nothing to any other rank of another node.
Random routings with -1 routes, duplicated experts and skew, P small enough for remainder writes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_a2a import reference
from moe_a2a.config import A2AConfig
from moe_a2a.protocol import plan
from moe_a2a.triton_kernels.rank_rows import expand_rank_rows
from moe_a2a.triton_kernels.relay import reduce_relayed_rows

from ..conftest import TEST_DEVICE
from .harness import FP8, POISON
from .relay_harness import RelayRun

pytestmark = pytest.mark.timeout(120)


def _cfg(W: int, L: int, K: int, T: int, H: int, in_fp8: bool, fp8: bool, P: int,
         out_dtype: torch.dtype = torch.bfloat16) -> A2AConfig:
    return A2AConfig(max_num_tokens=T, num_experts=W * L, experts_per_token=K, hidden_dim=H,
                     in_dtype=FP8 if in_fp8 else torch.bfloat16, out_dtype=out_dtype, dispatch_rows="rank",
                     combine_rows="rank", combine_fp8=fp8, max_private_tokens=P)


def _inputs(cfg: A2AConfig, W: int, tokens, routing: str, mask: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    E, K, H, L = cfg.num_experts, cfg.experts_per_token, cfg.hidden_dim, cfg.num_experts // W
    xs, scales, idxs, ws = [], [], [], []
    hot = int(torch.randint(0, W, (1,), generator=g))
    for n in tokens:
        xs.append((torch.randn(n, H, generator=g) * 2).to(cfg.in_dtype))
        scales.append(torch.rand(n, cfg.num_scales, generator=g) + 0.5 if cfg.has_scales else None)
        if routing == "skew":          # every route to one rank's experts: its relays take the remainder path
            idx = torch.randint(hot * L, (hot + 1) * L, (n, K), generator=g)
        elif routing == "duplicates":  # a token picks among two experts: repeated ids in a row
            pair = torch.randint(0, E, (n, 2), generator=g)
            idx = torch.gather(pair, 1, torch.randint(0, 2, (n, K), generator=g))
        else:
            idx = torch.randint(0, E, (n, K), generator=g)
        if mask:
            idx[torch.randint(0, 100, (n, K), generator=g) < mask] = -1
        idxs.append(idx)
        ws.append(torch.rand(n, K, generator=g))
    return xs, scales, idxs, ws


def _check(cfg: A2AConfig, W: int, ns: int, tokens, routing: str, mask: int, seed: int, row_plan: bool = True) -> None:
    xs, scales, idxs, ws = _inputs(cfg, W, tokens, routing, mask, seed)
    run = RelayRun.create(cfg, W, ns, row_plan=row_plan)
    got = run.dispatch(xs, scales, idxs, ws)
    want = reference.dispatch(cfg, xs, scales if cfg.has_scales else None, idxs)
    for d in range(W):
        (num, ex, exs), (rnum, rex, rexs) = [tuple(t if t is None else t.cpu() for t in v) for v in (got[d], want[d])]
        assert torch.equal(num, rnum), (d, num, rnum)
        assert torch.equal(ex[:rex.shape[0]].view(torch.uint8), rex.view(torch.uint8)), d
        if cfg.has_scales:
            assert torch.equal(exs[:rex.shape[0]], rexs), d

    # The wire: one row per (token, remote node), to the relay only; nothing to any other rank of another node.
    lay, rows = run.layout, run.rows()
    network = reference.dispatch_relay(cfg, xs, scales if cfg.has_scales else None, idxs, ns, ws).network
    sent = {}
    for phase, s, q, n in run.writes:
        if phase != "combine":
            sent[(s, q)] = sent.get((s, q), 0) + n
    for (s, q), hop1 in network.items():
        assert rows[s, q] == sent[(s, q)] == len(hop1.tokens), (s, q, rows[s, q], sent.get((s, q)), len(hop1.tokens))
    arena = run.world.arena.cpu()
    for s in range(W):
        for q in lay.remote_peers(s):
            if q != reference.relay_rank(s, q // ns, ns):
                assert rows[s, q] == 0 and (s, q) not in sent, (s, q)
                at = run.world.recv_bytes[q] + lay.private_header_offset_bytes(s)
                slot = arena[at: at + lay.routing_row_bytes + lay.private_rows * lay.dispatch_stride_bytes]
                assert bool((slot == POISON).all()), (s, q)  # its private slot there was never written

    g = torch.Generator().manual_seed(seed + 1)
    ys = [torch.randn(out[1].shape[0], cfg.hidden_dim, generator=g).to(cfg.out_dtype) for out in got]
    tokens_out = run.combine(ys)
    ref = reference.combine_relay(cfg, idxs, ws, ys, ns, fp8=cfg.combine_fp8)
    for s in range(W):
        assert torch.equal(tokens_out[s].cpu(), ref[s]), (s, (tokens_out[s].cpu().float() - ref[s].float()).abs().max())
    # one combine row per (token, remote node), from the relay back to its rail's home
    combined = {(q, s): n for phase, q, s, n in run.writes if phase == "combine"}
    for (s, q), hop1 in network.items():
        assert combined[(q, s)] == len(hop1.tokens), (q, s)


@st.composite
def relay_cases(draw):
    nodes = draw(st.integers(2, 4))
    ns = draw(st.integers(1, 4 if nodes == 2 else 2))   # W <= 8: the interpreter's budget
    W, T = nodes * ns, draw(st.integers(1, 5))
    cfg = _cfg(W, draw(st.integers(1, 2)), draw(st.integers(1, 4)), T, draw(st.sampled_from([40, 136])),
               draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from([0, 1, 2])))
    tokens = tuple(draw(st.sampled_from([0, T, draw(st.integers(0, T))])) for _ in range(W))
    return cfg, W, ns, tokens, draw(st.sampled_from(["random", "skew", "duplicates"])), \
        draw(st.sampled_from([0, 30])), draw(st.integers(0, 2**16))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=relay_cases())
def test_relay_matches_reference(case) -> None:
    _check(*case)


# Hand-picked: every path at least once, whatever hypothesis draws (remainders, fp8 rows, 4 nodes, 4 a node).
@pytest.mark.parametrize("W, ns, L, K, fp8, in_fp8, P, routing, out_dtype", [
    (4, 2, 2, 3, False, False, 0, "skew", torch.bfloat16),       # every row a remainder; one hot rank
    (4, 2, 1, 4, True, True, 1, "duplicates", torch.bfloat16),   # fp8 rows both ways, duplicated experts
    (8, 4, 1, 4, True, False, 2, "random", torch.bfloat16),      # two nodes of four: up to four partials a row
    (8, 2, 2, 3, False, False, 1, "random", torch.bfloat16),     # four nodes of two
    (3, 1, 2, 2, False, True, 0, "random", torch.bfloat16),      # one rank a node: the relay is the expert rank
    # fp32 rows: nothing rounds the relay's sum away, so its order (ascending rank) shows
    (8, 4, 1, 6, False, False, 1, "random", torch.float32),
])
def test_relay_paths(W, ns, L, K, fp8, in_fp8, P, routing, out_dtype) -> None:
    T = 5
    cfg = _cfg(W, L, K, T, 136 if fp8 else 40, in_fp8, fp8, P, out_dtype)
    _check(cfg, W, ns, (T,) * (W - 1) + (3,), routing, 0 if out_dtype == torch.float32 else 20, W * 7 + K)


# The reduce by source without the expand's row plan (its expert rows worked out from the counts again): the same
# bytes (the hand-picked cases above read the plan).
@pytest.mark.parametrize("W, ns, L, K, fp8, P, routing", [
    (4, 2, 2, 3, False, 0, "skew"),
    (8, 4, 1, 4, True, 2, "random"),
])
def test_relay_reduce_without_the_row_plan(W, ns, L, K, fp8, P, routing) -> None:
    T = 5
    cfg = _cfg(W, L, K, T, 136 if fp8 else 40, False, fp8, P, torch.bfloat16)
    _check(cfg, W, ns, (T,) * (W - 1) + (3,), routing, 20, W * 7 + K, row_plan=False)


# Several chunks of the hidden dimension a program (`rank_rows.REDUCE_H_CHUNKS`), in both reduces: small chunks,
# so that a program walks 2 or 3 of them, programs of axis 1 each start past the chunks of the ones before, and the
# last program's last chunk lies past H (bf16: 8-element chunks of H = 40, 3 or 2 programs; fp8 rows: 128-element
# blocks of H = 136). The same bytes as one chunk a program.
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("W, ns, L, K, fp8, P, routing", [
    (4, 2, 2, 3, False, 0, "skew"),
    (8, 4, 1, 4, True, 2, "random"),
])
def test_relay_reduces_walk_several_hidden_chunks_a_program(monkeypatch, chunks, W, ns, L, K, fp8, P, routing) -> None:
    from moe_a2a.triton_kernels import rank_rows

    monkeypatch.setattr(rank_rows, "MAX_REDUCE_BLOCK_H", 16 if TEST_DEVICE == "cuda" else 8)  # (halved on a GPU)
    monkeypatch.setattr(rank_rows, "REDUCE_H_CHUNKS", chunks)
    T = 5
    cfg = _cfg(W, L, K, T, 136 if fp8 else 40, False, fp8, P, torch.bfloat16)
    device = torch.device(TEST_DEVICE)
    grid, _, block_h, args, _ = rank_rows.reduce_launch_shape(cfg, cfg.layout(W, ns), device)
    assert block_h == (128 if fp8 else 8) and args.get("H_CHUNKS") == min(chunks, -(-cfg.hidden_dim // block_h))
    assert grid[1] == -(-cfg.hidden_dim // (block_h * args["H_CHUNKS"]))
    _check(cfg, W, ns, (T,) * (W - 1) + (3,), routing, 20, W * 7 + K)


# ---- the plan's arithmetic and the layout --------------------------------------------------------------
def _brute_bases(rows: np.ndarray, rank: int, ns: int) -> list[int]:
    W, node = rows.shape[0], rank // ns
    out, acc = [], 0
    for s in range(W):
        if s // ns == node:
            out.append(-1)
            continue
        out.append(acc)
        acc += int(rows[s, node * ns + s % ns])
    return out


@pytest.mark.parametrize("W, ns", [(4, 2), (6, 3), (8, 2), (3, 1)])
def test_relay_plan_arithmetic(W: int, ns: int) -> None:
    cfg = _cfg(W, 2, 3, 6, 40, False, False, 2)
    lay = cfg.layout(W, ns, relay=True)
    rng = np.random.default_rng(W * 10 + ns)
    rows = np.zeros((W, W), dtype=np.int64)
    for s in range(W):
        for q in range(W):
            if q // ns == s // ns or q == reference.relay_rank(s, q // ns, ns):
                rows[s, q] = rng.integers(0, 7)
    for r in range(W):
        assert plan.relay_partial_bases(rows, r, lay).tolist() == _brute_bases(rows, r, ns)
        relays = [reference.relay_rank(r, n, ns) for n in range(W // ns) if n != r // ns]
        assert plan.relay_peers(lay, r).tolist() == relays
        assert sorted(plan.relay_expected_combine_imms(lay, r)) == relays
        private = plan.relay_private_writes(rows, r, lay)
        assert private[:, 0].tolist() == relays
        assert (private[:, 2] == lay.routing_row_bytes + np.minimum(rows[r, relays], 2) * lay.dispatch_stride_bytes).all()
        for peer, src, length, dst in plan.relay_remainder_writes(rows, r, lay).tolist():
            before = sum(max(int(rows[s, peer]) - 2, 0) for s in range(r) if s // ns != peer // ns)
            assert dst == (W * lay.private_slot_rows + before) * lay.dispatch_stride_bytes
            assert length == (rows[r, peer] - 2) * lay.dispatch_stride_bytes
        relayed = [s for s in range(W) if s // ns != r // ns and s % ns == r % ns]
        assert plan.relayed_sources(lay, r).tolist() == relayed
        assert plan.relay_expected_dispatch_imms(rows, r, lay) == {s: 1 + int(rows[s, r] > 2) for s in relayed}
        assert plan.relay_combine_writes(rows, r, lay)[:, 0].tolist() == relayed


def test_relay_layout() -> None:
    cfg = _cfg(8, 2, 3, 6, 40, False, False, 2)
    plain, relay = cfg.layout(8, 2), cfg.layout(8, 2, relay=True)
    assert not plain.relay and plain.relay_partial_rows == 0 and plain.relay_partial_offset_bytes <= plain.send_bytes
    assert relay.relay_partial_rows == 6 * 6 and relay.relay_partial_stride_bytes == 160
    assert relay.relay_partial_offset_bytes == plain.relay_partial_offset_bytes
    assert relay.send_bytes >= relay.relay_partial_offset_bytes + 36 * 160 > plain.send_bytes - 4096
    assert relay.recv_bytes == plain.recv_bytes and relay.combine_stage_offset_bytes == plain.combine_stage_offset_bytes
    assert cfg.layout(8, 8, relay=True).relay_partial_rows == 0  # one node: nothing to relay
    for bad in (A2AConfig(num_experts=16, dispatch_rows="rank"), A2AConfig(num_experts=16)):
        with pytest.raises(ValueError, match="relay"):
            bad.layout(8, 2, relay=True)


def test_relay_launchers_refuse_a_plain_layout() -> None:
    cfg = _cfg(4, 2, 3, 6, 40, False, False, 2)
    lay = cfg.layout(4, 2)
    base = torch.zeros(64, dtype=torch.uint8, device=TEST_DEVICE)
    table = torch.full((4,), -1, dtype=torch.int64, device=TEST_DEVICE)
    rows = torch.zeros(4, 4, dtype=torch.int32, device=TEST_DEVICE)
    with pytest.raises(ValueError, match="relay"):
        reduce_relayed_rows(rows, 0, base, table, 0, 0, cfg, lay)
    with pytest.raises(ValueError, match="peer_recv_bytes"):
        expand_rank_rows(torch.zeros(2, dtype=torch.int32, device=TEST_DEVICE),
                         torch.zeros(8, 40, dtype=torch.bfloat16, device=TEST_DEVICE), None,
                         torch.zeros(4, 8, dtype=torch.int32, device=TEST_DEVICE), rows, 0, base, table, 0, cfg, lay,
                         peer_recv_bytes=table)
