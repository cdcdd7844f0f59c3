"""Per-rank rows (`A2AConfig(dispatch_rows="rank", combine_rows=...)`) end to end: LocalCluster ranks on one
node and as several (real processes, shared memory, real libfabric shm/tcp between the proxies; private and
remainder writes, host-staged, split and memfd buffers), kernels in the interpreter, against reference.py: the dispatch output is
`reference.dispatch`'s bit for bit, the combine `reference.combine` (route rows back) or
`reference.combine_reduced_at_sender` (reduced at the experts' rank), for random routings with -1 routes,
duplicated experts, skew, bound_m, accumulate, fixed expert capacity and fp8 payloads."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_a2a import LocalCluster, reference
from moe_a2a.config import A2AConfig

from ..conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

T, K, H = 6, 3, 40


def _cfg(world: int, combine_rows: str, **kw) -> A2AConfig:
    kw = {"hidden_dim": H, "max_num_tokens": T, **kw}
    return A2AConfig(num_experts=2 * world, experts_per_token=K, dispatch_rows="rank", combine_rows=combine_rows,
                     **kw)


def _inputs(cfg: A2AConfig, world: int, seed: int, skew: bool, tokens: list[int]):
    g = torch.Generator().manual_seed(seed)
    E = cfg.num_experts
    xs, scales, idxs, ws = [], [], [], []
    for s in range(world):
        n = tokens[s]
        x = torch.randn(n, cfg.hidden_dim, generator=g)
        xs.append(x.to(cfg.in_dtype))
        scales.append(torch.rand(n, cfg.num_scales, generator=g) + 0.5 if cfg.has_scales else None)
        hi = 2 if skew else E  # skew: every route to the experts of rank 0
        idx = torch.randint(-1, hi, (n, K), generator=g, dtype=torch.int32)
        if n:
            idx[0] = torch.tensor([hi - 1, hi - 1, -1][:K])  # a duplicated expert and a dead route
        idxs.append(idx)
        ws.append(torch.rand(n, K, generator=g))
    return xs, scales, idxs, ws


def _call(a2a, rank, cfg, xs, scales, idxs, ws, bound, accumulate):
    dev = a2a.device
    xs, scales, idxs, ws = ([None if t is None else t.to(dev) for t in ts] for ts in (xs, scales, idxs, ws))
    num, ex, exs = a2a.empty_dispatch_outputs()
    bound_m = None if bound is None else torch.tensor([bound[rank]], dtype=torch.int32, device=dev)
    kw = {"weights": ws[rank]} if cfg.combine_rows == "rank" else {}
    a2a.dispatch(num, ex, exs, xs[rank], scales[rank], idxs[rank], bound_m=bound_m, **kw)
    g = torch.Generator().manual_seed(100 + rank)
    y = torch.randn(ex.shape[0], cfg.hidden_dim, generator=g).to(cfg.out_dtype).to(dev)  # rows past n are not read
    out = torch.randn(xs[rank].shape[0], cfg.hidden_dim, generator=g).to(cfg.out_dtype).to(dev)
    old = out.clone()
    a2a.combine(out, idxs[rank], ws[rank], y, accumulate=accumulate)
    return tuple(None if t is None else t.cpu() for t in (num, ex, exs, y, old, out))


def check_dispatch(cfg, world, results, xs, scales, idxs, bound):
    """Every rank's dispatch output (`_call`'s results) against `reference.dispatch` bit for bit, routes past
    `bound` dead; returns those live indices."""
    live = [idx.clone() for idx in idxs]
    if bound is not None:
        for s in range(world):
            live[s][bound[s]:] = -1
    ref = reference.dispatch(cfg, xs, scales if cfg.has_scales else None, live)
    for r in range(world):
        num, ex, exs, *_ = results[r]
        n, rex, rexs = ref[r]
        assert torch.equal(num, n), (r, num, n)
        rows = rex.shape[0]
        if cfg.expert_capacity:  # rows past an expert's count are not written: compare the counted ones
            for l in range(len(n)):
                c = cfg.expert_capacity
                assert torch.equal(ex[l * c: l * c + int(n[l])].view(torch.uint8),
                                   rex[l * c: l * c + int(n[l])].view(torch.uint8)), (r, l)
        else:
            assert torch.equal(ex[:rows].view(torch.uint8), rex.view(torch.uint8)), r
            if cfg.has_scales:
                assert torch.equal(exs[:rows], rexs), r
    return live


def _check(cfg, world, results, xs, scales, idxs, ws, bound, accumulate):
    live = check_dispatch(cfg, world, results, xs, scales, idxs, bound)
    ys = [res[3] for res in results]
    olds = [res[4] for res in results] if accumulate else None
    if cfg.combine_rows == "rank":
        want = reference.combine_reduced_at_sender(cfg, live, ws, ys, olds, fp8=cfg.combine_fp8)
    elif cfg.combine_fp8:
        want = reference.combine_fp8(cfg, live, ws, ys, olds)
    else:
        want = reference.combine(cfg, live, ws, ys, olds)
    bound_abs = _gpu_bounds(cfg, live, ws, ys, olds) if TEST_DEVICE == "cuda" else None
    for r in range(world):
        out = results[r][5]
        n_live = xs[r].shape[0] if bound is None else bound[r]
        have, ref = out[:n_live].float(), want[r][:n_live].float()
        if bound_abs is None:  # the interpreter rounds every operation as the reference does: bitwise
            assert torch.equal(out[:n_live], want[r][:n_live]), (r, (have - ref).abs().max())
        else:
            assert ((have - ref).abs() <= bound_abs[r][:n_live]).all(), (r, (have - ref).abs().max())
        assert torch.equal(out[n_live:], results[r][4][n_live:]), r  # tokens past bound_m untouched


def _gpu_bounds(cfg, live, ws, ys, olds):
    """Compiled kernels fuse `acc + w * y` into an FMA: each fp32 sum may differ from the reference's by a few
    fp32 ulps, which can move a rounding by one ulp of the rounded value: of the result (route rows), and with
    rows reduced at the sender of each partial too (one bf16 ulp, or one fp8 step: 2**-3 relative) before the
    home's sum. Bound: those ulps of |partial| summed, plus one ulp of the result."""
    ulp_out = 2.0 ** -7 if cfg.out_dtype == torch.bfloat16 else 2.0 ** -10
    per_partial = 2.0 ** -3 if cfg.combine_fp8 else ulp_out
    out = []
    if cfg.combine_rows == "rank":
        parts = reference.combine_partials_at_sender(cfg, live, ws, ys, fp8=cfg.combine_fp8)
    for s in range(len(live)):
        T = live[s].shape[0]
        total = torch.zeros(T, cfg.hidden_dim)
        if cfg.combine_rows == "rank":
            for r in range(len(live)):
                t, rows = parts[r][s]
                total[t] += rows.abs() * per_partial
        ref = (reference.combine_reduced_at_sender(cfg, live, ws, ys, olds, fp8=cfg.combine_fp8)
               if cfg.combine_rows == "rank" else reference.combine(cfg, live, ws, ys, olds)
               if not cfg.combine_fp8 else reference.combine_fp8(cfg, live, ws, ys, olds))
        out.append(total + ref[s].float().abs() * ulp_out + 1e-30)
    return out


# name: (world, node size, transport, buffers, config fields)
CONFIGS = {
    "W2-route-combine": (2, 2, "shm", "auto", dict(combine_rows="route")),
    "W2-sender-reduce": (2, 2, "shm", "auto", dict(combine_rows="rank")),
    "W4-sender-reduce-fp8-capacity": (4, 4, "shm", "auto", dict(combine_rows="rank", in_dtype=torch.float8_e4m3fn,
                                                                expert_capacity=T * 4 * K)),
    "W3-route-combine-pad": (3, 3, "shm", "auto", dict(combine_rows="route", expert_padding=4)),
    "W2-sender-reduce-fp8-combine": (2, 2, "shm", "auto", dict(combine_rows="rank", combine_fp8=True)),
    "W2-route-fp8-combine": (2, 2, "shm", "auto", dict(combine_rows="route", combine_fp8=True, hidden_dim=200)),
    # across nodes: private writes only (P large), remainders for most rows (P=1), every row a remainder (P=0)
    "W4-N2-TCP-sender-reduce-P1": (4, 2, "tcp", "auto", dict(combine_rows="rank", max_private_tokens=1)),
    "W2-N1-SHM-route-combine-staged-P0": (2, 1, "shm", "staged", dict(combine_rows="route", max_private_tokens=0)),
    "W4-N2-SHM-sender-reduce-fp8-staged": (4, 2, "shm", "staged", dict(combine_rows="rank", combine_fp8=True,
                                                                        in_dtype=torch.float8_e4m3fn,
                                                                        max_private_tokens=2)),
    "W2-N1-TCP-route-combine-memfd-PBIG": (2, 1, "tcp", "memfd", dict(combine_rows="route", max_private_tokens=100)),
}
# buffers='memfd' is the CPU stand-in of GPU buffers (as in test_all_to_all.py)
CONFIGS = {k: v for k, v in CONFIGS.items() if TEST_DEVICE == "cpu" or v[3] != "memfd"}


def open_cluster(configs: dict, name: str, make_cfg):
    """(cluster, cfg, world, node) of `configs[name]` = (world, node size, transport, buffers, config fields[,
    proxies a rank])."""
    world, node, transport, buffers, kw, *proxies = configs[name]
    cfg = make_cfg(world, **kw)
    cl = LocalCluster(cfg, world_size=world, node_size=node, transport=transport, buffers=buffers,
                      device=TEST_DEVICE, timeout_s=60, proxies=proxies[0] if proxies else "auto")
    return cl, cfg, world, node


@pytest.fixture(scope="module", params=list(CONFIGS))
def cluster(request):
    cl, cfg, world, _ = open_cluster(CONFIGS, request.param, _cfg)
    with cl:
        yield cl, cfg, world


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), skew=st.booleans(), accumulate=st.booleans(), data=st.data())
def test_rank_rows_match_reference(cluster, seed, skew, accumulate, data):
    cl, cfg, world = cluster
    tokens = data.draw(st.lists(st.integers(0, T), min_size=world, max_size=world))
    bound = data.draw(st.one_of(st.none(), st.just([data.draw(st.integers(0, n)) for n in tokens])))
    xs, scales, idxs, ws = _inputs(cfg, world, seed, skew, tokens)
    results = cl.run(_call, cfg, xs, scales, idxs, ws, bound, accumulate)
    _check(cfg, world, results, xs, scales, idxs, ws, bound, accumulate)


def _bad_then_good(a2a, rank, cfg):
    dev = a2a.device
    num, ex, exs = a2a.empty_dispatch_outputs()
    x = torch.randn(2, H).to(cfg.in_dtype).to(dev)
    idx = torch.tensor([[0, 1, 2], [3, -1, 0]], dtype=torch.int32, device=dev)[:, :K]
    w = torch.rand(2, K).to(dev)
    try:  # rank 1 forgets the weights: the call aborts on every rank, the next works
        a2a.dispatch(num, ex, exs, x, None, idx, weights=None if rank == 1 else w)
        # (a CPU peer learns it in its dispatch, a GPU peer at the end of the combine: no host sync before)
        a2a.combine(torch.zeros(2, H, dtype=cfg.out_dtype, device=dev), idx, w, ex.to(cfg.out_dtype))
        seen = "none"
    except Exception as exc:  # noqa: BLE001 - the test looks at what each rank got
        seen = f"{type(exc).__name__}: {exc}"
    a2a.dispatch(num, ex, exs, x, None, idx, weights=w)
    a2a.combine(torch.zeros(2, H, dtype=cfg.out_dtype, device=dev), idx, w, ex.to(cfg.out_dtype))
    return seen


@pytest.mark.parametrize("world, node, transport", [(2, 2, "shm"), (4, 2, "tcp")], ids=["W2", "W4-N2-TCP-P1"])
def test_ranks_routed_in_the_experts_launches_match_reference(world, node, transport):
    """T*K past the one-program routing (48 x 3 routes): the ranks are routed in the experts' two launches
    (`route_tokens(ranks=)`), across nodes with the remote peers' first row staged privately; bitwise the
    reference in the interpreter."""
    tokens = [48, 41, 48, 0][:world]
    cfg = _cfg(world, "rank", max_num_tokens=48, max_private_tokens=1)
    xs, scales, idxs, ws = _inputs(cfg, world, 11, False, tokens)
    with LocalCluster(cfg, world_size=world, node_size=node, transport=transport, device=TEST_DEVICE,
                      timeout_s=60) as cl:
        results = cl.run(_call, cfg, xs, scales, idxs, ws, None, False)
    _check(cfg, world, results, xs, scales, idxs, ws, None, False)


def test_missing_weights_abort_the_call_on_every_rank():
    cfg = _cfg(2, "rank")
    with LocalCluster(cfg, world_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        seen = cl.run(_bad_then_good, cfg)
    assert "ValueError: weights: cfg.combine_rows='rank'" in seen[1]
    assert "CallAborted" in seen[0] and "rank 1" in seen[0]


def test_config_and_topology_refusals():
    with pytest.raises(ValueError, match="combine_rows='rank' needs dispatch_rows='rank'"):
        A2AConfig(combine_rows="rank")
    with pytest.raises(ValueError, match="dispatch_rows must be 'route' or 'rank'"):
        A2AConfig(dispatch_rows="token")
    cfg = _cfg(2, "route")
    assert cfg.dispatch_stride_bytes == cfg.rank_meta_offset_bytes + 32  # 2K int32, padded to 16
    assert _cfg(2, "rank").rank_meta_bytes == 48                           # and K weights
    assert cfg.layout(2).routing_row_bytes == 4 * (cfg.num_experts + 2)    # E counts + W rows per rank
    with LocalCluster(cfg, world_size=2, transport="shm", device=TEST_DEVICE, timeout_s=30) as cl:
        seen = cl.run(_shrink_instance)
    assert all("dispatch_rows='rank' with rank_mask" in s for s in seen), seen


def _shrink_instance(a2a, rank):
    from moe_a2a import AllToAll
    from moe_a2a.runtime.shrink import RankMask

    try:  # refused on every rank alike, after the configs were compared (a collective step)
        AllToAll(a2a.cfg, group=a2a.group, device=a2a.device, timeout_s=10,
                 rank_mask=RankMask(a2a.world_size, rank, a2a.device)).close()
        return "accepted"
    except ValueError as exc:
        return str(exc)


def _long_top_k_call(a2a, rank, xs, idxs, ws):
    dev, cfg = a2a.device, a2a.cfg
    num, ex, exs = a2a.empty_dispatch_outputs()
    a2a.dispatch(num, ex, exs, xs[rank].to(dev), None, idxs[rank].to(dev), weights=ws[rank].to(dev))
    g = torch.Generator().manual_seed(200 + rank)
    y = torch.randn(ex.shape[0], cfg.hidden_dim, generator=g).to(cfg.out_dtype).to(dev)
    out = torch.zeros(xs[rank].shape[0], cfg.hidden_dim, dtype=cfg.out_dtype, device=dev)
    a2a.combine(out, idxs[rank].to(dev), ws[rank].to(dev), y)
    return y.cpu(), out.cpu()


def test_a_top_k_past_the_unrolled_sum_matches_reference():
    """K = 20 (> `_rank_rows_kernels.UNROLL_K`): the reduce by source sums the routes in a loop, not unrolled;
    duplicated experts in a row, dead routes; bitwise the reference in the interpreter."""
    world, k = 2, 20
    cfg = A2AConfig(max_num_tokens=T, num_experts=8, experts_per_token=k, hidden_dim=H, dispatch_rows="rank",
                    combine_rows="rank")
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(T, H, generator=g).to(cfg.in_dtype) for _ in range(world)]
    idxs = [torch.randint(-1, cfg.num_experts, (T, k), generator=g, dtype=torch.int32) for _ in range(world)]
    ws = [torch.rand(T, k, generator=g) for _ in range(world)]
    with LocalCluster(cfg, world_size=world, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        results = cl.run(_long_top_k_call, xs, idxs, ws)
    want = reference.combine_reduced_at_sender(cfg, idxs, ws, [r[0] for r in results], None)
    assert all(bool(want[r].abs().sum() > 0) for r in range(world))  # tokens were combined, not left at zero
    for r in range(world):
        if TEST_DEVICE == "cpu":
            assert torch.equal(results[r][1], want[r]), r
        else:
            assert torch.allclose(results[r][1].float(), want[r].float(), rtol=2 ** -6, atol=1e-3), r
