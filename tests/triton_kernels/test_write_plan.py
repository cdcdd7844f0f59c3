"""The write tables the kernels fill for the proxy equal `protocol.plan`'s writes, for random routings."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe_a2a.config import A2AConfig
from moe_a2a.protocol import plan
from moe_a2a.protocol.words import HALF_FLAGS, Flag, Imm, WriteTable, decode_wait_status, encode_imm, flag_word
from moe_a2a.triton_kernels import write_plan
from moe_a2a.triton_kernels.node_sync import NodeSync

from ..conftest import TEST_DEVICE as DEVICE


def _node(lay, rank, epoch, flags, kernel_waits, spins=1 << 16):
    dev = flags.device
    return NodeSync(epoch=torch.tensor([epoch], dtype=torch.int64, device=dev),
                    failed=torch.zeros(1, dtype=torch.int64, device=dev),
                    counter=torch.zeros(2, dtype=torch.int32, device=dev), flags=flags,
                    peer_sync_bytes=torch.full((lay.world_size,), -1, dtype=torch.int64, device=dev), sync_bytes=0,
                    rank=rank, node_first=lay.node_of(rank) * lay.node_size, node_size=lay.node_size,
                    dispatch_ready_bytes=0, combine_ready_bytes=0, counts_bytes=0, num_experts=lay.num_experts,
                    timeout_s=5.0, with_proxy=True, kernel_waits=kernel_waits, interpreter_spins=spins)


def _random_counts(rng, lay, T, K, skew):
    """[W, E] count rows as the route kernel writes them; skew sends every route to one expert (remainders)."""
    W, E = lay.world_size, lay.num_experts
    counts = np.zeros((W, E), np.int64)
    for s in range(W):
        n = rng.integers(0, T + 1) * K
        experts = np.full(n, rng.integers(0, E)) if skew else rng.integers(-1, E, n)
        counts[s] = np.bincount(experts[experts >= 0], minlength=E)
    return counts


def _expected(counts, rank, lay, epoch):
    """[3, W, 4] int64: plan.py's rows (+ immediates) for the remote peers, zero elsewhere."""
    W, P = lay.world_size, lay.private_rows
    out = np.zeros((int(WriteTable.NUM_TABLES), W, 4), np.int64)
    routes = plan.route_matrix(counts, lay)
    for peer, src, n, dst in plan.private_writes(counts[rank], rank, lay).tolist():
        more = routes[rank, peer] > P
        out[WriteTable.PRIVATE, peer] = (src, n, dst, encode_imm(Imm.DISPATCH_MORE if more else Imm.DISPATCH, rank, epoch))
    for peer, src, n, dst in plan.remainder_writes(routes, rank, lay).tolist():
        out[WriteTable.REMAINDER, peer] = (src, n, dst, encode_imm(Imm.DISPATCH_REMAINDER, rank, epoch))
    for peer, src, n, dst in plan.combine_writes(routes, rank, lay).tolist():
        out[WriteTable.COMBINE, peer] = (src, n, dst, encode_imm(Imm.COMBINE, rank, epoch))
    return out


RECV_BYTES = 64  # where the recv buffer starts in `base` (not 0: the offset must be honoured)


def _recv_buffer(counts_np, rank, lay):
    """A recv buffer (in a uint8 `base`) whose private slots hold the remote sources' count rows as their
    private writes left them, and a routing area holding only this rank's and its node peers' rows (the
    remote ones poisoned: the plan kernel must copy them in)."""
    W, E = lay.world_size, lay.num_experts
    nbytes = RECV_BYTES + lay.private_header_offset_bytes(W - 1) + lay.routing_row_bytes
    base = torch.full((nbytes,), 0x5A, dtype=torch.uint8)
    counts = torch.tensor(counts_np, dtype=torch.int32)
    for s in lay.remote_peers(rank):
        at = RECV_BYTES + lay.private_header_offset_bytes(s)
        base[at: at + 4 * E] = counts[s].view(torch.uint8)
        counts[s] = -12345
    return base.to(DEVICE), counts.to(DEVICE)


def _plan(counts_np, rank, lay, epoch, kernel_waits):
    flags = torch.zeros(flag_word(Flag.NUM_FLAGS), dtype=torch.int64, device=DEVICE)
    flags[flag_word(Flag.COUNT_ROWS_READY)] = epoch  # the proxy's word: every private write has landed
    node = _node(lay, rank, epoch, flags, kernel_waits)
    base, counts = _recv_buffer(counts_np, rank, lay)
    # Poisoned: every row the kernels own must be written (zeros for same-node peers).
    tables = torch.full((int(WriteTable.NUM_TABLES), 1, lay.world_size, 4), -7, dtype=torch.int64, device=DEVICE)
    write_plan.plan_private_writes(counts, tables, node.epoch, flags, rank, lay)
    write_plan.plan_remainder_and_combine_writes(counts, tables, node, base, RECV_BYTES, rank, lay)
    assert int(flags[flag_word(Flag.REMAINDER_PLANNED)]) == epoch
    assert int(node.failed) == 0
    # the remote rows are in the routing area now, as they arrived
    np.testing.assert_array_equal(counts.cpu().numpy(), counts_np)
    routes = plan.route_matrix(np.maximum(counts_np, 0), lay)
    assert int(flags[flag_word(Flag.REMAINDER_WRITES)]) == sum(
        int(routes[rank, p] > lay.private_rows) for p in lay.remote_peers(rank))
    return tables.cpu().numpy()[:, 0]  # whole writes: one piece


# W up to 256 (the largest EP a layout is built for), nodes of 1-8, L of 1-3 local experts, P small
# enough that skewed rows overflow into the remainder, and large epochs (the immediate keeps 16 bits).
@settings(max_examples=40, deadline=None)
@given(W=st.sampled_from([2, 3, 8, 16, 64, 256]), node=st.sampled_from([1, 2, 4, 8]), L=st.integers(1, 3),
       T=st.integers(1, 12), K=st.integers(1, 4), private=st.sampled_from([None, 0, 1, 3]),
       skew=st.booleans(), epoch=st.integers(1, 1 << 20), kernel_waits=st.booleans(), data=st.data())
def test_write_tables_equal_plan(W, node, L, T, K, private, skew, epoch, kernel_waits, data):
    node = node if W % node == 0 and node <= W else 1
    cfg = A2AConfig(max_num_tokens=T, num_experts=W * L, experts_per_token=K, hidden_dim=8,
                    in_dtype=torch.float32, max_private_tokens=private)
    lay = cfg.layout(W, node)
    rank = data.draw(st.integers(0, W - 1), label="rank")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    counts = _random_counts(rng, lay, T, K, skew)
    if data.draw(st.booleans(), label="an aborting source"):  # its row is -1: it sends and receives nothing
        counts[data.draw(st.integers(0, W - 1), label="aborting")] = -1
    got = _plan(counts, rank, lay, epoch, kernel_waits)
    clipped = np.maximum(counts, 0)
    want = _expected(clipped, rank, lay, epoch)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("W,node,aborted", [(4, 1, False), (8, 2, False), (4, 2, True)])
def test_the_count_row_heads_every_remote_peers_private_staging_slot(W, node, aborted):
    """With `base`, the private-plan kernel writes this rank's count row (a row of -1 too) where each PRIVATE
    row's source range starts, and nothing else: the pack fills the rows after it."""
    cfg = A2AConfig(max_num_tokens=5, num_experts=2 * W, experts_per_token=2, hidden_dim=8, in_dtype=torch.float32,
                    max_private_tokens=3)
    lay = cfg.layout(W, node)
    rng = np.random.default_rng(W + node)
    counts = _random_counts(rng, lay, 5, 2, skew=False)
    rank = W - 1
    if aborted:
        counts[rank] = -1
    flags = torch.zeros(flag_word(Flag.NUM_FLAGS), dtype=torch.int64, device=DEVICE)
    tables = torch.zeros((int(WriteTable.NUM_TABLES), 1, W, 4), dtype=torch.int64, device=DEVICE)
    send_at = 32  # the send buffer's offset in base (not 0: it must be honoured)
    base = torch.full((send_at + lay.send_bytes,), 0x5A, dtype=torch.uint8, device=DEVICE)
    write_plan.plan_private_writes(torch.tensor(counts, dtype=torch.int32, device=DEVICE), tables,
                                   torch.ones(1, dtype=torch.int64, device=DEVICE), flags, rank, lay, base, send_at)
    got, want = base.cpu().numpy(), np.full(send_at + lay.send_bytes, 0x5A, np.uint8)
    row = counts[rank].astype(np.int32).view(np.uint8)
    n_to = np.maximum(plan.rank_counts(counts[rank], lay), 0)
    for peer in lay.remote_peers(rank):
        src, n, dst, _ = tables[WriteTable.PRIVATE, 0, peer].tolist()
        assert n == row.size + min(int(n_to[peer]), 3) * lay.dispatch_stride_bytes
        assert dst == lay.private_header_offset_bytes(rank)
        want[send_at + src: send_at + src + row.size] = row
    assert len(lay.remote_peers(rank)) == W - node
    np.testing.assert_array_equal(got, want)


def test_skewed_routing_overflows_into_the_remainder():
    """Every route of every rank to one expert of rank 1: each remote sender writes a remainder."""
    W, T, K = 4, 8, 2
    cfg = A2AConfig(max_num_tokens=T, num_experts=W, experts_per_token=K, hidden_dim=8, in_dtype=torch.float32,
                    max_private_tokens=3)
    lay = cfg.layout(W, 1)
    counts = np.zeros((W, W), np.int64)
    counts[:, 1] = T * K
    for rank in range(W):
        got = _plan(counts, rank, lay, 5, False)
        want = _expected(counts, rank, lay, 5)
        np.testing.assert_array_equal(got, want)
        if rank != 1:
            assert got[WriteTable.REMAINDER, 1, 1] == (T * K - 3) * lay.dispatch_stride_bytes
            assert got[WriteTable.PRIVATE, 1, 3] == encode_imm(Imm.DISPATCH_MORE, rank, 5)


@pytest.mark.timeout(120)
def test_a_missing_count_rows_flag_fails_the_wait_and_plans_nothing():
    """The plan kernel spins on COUNT_ROWS_READY (capped under the interpreter): it records the proxy as
    late in its status word, sets the sticky failure word, writes no table and raises no flag."""
    cfg = A2AConfig(max_num_tokens=4, num_experts=4, experts_per_token=2, hidden_dim=8, in_dtype=torch.float32)
    lay = cfg.layout(4, 2)
    flags = torch.zeros(flag_word(Flag.NUM_FLAGS), dtype=torch.int64, device=DEVICE)
    node = _node(lay, 0, 3, flags, kernel_waits=True, spins=50)
    base, counts = _recv_buffer(np.ones((4, 4), np.int64), 0, lay)
    tables = torch.full((3, 1, 4, 4), -7, dtype=torch.int64, device=DEVICE)
    write_plan.plan_remainder_and_combine_writes(counts, tables, node, base, RECV_BYTES, 0, lay)
    assert int(node.failed) == 1
    assert int(flags[flag_word(Flag.REMAINDER_PLANNED)]) == 0
    status = int(flags[flag_word(HALF_FLAGS["dispatch_plan"].status)])
    assert decode_wait_status(status, 0) == ([], True)
    assert (tables[int(WriteTable.REMAINDER):] == -7).all()


def test_bad_arguments_are_named():
    cfg = A2AConfig(max_num_tokens=4, num_experts=4, experts_per_token=2, hidden_dim=8, in_dtype=torch.float32)
    lay = cfg.layout(4, 2)
    epoch = torch.ones(1, dtype=torch.int64, device=DEVICE)
    flags = torch.zeros(flag_word(Flag.NUM_FLAGS), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="write_tables"):
        write_plan.plan_private_writes(torch.zeros(4, 4, dtype=torch.int32, device=DEVICE),
                                       torch.zeros(3, 1, 4, 3, dtype=torch.int64, device=DEVICE), epoch, flags, 0, lay)
    with pytest.raises(ValueError, match="counts"):
        write_plan.plan_private_writes(torch.zeros(4, 5, dtype=torch.int32, device=DEVICE),
                                       torch.zeros(3, 1, 4, 4, dtype=torch.int64, device=DEVICE), epoch, flags, 0, lay)


@pytest.mark.parametrize("corrupt", ["negative", "too_many", "mixed_minus_one"])
def test_a_corrupt_count_row_is_refused_before_any_offset(corrupt):
    """A peer's row with negative entries (not the all -1 of an aborted call) or more than T*K routes:
    the plan kernel names that source in Flag.BAD_COUNTS, fails the rank and writes no table."""
    cfg = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=8, in_dtype=torch.float32)
    lay = cfg.layout(4, 1)
    counts = np.ones((4, 8), np.int64)
    counts[2] = -1  # an aborting source: sound
    row = {"negative": [1, -5, 0, 0, 0, 0, 0, 0], "too_many": [9, 0, 0, 0, 0, 0, 0, 0],
           "mixed_minus_one": [-1, -1, -1, -1, -1, -1, -1, 0]}[corrupt]
    counts[3] = row
    flags = torch.zeros(flag_word(Flag.NUM_FLAGS), dtype=torch.int64, device=DEVICE)
    flags[flag_word(Flag.COUNT_ROWS_READY)] = 1
    node = _node(lay, 0, 1, flags, kernel_waits=False)
    tables = torch.full((3, 1, 4, 4), -7, dtype=torch.int64, device=DEVICE)
    base, counts_t = _recv_buffer(counts, 0, lay)
    write_plan.plan_remainder_and_combine_writes(counts_t, tables, node, base, RECV_BYTES, 0, lay)
    assert int(flags[flag_word(Flag.BAD_COUNTS)]) == 1 + 3
    assert int(node.failed) == 1
    assert int(flags[flag_word(Flag.REMAINDER_PLANNED)]) == 0
    assert (tables[int(WriteTable.REMAINDER):] == -7).all()


@settings(max_examples=12, deadline=None)
@given(nodes=st.integers(2, 4), node=st.integers(1, 4), L=st.integers(1, 2), T=st.integers(1, 6),
       private=st.sampled_from([0, 1, 3]), epoch=st.integers(1, 1 << 20), pieces=st.sampled_from([1, 2, 3, 16]),
       data=st.data())
def test_relay_write_tables_go_along_the_rail_and_equal_plan(nodes, node, L, T, private, epoch, pieces, data):
    """The relay (`Layout.relay`): a rank's PRIVATE and REMAINDER writes go to its relays only, its COMBINE writes
    to the sources it relays for, as `plan.relay_*` say (relay remainder geometry); every remote source's count
    row is copied in from its relay's recv buffer (this rank's or a node peer's), none from elsewhere. With
    several proxies (`Layout.wire_pieces`) each write is in pieces, `plan.split_writes`, and piece j of a private
    write says "more" exactly when piece j of the remainder is not empty (`plan.private_piece_more`)."""
    W, K = nodes * node, 2
    cfg = A2AConfig(max_num_tokens=T, num_experts=W * L, experts_per_token=K, hidden_dim=8, in_dtype=torch.float32,
                    max_private_tokens=private, dispatch_rows="rank", combine_rows="rank", relay=True)
    lay = cfg.layout(W, node).with_wire_pieces(pieces)
    E, C = lay.num_experts, lay.count_row_ints
    rank = data.draw(st.integers(0, W - 1), label="rank")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    counts = np.zeros((W, C), np.int64)
    for s in range(W):  # T tokens of K routes (-1: none); a row per (token, destination): the expert's rank on
        # s's node, s's relay on any other
        experts = rng.integers(-1, E, (T, K))
        counts[s, :E] = np.bincount(experts[experts >= 0], minlength=E)
        q = experts // L
        dest = np.where(q // node == s // node, q, q // node * node + s % node)
        for t in range(T):
            for d in set(dest[t][experts[t] >= 0].tolist()):
                counts[s, E + d] += 1
    first = lay.node_of(rank) * node
    recv_at = [RECV_BYTES + i * (lay.private_header_offset_bytes(W - 1) + lay.routing_row_bytes + 64)
               for i in range(node)]
    base = torch.full((recv_at[-1] + lay.private_header_offset_bytes(W - 1) + lay.routing_row_bytes + 64,), 0x5A,
                      dtype=torch.uint8)
    mine = torch.tensor(counts, dtype=torch.int32)
    for s in range(W):
        if s // node != rank // node:  # its count row landed at its relay on this node
            at = recv_at[s % node] + lay.private_header_offset_bytes(s)
            base[at: at + 4 * C] = mine[s].view(torch.uint8)
            mine[s] = -12345
    flags = torch.zeros(flag_word(Flag.NUM_FLAGS), dtype=torch.int64, device=DEVICE)
    flags[flag_word(Flag.COUNT_ROWS_READY)] = epoch
    node_sync = _node(lay, rank, epoch, flags, kernel_waits=False)
    mine = mine.to(DEVICE)
    tables = torch.full((int(WriteTable.NUM_TABLES), pieces, W, 4), -7, dtype=torch.int64, device=DEVICE)
    write_plan.plan_private_writes(mine[:, :E], tables, node_sync.epoch, flags, rank, lay)
    write_plan.plan_remainder_and_combine_writes(
        mine[:, :E], tables, node_sync, base.to(DEVICE), recv_at[rank % node], rank, lay, combine_rank=True,
        relay_recv_bytes=torch.tensor(recv_at, dtype=torch.int64, device=DEVICE))
    assert int(node_sync.failed) == 0 and int(flags[flag_word(Flag.REMAINDER_PLANNED)]) == epoch
    np.testing.assert_array_equal(mine.cpu().numpy(), counts)
    rows = counts[:, E:]
    want = np.zeros((int(WriteTable.NUM_TABLES), pieces, W, 4), np.int64)
    more = plan.private_piece_more(rows, rank, lay, pieces)
    for j, part in enumerate(plan.split_writes(plan.relay_private_writes(rows, rank, lay), pieces)):
        for i, (peer, src, n, dst) in enumerate(part.tolist()):
            kind = Imm.DISPATCH_MORE if more[j, i] else Imm.DISPATCH
            want[WriteTable.PRIVATE, j, peer] = (src, n, dst, encode_imm(kind, rank, epoch))
    for j, part in enumerate(plan.split_writes(plan.relay_remainder_writes(rows, rank, lay), pieces)):
        for peer, src, n, dst in part.tolist():
            want[WriteTable.REMAINDER, j, peer] = (src, n, dst, encode_imm(Imm.DISPATCH_REMAINDER, rank, epoch))
    for j, part in enumerate(plan.split_writes(plan.relay_combine_writes(rows, rank, lay), pieces)):
        for peer, src, n, dst in part.tolist():
            want[WriteTable.COMBINE, j, peer] = (src, n, dst, encode_imm(Imm.COMBINE, rank, epoch))
    np.testing.assert_array_equal(tables.cpu().numpy(), want)
    if pieces == 1:  # whole writes: "more" is the remainder's existence
        assert (more[0] == (rows[rank, plan.relay_peers(lay, rank)] > private)).all()
    assert int(flags[flag_word(Flag.REMAINDER_WRITES)]) == sum(
        int(rows[rank, p] > private) for p in plan.relay_peers(lay, rank).tolist())
