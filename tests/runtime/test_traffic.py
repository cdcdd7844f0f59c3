"""The bytes of a call and of an instance (`runtime/traffic.py`, `AllToAll.bytes_last_call` / `buffer_bytes`).

End to end (LocalCluster ranks: real processes, real proxies, libfabric shm/tcp between simulated nodes),
hypothesis drives the routing (skew onto two hot experts, -1 routes, a duplicated expert in a token, ranks
with no token) and every rank's view is held against the specification: its received rows and combined
tokens against `reference.dispatch` / `reference.combine` (`oracle.check_against_reference`), its
`bytes_last_call()` against `reference.bytes_per_phase` plus one count row per peer, and its remote bytes
against the writes the proxy posts (`protocol.plan`); per-route rows on 1 to 8 ranks a node (W up to 16), and
one row per (token, rank) with fp8 combine rows on one node. Without processes: `call_bytes` for every wire variant
of `reference.WIRE_VARIANTS`, and `buffer_bytes` per placement.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from moe_a2a import LocalCluster
from moe_a2a import reference as R
from moe_a2a.config import A2AConfig, wire_config
from moe_a2a.oracle import check_against_reference, fill_sentinel, record_call, toy_expert
from moe_a2a.protocol import plan
from moe_a2a.runtime import traffic

from ..conftest import TEST_DEVICE

K = 4
T_MAX = 40       # T*K = 160: ranks with T > 32 take the route kernel's two-launch path, T <= 32 its one program
ONE_PROGRAM_T = 128 // K


@dataclass(frozen=True)
class Shape:
    world: int
    node: int
    transport: str
    in_dtype: torch.dtype
    private: int | None = None   # max_private_tokens (None: the default P)
    generated: int = 1           # hypothesis examples on top of the explicit ones
    explicit: tuple = ("mixed",)  # token-count patterns always run (see `_tokens`)
    wire: tuple = ()             # A2AConfig's (dispatch_rows, combine_rows, combine_fp8); () = per-route rows


SHAPES = [
    # two nodes of two: node pulls/pushes and proxy writes in one call; both launch paths on every rank
    pytest.param(Shape(4, 2, "shm", torch.bfloat16, explicit=("small", "large")), id="W4-N2-SHM-BF16"),
    # fp8 with scales, P = 2: most remote rows take the remainder writes
    pytest.param(Shape(6, 3, "shm", torch.float8_e4m3fn, private=2), id="W6-N3-SHM-FP8-P2"),
    # every rank its own node, over tcp
    pytest.param(Shape(3, 1, "tcp", torch.bfloat16), id="W3-N1-TCP-BF16"),
    # the largest world: 2 nodes of 8, one example
    pytest.param(Shape(16, 8, "shm", torch.bfloat16, generated=0), id="W16-N8-SHM-BF16"),
    # one row per (token, rank) (one node only, for now) and fp8 combine rows: the count rows carry the
    # rows per rank, the strides are the config's
    pytest.param(Shape(4, 4, "shm", torch.bfloat16, generated=0, wire=("rank", "route", True)),
                 id="W4-N4-SHM-BF16-RANKROWS-FP8COMBINE"),
]


def _cfg(s: Shape) -> A2AConfig:
    scaled = s.in_dtype == torch.float8_e4m3fn
    return A2AConfig(max_num_tokens=T_MAX, num_experts=2 * s.world, experts_per_token=K,
                     hidden_dim=32 if scaled else 16, in_dtype=s.in_dtype, scale_block=16 if scaled else None,
                     out_dtype=torch.bfloat16, max_private_tokens=s.private,
                     **dict(zip(("dispatch_rows", "combine_rows", "combine_fp8"), s.wire)))


@pytest.fixture(scope="module", params=SHAPES)
def cluster(request):
    s: Shape = request.param
    cfg = _cfg(s)
    with LocalCluster(cfg, world_size=s.world, node_size=s.node, transport=s.transport, device=TEST_DEVICE,
                      timeout_s=120.0) as cl:
        yield s, cfg, cl


def _tokens(g: torch.Generator, W: int, sizes: str) -> list[int]:
    """Tokens per rank: "small" all T*K <= 128 (the route kernel's one program), "large" all above (block
    + fixup launches), "mixed" each rank either way, and rank W-1 none at all."""
    def one(big: bool) -> int:
        lo, hi = (ONE_PROGRAM_T + 1, T_MAX) if big else (1, ONE_PROGRAM_T)
        return int(torch.randint(lo, hi + 1, (1,), generator=g))
    if sizes == "mixed":
        return [one(bool(r % 2)) for r in range(W - 1)] + [0]
    return [one(sizes == "large") for _ in range(W)]


def _inputs(cfg: A2AConfig, W: int, seed: int, sizes: str, masked: float, skew: float, dup: bool) -> list:
    """Per rank (x, x_scale, indices int32, weights): -1 with probability `masked`, else one of the two
    hottest experts (both on rank 0) with probability `skew`, else uniform; `dup`: slot 1 repeats slot 0."""
    g = torch.Generator().manual_seed(seed)
    E, H = cfg.num_experts, cfg.hidden_dim
    out = []
    for T in _tokens(g, W, sizes):
        idx = torch.randint(0, E, (T, K), generator=g)
        hot = torch.rand(T, K, generator=g) < skew
        idx[hot] = torch.randint(0, 2, (int(hot.sum()),), generator=g)
        idx[torch.rand(T, K, generator=g) < masked] = -1
        if dup:
            idx[:, 1] = idx[:, 0]
        x = torch.randn(T, H, generator=g).to(cfg.in_dtype)
        xs = torch.rand(T, cfg.num_scales, generator=g) + 0.5 if cfg.has_scales else None
        out.append((x, xs, idx.to(torch.int32), torch.rand(T, K, generator=g)))
    return out


def _call(a2a, rank, inputs):
    """One dispatch -> toy expert -> combine on this rank; the call as the oracle reads it, and its bytes."""
    cfg, dev = a2a.cfg, a2a.device
    x, xs, idx, w = (t if t is None else t.to(dev) for t in inputs[rank])  # made on the CPU: one generator
    num, ex, exs = a2a.empty_dispatch_outputs()
    fill_sentinel(ex, exs)
    a2a.dispatch(num, ex, exs, x, xs, idx)
    y = toy_expert(ex, exs, cfg)
    out = torch.zeros(x.shape[0], cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
    a2a.combine(out, idx, w, y)
    return {"calls": [record_call(cfg, x, xs, idx, w, num, ex, exs, out)], "bytes": a2a.bytes_last_call(),
            "buffer": a2a.buffer_bytes, "placement": a2a.placement}


def _check_bytes(cfg: A2AConfig, W: int, N: int, indices: list, got: list[dict]) -> None:
    """Every rank's `bytes_last_call()` against the specification and the proxy's writes."""
    lay = cfg.layout(W, N)
    spec = traffic.wire(cfg)
    # The specification's rows: its bytes over its row sizes, on the per-route config (its row_bytes adds
    # the per-rank metadata to that config's stride); each row moves the config's stride.
    base = dataclasses.replace(cfg, dispatch_rows="route", combine_rows="route", combine_fp8=False)
    ref, ref_size = R.bytes_per_phase(base, indices, N, spec), R.row_bytes(base, spec)
    stride = {"dispatch": cfg.dispatch_stride_bytes, "combine": cfg.combine_stride_bytes}
    head = 4 * (cfg.num_experts + (W if spec.dispatch_rows == "rank" else 0))  # a count row, to every other rank
    counts = np.stack([np.bincount(i[i >= 0].long().numpy(), minlength=cfg.num_experts) for i in indices])
    routes = plan.route_matrix(counts, lay)
    for q, b in enumerate(got):
        d, c = b["dispatch"], b["combine"]
        for place, peers in (("node", N - 1), ("remote", W - N)):
            sent = ref[q]["dispatch"][place] // ref_size["dispatch"]   # rows q sends its peers
            back = ref[q]["combine"][place] // ref_size["combine"]     # rows q's experts send home
            assert d[place + "_sent"] == sent * stride["dispatch"] + head * peers, (q, place, b)
            assert c[place + "_sent"] == back * stride["combine"], (q, place, b)
            if spec.dispatch_rows == spec.combine_rows:  # the pairs of one phase are the other's, reversed
                assert c[place + "_received"] == sent * stride["combine"], (q, place, b)
                assert d[place + "_received"] == back * stride["dispatch"] + head * peers, (q, place, b)
        # remote: exactly the lengths of the writes the proxy posts (private with the count row, remainder, combine)
        posted = plan.private_writes(counts[q], q, lay)[:, 2].sum() + plan.remainder_writes(routes, q, lay)[:, 2].sum()
        assert d["remote_sent"] == int(posted), (q, b)
        assert c["remote_sent"] == int(plan.combine_writes(routes, q, lay)[:, 2].sum()), (q, b)
    for ph in traffic.PHASES:                           # what one rank sends another receives
        for place in ("node", "remote"):
            assert sum(b[ph][place + "_sent"] for b in got) == sum(b[ph][place + "_received"] for b in got)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bytes_of_every_call_match_the_specification_and_the_rows_the_reference(cluster):
    shape, cfg, cl = cluster
    W, N = shape.world, shape.node
    lay = cfg.layout(W, N)

    @settings(max_examples=max(shape.generated, 1), deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate] if shape.generated else [Phase.explicit],
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**16), sizes=st.sampled_from(["small", "large", "mixed"]),
           masked=st.sampled_from([0.0, 0.3]), skew=st.sampled_from([0.0, 0.7]), dup=st.booleans())
    def one_call(seed, sizes, masked, skew, dup):
        inputs = _inputs(cfg, W, seed, sizes, masked, skew, dup)
        results = cl.run(_call, inputs)
        assert check_against_reference(cfg, results) == []
        _check_bytes(cfg, W, N, [i[2] for i in inputs], [r["bytes"] for r in results])
        for r in results:
            assert r["buffer"] == traffic.buffer_bytes(lay, r["placement"], TEST_DEVICE)

    for n, sizes in enumerate(shape.explicit):  # both launch paths of the route kernel, whatever is drawn
        one_call = example(seed=n, sizes=sizes, masked=0.3, skew=0.7, dup=True)(one_call)
    one_call()


# ---- without processes -------------------------------------------------------------------------------
def _has_wire_fields() -> bool:
    return {"dispatch_rows", "combine_rows", "combine_fp8"} <= {f.name for f in dataclasses.fields(A2AConfig)}


@settings(max_examples=30, deadline=None)
@given(W=st.integers(1, 16), node=st.integers(1, 8), T=st.integers(0, 6), L=st.integers(1, 2),
       masked=st.sampled_from([0.0, 0.3]), skew=st.sampled_from([0.0, 0.7]), dup=st.booleans(),
       variant=st.sampled_from(sorted(R.WIRE_VARIANTS)), seed=st.integers(0, 2**16))
def test_call_bytes_count_the_rows_of_the_specification_for_every_wire(W, node, T, L, masked, skew, dup, variant,
                                                                        seed):
    """`call_bytes` from a count matrix (and the per-rank rows) against `reference.bytes_per_phase`, row for
    row, for each wire of `reference.WIRE_VARIANTS` the config can select."""
    spec = R.WIRE_VARIANTS[variant]
    if spec != R.Wire() and not _has_wire_fields():
        pytest.skip("this A2AConfig has no dispatch_rows / combine_rows / combine_fp8 fields yet")
    node = max(d for d in range(1, min(node, W) + 1) if W % d == 0)
    g = torch.Generator().manual_seed(seed)
    E = W * L
    base = A2AConfig(max_num_tokens=6, num_experts=E, experts_per_token=K, hidden_dim=24)
    fields = {} if spec == R.Wire() else {"dispatch_rows": spec.dispatch_rows, "combine_rows": spec.combine_rows,
                                           "combine_fp8": spec.combine_fp8}
    cfg = dataclasses.replace(base, **fields)
    assert traffic.wire(cfg) == spec
    idx = []
    for _ in range(W):
        i = torch.randint(0, E, (T, K), generator=g)
        i[torch.rand(T, K, generator=g) < skew] = 0
        i[torch.rand(T, K, generator=g) < masked] = -1
        if dup:
            i[:, 1] = i[:, 0]
        idx.append(i)
    lay = cfg.layout(W, node)
    counts = torch.stack([torch.bincount(i[i >= 0], minlength=E) for i in idx]).to(torch.int32)
    rank_rows = R.rows_per_pair(cfg, idx, "rank").to(torch.int32)
    # The specification's rows: its bytes over its row sizes, taken on the per-route config (its row_bytes
    # adds the per-rank metadata to the stride of that config).
    ref = R.bytes_per_phase(base, idx, node, spec)
    ref_size = R.row_bytes(base, spec)
    stride = {"dispatch": cfg.dispatch_stride_bytes, "combine": cfg.combine_stride_bytes}
    head = traffic.count_row_bytes(lay)
    assert head == 4 * (E + (W if spec.dispatch_rows == "rank" else 0)) or not hasattr(lay, "count_row_ints")
    got = [traffic.call_bytes(counts, lay, cfg, q, rank_rows) for q in range(W)]
    for q, b in enumerate(got):
        for place, peers in (("node", node - 1), ("remote", W - node)):
            for ph, other in (("dispatch", "combine"), ("combine", "dispatch")):
                extra = head * peers if ph == "dispatch" else 0
                sent_rows = ref[q][ph][place] // ref_size[ph]
                assert b[ph][place + "_sent"] == sent_rows * stride[ph] + extra, (q, ph, place)
                # the rows q receives in one phase are those it sends in the other (same pairs, when both
                # phases count rows alike)
                if spec.dispatch_rows == spec.combine_rows:
                    recv_rows = ref[q][other][place] // ref_size[other]
                    assert b[ph][place + "_received"] == recv_rows * stride[ph] + extra, (q, ph, place)
    for ph in traffic.PHASES:
        for place in ("node", "remote"):
            assert sum(b[ph][place + "_sent"] for b in got) == sum(b[ph][place + "_received"] for b in got)
    if spec.dispatch_rows == "rank":
        with pytest.raises(ValueError, match="rank_rows"):
            traffic.call_bytes(counts, lay, cfg, 0)


def test_an_aborted_rank_counts_no_rows_but_its_count_row():
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=2, hidden_dim=8)
    lay = cfg.layout(2, 1)
    counts = torch.tensor([[-1, -1, -1, -1], [1, 0, 2, 0]], dtype=torch.int32)
    b0, b1 = (traffic.call_bytes(counts, lay, cfg, q) for q in (0, 1))
    assert b0["dispatch"] == {"node_sent": 0, "remote_sent": 16, "node_received": 0,
                              "remote_received": 16 + cfg.dispatch_stride_bytes}
    assert b1["combine"]["remote_sent"] == 0 and b0["combine"]["remote_sent"] == cfg.combine_stride_bytes


@pytest.mark.parametrize("placement", ["host", "ipc", "nic", "staged"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])  # "cuda" here is only the memory kind counted, no GPU needed
def test_buffer_bytes_per_placement(placement, device):
    lay = A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=7168,
                    in_dtype=torch.float8_e4m3fn).layout(16, 8)
    b = traffic.buffer_bytes(lay, placement, device)
    own = 0 if placement == "host" else lay.send_bytes + lay.recv_bytes
    staged = placement in ("host", "staged")
    assert b["segment_bytes"] == lay.segment_bytes(staged)
    assert b["device_bytes"] + b["host_bytes"] == lay.segment_bytes(staged) + own
    assert b["device_bytes"] == (own if device == "cuda" else 0)
    if staged:  # the segment holds the host-staged send and recv buffers
        assert b["segment_bytes"] >= lay.send_bytes + lay.recv_bytes
    with pytest.raises(ValueError, match="placement"):
        traffic.buffer_bytes(lay, "node-file")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_buffer_bytes_count_the_row_plan_of_rows_reduced_at_the_experts_rank(device):
    cfg = wire_config(A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=7168,
                                in_dtype=torch.float8_e4m3fn), "sender_reduced")
    lay = cfg.layout(16, 8)
    b = traffic.buffer_bytes(lay, "nic", device)
    assert b["row_plan_bytes"] == 16 * 128 * 8 * 4 == lay.max_recv_rank_rows * 8 * 4
    own = lay.send_bytes + lay.recv_bytes + b["row_plan_bytes"]
    assert b["device_bytes"] + b["host_bytes"] == lay.segment_bytes(False) + own
    assert b["device_bytes"] == (own if device == "cuda" else 0)
    assert traffic.buffer_bytes(A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8,
                                          hidden_dim=7168).layout(16, 8), "nic", device)["row_plan_bytes"] == 0
