"""A2AConfig and Layout: validation and the derived sizes every other module relies on."""
import dataclasses
import pickle

import pytest
import torch

from moe_a2a.config import MAX_CONFIG_VALUES, A2AConfig, round_up
from moe_a2a.protocol.words import Flag


def test_decode_sizes_match_the_design():
    cfg = A2AConfig(in_dtype=torch.float8_e4m3fn)  # DeepSeek-V3 decode
    assert cfg.num_scales == 56 and cfg.block_size == 128
    assert cfg.dispatch_stride_bytes == 7168 + 224  # payload + scales, both 16-byte aligned
    assert cfg.combine_stride_bytes == 7168 * 2
    lay = cfg.layout(64)
    assert lay.num_local_experts == 4
    assert lay.max_recv_routes == 64 * 128 * 8  # every route of every rank may land on one rank
    assert lay.private_rows == 32               # 2 x average (16), rounded to 8


def test_strides_are_16_byte_aligned_for_odd_sizes():
    cfg = A2AConfig(hidden_dim=7, in_dtype=torch.float8_e4m3fn, scale_block=3, out_dtype=torch.float16)
    assert cfg.num_scales == 3
    assert cfg.scale_row_words == 16  # received scale rows 64-byte aligned
    assert A2AConfig(in_dtype=torch.float8_e4m3fn).scale_row_words == 64  # 56 scales
    assert A2AConfig().scale_row_words == 0  # bf16: no scales
    assert cfg.dispatch_scale_offset_bytes % 16 == 0 and cfg.dispatch_stride_bytes % 16 == 0
    assert cfg.combine_stride_bytes == 16


def test_segment_regions_do_not_overlap():
    lay = A2AConfig(max_num_tokens=5, num_experts=12, experts_per_token=3, hidden_dim=33).layout(4, 2)
    regions = [(lay.flags_offset_bytes, int(Flag.NUM_FLAGS) * 64), (lay.error_offset_bytes, 4096),
               (lay.routing_offset_bytes, lay.routing_bytes), (lay.send_offset_bytes, lay.send_bytes),
               (lay.recv_offset_bytes, lay.recv_bytes)]
    for (a, na), (b, nb) in zip(regions, regions[1:]):
        assert a + na <= b, (a, na, b)
    assert lay.segment_bytes(True) >= lay.recv_offset_bytes + lay.recv_bytes
    assert lay.segment_bytes(True) % 4096 == 0


def test_layout_is_torch_free_and_picklable():
    lay = A2AConfig().layout(8, 4)
    assert "torch" not in pickle.dumps(lay).decode("latin1")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_num_tokens=0), "max_num_tokens"),
    (dict(num_experts=-1), "num_experts"),
    (dict(experts_per_token=True), "experts_per_token"),
    (dict(in_dtype=torch.int8), "in_dtype"),
    (dict(out_dtype=torch.float8_e4m3fn), "out_dtype"),
    (dict(scale_block=0), "scale_block"),
    (dict(max_private_tokens=-2), "max_private_tokens"),
    (dict(expert_padding=0), "expert_padding"),
])
def test_bad_fields_raise_value_error_naming_them(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        A2AConfig(**kwargs)


@pytest.mark.parametrize("world, node, needle", [(3, 3, "divisible"), (4, 3, "node_size"), (0, 1, "world_size")])
def test_bad_world_layouts(world, node, needle):
    with pytest.raises(ValueError, match=needle):
        A2AConfig(num_experts=8).layout(world, node)


@pytest.mark.parametrize("name, bad", [("hidden_dim", 2**20 + 1), ("max_num_tokens", 2**20 + 1),
                                       ("num_experts", 2**16 + 1), ("experts_per_token", 1025),
                                       ("expert_padding", 2**20 + 1), ("scale_block", 2**20 + 1)])
def test_absurd_sizes_are_refused_naming_the_field_and_bound(name, bad):
    with pytest.raises(ValueError, match=rf"A2AConfig.{name} must be <= "):
        A2AConfig(**{name: bad})


def test_largest_allowed_sizes_and_k_above_e_are_accepted():
    # Duplicates within a token's top-k are allowed, so K may exceed E (up to 1024).
    big = A2AConfig(num_experts=4, experts_per_token=1024, max_num_tokens=2**20, hidden_dim=2**20)
    assert (big.max_num_tokens, big.num_experts, big.experts_per_token, big.hidden_dim) == (2**20, 4, 1024, 2**20)
    assert big.dispatch_stride_bytes == big.combine_stride_bytes == 2 * 2**20  # bf16 rows, no scales
    lay = big.layout(4)
    assert lay.num_local_experts == 1 and lay.max_recv_routes == 4 * 2**20 * 1024  # 2**32: past any int32
    wide = A2AConfig(num_experts=2**16, expert_padding=2**20)
    assert (wide.num_experts, wide.expert_padding) == (2**16, 2**20)
    assert wide.layout(8).num_local_experts == 2**13
    # Every bound is accepted exactly (one past it is refused: test_absurd_sizes_are_refused_...).
    for name, bound in MAX_CONFIG_VALUES.items():
        assert getattr(A2AConfig(**{name: bound}), name) == bound, name


def test_buffers_too_large_for_this_machine_are_refused_naming_the_sizes():
    from moe_a2a.protocol.memory import check_fits_in_memory, physical_memory_bytes

    cfg = A2AConfig(max_num_tokens=45440, num_experts=256, experts_per_token=8, hidden_dim=7168)  # buildable
    lay = cfg.layout(64, 8)  # 8 nodes: the remote regions are there (on one node they take no bytes)
    assert lay.segment_bytes(True) == 697_029_664_768
    one_node = cfg.layout(64)
    assert one_node.segment_bytes(True) == 10_423_001_088
    assert one_node.send_bytes < lay.send_bytes and one_node.recv_bytes < lay.recv_bytes
    with pytest.raises(ValueError) as info:
        check_fits_in_memory(lay, physical=256 << 30)
    msg = str(info.value)
    for part in ("697,029,664,768 B (697.0 GB)", "physical memory (274,877,906,944 B, 274.9 GB)",
                 f"send buffer {lay.send_bytes:,} B", f"recv buffer {lay.recv_bytes:,} B", "max_num_tokens=45440",
                 "experts_per_token=8", "world_size=64", "dispatch row 14336 B"):
        assert part in msg, (part, msg)
    small = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8).layout(2)
    assert check_fits_in_memory(small, ranks=2) == 2 * small.segment_bytes(True)
    with pytest.raises(ValueError, match="3 rank"):  # every rank of this machine counts
        check_fits_in_memory(small, ranks=3, physical=3 * small.segment_bytes(True) - 1)
    assert physical_memory_bytes() is None or physical_memory_bytes() > 1 << 28


def test_one_node_buffers_have_no_remote_regions():
    """The private, remainder and combine staging regions serve remote peers only: on one node they take no
    bytes, and the combine region starts the recv buffer; with a second node they are back, same offsets."""
    cfg = A2AConfig(max_num_tokens=64, num_experts=16, experts_per_token=4, hidden_dim=256)
    one, two = cfg.layout(4), cfg.layout(4, 2)
    assert not one.has_remote_peers and two.has_remote_peers
    assert one.combine_recv_offset_bytes == one.remainder_offset_bytes == 0
    assert one.send_bytes == round_up(one.send_rows * one.dispatch_stride_bytes, 4096)
    assert two.remainder_offset_bytes == 4 * two.private_slot_rows * two.dispatch_stride_bytes
    assert two.combine_recv_offset_bytes == two.remainder_offset_bytes + 4 * two.send_rows * two.dispatch_stride_bytes
    assert two.send_bytes > one.send_bytes + 4 * two.combine_rows * two.combine_stride_bytes - 4096
    assert one.recv_bytes < two.recv_bytes


def test_private_rows_override_and_cap():
    cfg = A2AConfig(max_num_tokens=4, experts_per_token=2, num_experts=8, max_private_tokens=100)
    assert cfg.layout(2).private_rows == 8  # capped at T*K
    assert A2AConfig(num_experts=8, max_private_tokens=0).layout(2).private_rows == 0
    assert round_up(13, 8) == 16


def test_expert_capacity_layout_and_validation():
    import pytest
    import torch

    from moe_a2a.config import A2AConfig

    cfg = A2AConfig(max_num_tokens=8, num_experts=16, experts_per_token=2, hidden_dim=32, expert_capacity=24)
    lay = cfg.layout(4)
    assert lay.expert_capacity == 24 and lay.max_dispatch_rows == 4 * 24  # [L, C, H]
    assert A2AConfig(num_experts=16).layout(4).expert_capacity == 0
    for bad in (0, -1, True, 2.5, "8", 1 << 21):
        with pytest.raises(ValueError, match="expert_capacity"):
            A2AConfig(expert_capacity=bad)
    with pytest.raises(ValueError, match="expert_padding must be 1"):
        A2AConfig(expert_capacity=8, expert_padding=4, in_dtype=torch.bfloat16)


def test_node_experts_are_the_experts_of_the_node_ranks():
    lay = A2AConfig(max_num_tokens=4, num_experts=24, experts_per_token=2, hidden_dim=16).layout(6, 2)
    for r in range(6):
        first, end = lay.node_experts(r)
        hosts = {e // lay.num_local_experts for e in range(first, end)}
        assert hosts == set(lay.node_peers(r)) and end - first == 2 * lay.num_local_experts


def test_payload_bytes_narrows_the_dispatch_rows_and_is_validated():
    import pytest
    import torch

    from moe_a2a.config import A2AConfig

    wide = A2AConfig(hidden_dim=7168, in_dtype=torch.bfloat16, scale_block=7168)
    narrow = A2AConfig(hidden_dim=7168, in_dtype=torch.bfloat16, scale_block=7168, payload_bytes=7168 + 224)
    assert wide.x_bytes == wide.token_bytes == 14336 and wide.dispatch_stride_bytes == 14352
    assert narrow.token_bytes == 14336 and narrow.x_bytes == 7392 and narrow.dispatch_stride_bytes == 7408
    assert narrow.combine_stride_bytes == wide.combine_stride_bytes  # the combine's rows are whole tokens
    assert narrow.layout(2).send_bytes < wide.layout(2).send_bytes
    for bad in (0, 6, 14340, True, 7392.0, "7392"):
        with pytest.raises(ValueError, match="payload_bytes"):
            A2AConfig(hidden_dim=7168, in_dtype=torch.bfloat16, payload_bytes=bad)


@pytest.mark.slow
def test_hash_is_cached_per_config_and_left_out_of_pickles():
    # Launch keys hash the config on every call: equal configs must still hash alike, and the cached
    # hash of a str field ("auto") must not travel to a process whose str hashes differ.
    import dataclasses
    import os
    import subprocess
    import sys

    a, b = A2AConfig(hidden_dim=1024), A2AConfig(hidden_dim=1024)
    assert a == b and hash(a) == hash(b) and a.__dict__["_hash"] == hash(a)
    assert hash(dataclasses.replace(a, hidden_dim=2048)) != hash(a)
    assert {a: 1}[b] == 1 and {a.layout(4): 1}[b.layout(4)] == 1
    blob = pickle.dumps(a)
    assert "_hash" not in pickle.loads(blob).__dict__
    code = ("import pickle, sys; from moe_a2a.config import A2AConfig; c = pickle.loads(sys.stdin.buffer.read()); "
            "print({A2AConfig(hidden_dim=1024): 'hit'}.get(c, 'miss'))")
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"  # another seed than this process's
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": seed})
    assert out.stdout.decode().strip() == "hit", out.stderr.decode()[-2000:]


def test_combine_fp8_sizes_the_combine_slots_and_is_validated():
    import dataclasses

    from moe_a2a import fingerprint, reference

    bf16 = A2AConfig(in_dtype=torch.float8_e4m3fn)                     # DeepSeek-V3 decode
    fp8 = dataclasses.replace(bf16, combine_fp8=True)
    assert not bf16.combine_fp8 and bf16.combine_num_scales == 0
    assert bf16.combine_scale_offset_bytes == bf16.combine_stride_bytes == 7168 * 2  # unchanged without it
    # fp8 bytes at [0, H), 56 fp32 scales from round_up(H, 16): reference.row_bytes' fp8 combine row.
    assert (fp8.combine_payload_bytes, fp8.combine_num_scales, fp8.combine_scale_offset_bytes) == (7168, 56, 7168)
    assert fp8.combine_stride_bytes == 7168 + 224 == reference.row_bytes(bf16, reference.Wire(combine_fp8=True))[
        "combine"]
    assert fp8.y_bytes == bf16.y_bytes == 7168 * 2                      # expert_y stays out_dtype
    assert fp8.dispatch_stride_bytes == bf16.dispatch_stride_bytes
    odd = A2AConfig(hidden_dim=200, out_dtype=torch.float32, combine_fp8=True)
    assert (odd.combine_scale_offset_bytes, odd.combine_stride_bytes) == (208, 224)
    # Every buffer that holds combine rows shrinks with it (the layout carries the stride).
    lay, lay8 = bf16.layout(8, 4), fp8.layout(8, 4)
    assert lay8.combine_stride_bytes == fp8.combine_stride_bytes
    assert lay8.send_bytes < lay.send_bytes and lay8.recv_bytes < lay.recv_bytes
    assert fp8 != bf16 and hash(fp8) != hash(bf16)                      # launch keys tell them apart
    # Ranks that disagree on it are refused at bootstrap, naming the field.
    fps = [fingerprint.of(c, node_group=4, transport="shm", buffers="auto", proxies=1, device="cpu")
           for c in (bf16, fp8)]
    with pytest.raises(ValueError, match="combine_fp8: False on rank 0; True on rank 1"):
        fingerprint.check(fps, ["h", "h"], 0)
    for bad in (1, 0, "yes", None):
        with pytest.raises(ValueError, match="combine_fp8 must be a bool"):
            A2AConfig(combine_fp8=bad)


def test_the_relay_needs_rows_per_rank_both_ways_and_is_a_bool():
    """`A2AConfig(relay=True)` forwards per-rank rows and reduces the combine in the node: refused otherwise, and
    its layout's partial region exists only across nodes."""
    with pytest.raises(ValueError, match="relay=True needs dispatch_rows='rank' and combine_rows='rank'"):
        A2AConfig(dispatch_rows="rank", relay=True)
    with pytest.raises(ValueError, match="relay must be a bool"):
        A2AConfig(dispatch_rows="rank", combine_rows="rank", relay=1)
    cfg = A2AConfig(max_num_tokens=8, num_experts=16, experts_per_token=2, hidden_dim=40, dispatch_rows="rank",
                    combine_rows="rank", relay=True)
    assert cfg.layout(8, 2).relay and cfg.layout(8, 2).relay_partial_rows == 6 * 8
    assert cfg.layout(8).relay_partial_rows == 0  # one node: nothing is relayed
    assert not cfg.layout(8, 2, relay=False).relay


@pytest.mark.parametrize("world,node,shards", [(8, 2, 2), (16, 4, 3), (6, 3, 1), (12, 2, 4)])
def test_wire_peers_and_proxy_shards_pair_up_and_split_the_rail(world, node, shards):
    """`Layout.wire_peers`: every remote peer, or with the relay the rail (the same local index on every other
    node, `plan.relay_peers`); `proxy_shard`: the proxy of rank r that carries peer p talks to p's proxy
    `proxy_shard(p, r)`, which carries r (both ends agree), and the relay's rail peers, all congruent modulo the
    node size, spread over the shards as evenly as their count allows (`p % shards` gave one proxy all of them)."""
    from moe_a2a.protocol import plan

    base = dict(max_num_tokens=8, num_experts=2 * world, experts_per_token=2, hidden_dim=64, dispatch_rows="rank",
                combine_rows="rank")
    for relay in (False, True):
        lay = A2AConfig(**base, relay=relay).layout(world, node)
        for r in range(world):
            wire = lay.wire_peers(r)
            assert wire == (lay.rail_peers(r) if relay else lay.remote_peers(r))
            if relay:
                assert wire == plan.relay_peers(lay, r).tolist() == plan.relayed_sources(lay, r).tolist()
                assert all(p % node == r % node and not lay.same_node(p, r) for p in wire)
            loads = [sum(lay.proxy_shard(r, p, shards) == j for p in wire) for j in range(shards)]
            assert max(loads) - min(loads) <= (1 if relay else len(wire)), (relay, r, loads)
            for p in wire:
                assert r in lay.wire_peers(p)
                assert 0 <= lay.proxy_shard(r, p, shards) < shards


@pytest.mark.parametrize("world,node,shards", [(8, 2, 2), (16, 8, 2), (12, 4, 3), (6, 3, 1)])
def test_under_the_relay_every_proxy_carries_its_piece_of_every_rail_write(world, node, shards):
    """`Layout.with_wire_pieces(k)`: under the relay with k > 1 proxies each write goes in k pieces, so proxy j of
    every rank carries every rail peer (`shard_peers`) and talks to the peer's proxy j (`peer_proxy`: NIC j to NIC
    j, both ends agree); without the relay, or with one proxy, nothing changes (whole writes, `proxy_shard`).
    The write tables grow by the pieces; a layout refuses pieces without the relay."""
    base = dict(max_num_tokens=8, num_experts=2 * world, experts_per_token=2, hidden_dim=64, dispatch_rows="rank",
                combine_rows="rank")
    whole = A2AConfig(**base, relay=True).layout(world, node)
    lay = whole.with_wire_pieces(shards)
    assert lay.wire_pieces == shards and lay.write_table_bytes == shards * whole.write_table_bytes
    assert A2AConfig(**base).layout(world, node).with_wire_pieces(shards).wire_pieces == 1
    for r in range(world):
        for j in range(shards):
            mine = lay.shard_peers(r, j, shards)
            if shards > 1:
                assert mine == lay.wire_peers(r)
                assert all(lay.peer_proxy(r, p, j, shards) == j and lay.peer_proxy(p, r, j, shards) == j
                           for p in mine)
            else:
                assert mine == [p for p in lay.wire_peers(r) if lay.proxy_shard(r, p, 1) == 0]
        for p in lay.node_peers(r):  # not on the wire: the proxy that would carry it, as without pieces
            assert lay.peer_proxy(r, p, 0, shards) == lay.proxy_shard(p, r, shards)
    assert lay.write_table_row_word(2, world - 1, shards - 1) * 8 + 32 == lay.write_table_bytes
    with pytest.raises(ValueError, match="wire_pieces"):
        dataclasses.replace(A2AConfig(**base).layout(world, node), wire_pieces=2)
    with pytest.raises(ValueError, match="wire_pieces"):
        dataclasses.replace(whole, wire_pieces=17)
