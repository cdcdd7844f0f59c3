"""Checks of the latency MODEL (benchmarks/latency_model.py): its arithmetic against the numbers we
recorded in docs/results/, where each constant comes from, and its predictions' internal consistency.
No GPU, no network."""
import glob
import json
import math
import pathlib
import re
import statistics

import pytest

from benchmarks import latency_model as lm

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def _load(name):
    return json.loads((RESULTS / name).read_text())


# ---- calibration: fitting data reproduced, held-out data predicted ------------------------------------------
def lo_hi_inside(ratio):
    return lm.BAND[0] <= ratio <= lm.BAND[1]


def test_every_calibration_row_is_in_the_band_or_says_why_not():
    rows = lm.calibration()
    got = {(r["config"], r["quantity"]): r for r in rows}
    # the numbers the model is checked against (2 x H200, decode, graph replay, 2026-11-30; bench proxy on
    # 1 x H200 host, 2026-12-01; 1 x H200 shared by W ranks under MPS, graph replay, kernel waits, 2026-12-02)
    for key, measured in {("a", "dispatch, slower rank"): 39.3, ("a2", "dispatch + combine"): 75.0,
                          ("a3", "dispatch + combine"): 76.4, ("e", "W=64: proxy dispatch"): 197.6,
                          ("e", "W=256: proxy combine"): 838.9, ("f8", "dispatch + combine"): 284.6,
                          ("g2", "dispatch, slowest rank"): 145.4, ("g4", "dispatch, slowest rank"): 260.8,
                          ("g4", "combine, slowest rank"): 200.1, ("g8", "dispatch, slowest rank"): 496.1,
                          ("g8", "combine, slowest rank"): 373.6, ("h8", "combine, slowest rank"): 165.8}.items():
        assert got[key]["measured"] == measured
    assert sum(r["config"] == "e" for r in rows) == 2 * len(lm.BENCH_PROXY_WORLDS)
    # the cross-node calibration of the current protocol: every emulated-NIC row, held-out ones included,
    # within the band
    for w in lm.MPS_WORLDS:
        for q in lm._LOCK_STEP:
            assert lo_hi_inside(got[f"g{w}", q]["ratio"]), (w, q)
    assert set(lm.OUTSIDE_BAND) <= set(got)
    lo, hi = lm.BAND
    assert (lo, hi) == (0.75, 1.25)
    for r in rows:
        assert math.isclose(r["ratio"], r["predicted"] / r["measured"])
        inside = lo <= r["ratio"] <= hi
        # a row outside the band has its written reason; a reason for a row inside it is stale
        assert inside != ((r["config"], r["quantity"]) in lm.OUTSIDE_BAND), r
    page = (ROOT / "docs" / "latency-model.md").read_text()
    for why in lm.OUTSIDE_BAND.values():
        assert len(why) > 80 and why in page


def test_held_out_files_are_no_constant_s_source():
    """Validation data is data no constant was read from: a held-out file is named by no PROVENANCE entry,
    and every file a calibration row reads is either fitting data or held out."""
    fitting = lm.fitting_files()
    sources = " ".join(src for _, src in lm.PROVENANCE.values())
    for f, what in lm.HELD_OUT.items():
        runs = glob.glob(str(RESULTS / f))
        assert runs and f not in fitting, f
        assert not any(pathlib.PurePath(run).name in sources for run in runs), f
        assert what.startswith("(") and any(lm._results_file(src) == f for *_, src in lm.MEASURED), f
    for f in fitting:
        assert (RESULTS / f).exists(), f
    roles = {}
    for c, q, _, src in lm.MEASURED:
        f = lm._results_file(src)
        assert f in fitting or f in lm.HELD_OUT, (c, q, src)
        roles.setdefault(lm.row_role(c, q, src), set()).add(c)
    # the validation: (a) on two other leases; over the emulated NIC at 4 and 8 ranks (only W=2 is fitting
    # data); the node-local runs on the shared GPU again, from another script
    assert roles["held out"] == {"a2", "a3", "g4", "g8", "h2", "h4", "h8"}
    assert not roles["held out"] & (roles["fitted"] | roles["same run"])


def test_fitted_rows_name_the_constants_read_from_their_file():
    fitting = lm.fitting_files()
    files = {}
    for c, q, _, src in lm.MEASURED:
        for key in (c, (c, q)):
            files.setdefault(key, set()).add(lm._results_file(src))
    for key, what in lm.FITTED.items():
        (f,) = files[key]
        names = re.findall(r"\b[A-Z][A-Z0-9]*(?:_(?:[A-Z0-9]+|\*))+", what)  # RUN_PLAN_* names a family
        assert names, key
        for n in names:
            assert any(c == n or (n.endswith("*") and c.startswith(n[:-1])) for c in fitting[f]), (key, n, f)


def test_mps_rows_are_the_recorded_slowest_rank_medians():
    """(f), (g): the slowest rank's graph medians of each `bench e2e --graph` file (decode); (h): what
    mps_node_local.py wrote (its slowest rank's medians)."""
    for c, q, measured, src in lm.MEASURED:
        if c[0] not in "fgh":
            continue
        w = int(c[1:])
        f = lm._results_file(src)
        assert f == lm._mps(c[0], w).removeprefix("docs/results/")
        doc = _load(f)
        if c[0] == "h":
            assert doc["world"] == w and doc["preset"] == "decode" and doc["gpu_wait"] == "kernel" and doc["ok"]
            assert measured == pytest.approx(doc[{"dispatch, slowest rank": "dispatch_us",
                                                  "combine, slowest rank": "combine_us"}[q]], abs=0.06)
            continue
        assert doc["world"] == w and doc["node"] == lm.mps_node(c[0], w) and "--graph" in doc["command"]
        assert doc["transport"] == ("emulated" if c[0] == "g" else "auto") and doc["date"].startswith("2026-12-02")
        ranks = doc["presets"]["decode"]["graph"]
        key = {"dispatch, slowest rank": "dispatch", "combine, slowest rank": "combine",
               "dispatch + combine": "total"}[q]
        meds = [rk[key]["median"] for rk in ranks]
        assert measured == pytest.approx(max(meds), abs=0.06), (c, q)
        assert f"rank {meds.index(max(meds))} of {w}" in src


def test_measured_values_are_the_recorded_medians():
    per_file = {"e2e_graph_x2.json": "a", "e2e_graph_x2_fasthost.json": "a2", "e2e_graph_x2_slowhost.json": "a3"}
    for name, config in per_file.items():
        ranks = _load(name)["presets"]["decode"]["graph"]
        med = {k: [rk[k]["median"] for rk in ranks] for k in ("dispatch", "combine", "total")}
        want = {"dispatch, slower rank": max(med["dispatch"]), "dispatch, faster rank": min(med["dispatch"]),
                "combine, slower rank": max(med["combine"]), "combine, faster rank": min(med["combine"]),
                "dispatch + combine": max(med["total"])}
        for c, q, measured, src in lm.MEASURED:
            if c == config:
                assert name in src
                assert measured == pytest.approx(want[q], abs=0.06), (c, q)
    bench = {r["world"]: r for r in _load("emulated/proxy_shm.json")["results"]}
    for c, q, measured, src in lm.MEASURED:
        if c == "e":
            assert "emulated/proxy_shm.json" in src
            w, phase = int(q.split(":")[0][2:]), q.split()[-1]
            assert measured == pytest.approx(bench[w][f"{phase}_host_us"]["median"], abs=0.06), q
            assert re.search(rf"\({bench[w]['remote_peers']} remote peers?\b", src) or phase == "combine", src
    worlds = {int(q.split(":")[0][2:]) for c, q, *_ in lm.MEASURED if c == "e"}
    assert worlds == set(bench) == set(lm.BENCH_PROXY_WORLDS)  # every world size the run measured


def test_bench_proxy_model_reproduces_its_two_rank_point_by_construction():
    """DISPATCH_STEPS_US / COMBINE_STEPS_US are what W=2 leaves after one post and one immediate: the
    model gives back the measured W=2 phases (to the constants' rounding)."""
    w2 = next(r for r in _load("emulated/proxy_shm.json")["results"] if r["world"] == 2)
    b = lm.bench_proxy(2)
    assert b["dispatch"].t == pytest.approx(w2["dispatch_host_us"]["median"], abs=0.05)
    assert b["combine"].t == pytest.approx(w2["combine_host_us"]["median"], abs=0.05)
    for w in lm.BENCH_PROXY_WORLDS:  # no GPU in the bench: no kernel, flag or wire term
        for path in lm.bench_proxy(w).values():
            assert set(path.parts) <= {"proxy_post", "proxy_imms", "proxy_steps"}, path.parts


def test_back_to_back_halves_keep_the_lock_step_means():
    r = lm.predict(2, "shm", node=1)
    b = lm.back_to_back(r)
    assert math.isclose(b["dispatch_slow"] + b["dispatch_fast"], 2 * r["dispatch"])
    assert math.isclose(b["combine_slow"] + b["combine_fast"], 2 * r["combine"])
    assert math.isclose(b["dispatch_slow"] + b["combine_fast"], r["total"])
    assert math.isclose(b["dispatch_fast"] + b["combine_slow"], r["total"])
    assert r["dispatch_early"] < r["dispatch"]


# ---- provenance: every constant is measured (with its source), derived, configuration or ASSUMPTION ------
def test_every_constant_is_in_the_provenance_table():
    consts = lm.constants()
    assert set(consts) == set(lm.PROVENANCE), set(consts) ^ set(lm.PROVENANCE)
    for name, (kind, source) in lm.PROVENANCE.items():
        assert kind in ("measured", "derived", "config", "assumption"), name
        assert source.strip(), name
        if kind == "measured":
            assert re.search(r"docs/(results/[\w/.-]+\.(json|txt)|benchmarks\.md)", source), name
            assert re.search(r"2026-1[12]-\d\d", source), name
            path = re.search(r"docs/[\w/.-]+\.(json|txt|md)", source).group(0)
            assert (ROOT / path).exists(), path
    table = lm.format_provenance()
    for name, (kind, _) in lm.PROVENANCE.items():
        line = next(l for l in table.splitlines() if f"`{name}`" in l)
        assert ("**ASSUMPTION**" in line) == (kind == "assumption"), line


def test_constants_from_the_2026_11_30_trace_are_what_the_trace_says():
    """The shm copy rate, the host-staged PCIe rate and the gap between halves, from the one host-staged GPU
    run (2 x H200, 2026-11-30; no calibration row: its protocol has since changed)."""
    ranks = _load("e2e_graph_x2_n1.json")["presets"]["decode"]["graph"]
    t0, t1 = (rk["trace"] for rk in ranks)
    p0, p1 = t0["proxy"], t1["proxy"]
    us = lambda a, b: (b - a) / 1e3  # noqa: E731
    # the three data writes: posted by one proxy, copied by the other (dispatch: 512 rows, combine: 512)
    rows = lm.TOKENS * lm.TOPK // 2
    copies = [us(p0["private_posted"], p1["dispatch_received"]), us(p0["combine_posted"], p1["combine_send_seen"]),
              us(p1["combine_posted"], p0["combine_received"])]
    nbytes = rows * (lm.DISPATCH_ROW_BYTES + 2 * lm.COMBINE_ROW_BYTES)
    assert lm.SHM_COPY_GBPS == pytest.approx(nbytes / sum(copies) / 1e3, rel=0.01)
    # host-staged row kernels: bytes / (span - kernel time), both ranks
    spans = kernels = 0.0
    for t in (t0, t1):
        m, p = t["model"], t["proxy"]
        spans += us(*m["dispatch_send"]) + us(p["dispatch_received"], m["dispatch_recv"][1]) + us(*m["combine_send"])
        kernels += lm.K_ROUTE_TOKENS + lm.K_PACK_TOKENS + lm.K_UNPACK_TOKENS + lm.K_PACK_COMBINE
    spans += us(p0["combine_received"], t0["model"]["combine_recv"][1]) + us(p1["combine_received"],
                                                                              t1["model"]["combine_recv"][1])
    kernels += 2 * lm.K_REDUCE_COMBINE
    nbytes = 2 * lm.TOKENS * lm.TOPK * 2 * (lm.DISPATCH_ROW_BYTES + lm.COMBINE_ROW_BYTES)
    assert lm.HOST_STAGED_GBPS == pytest.approx(nbytes / (spans - kernels) / 1e3, rel=0.02)
    gaps = [us(rk["trace"]["model"]["dispatch_recv"][1], rk["trace"]["model"]["combine_send"][0])
            for name in ("e2e_graph_x2.json", "e2e_graph_x2_n1.json")
            for rk in _load(name)["presets"]["decode"]["graph"]]
    assert lm.HALF_GAP_US == pytest.approx(statistics.mean(gaps), abs=0.1)


def test_constants_from_the_benchmarks_are_what_they_recorded():
    shm = next(r for r in _load("transport_gpu_host.json")["results"] if r["provider"] == "shm")
    post63 = next(p for p in shm["python_post"] if p["peers"] == 63)
    sc = {s["peers"]: s for s in shm["scatter"]}
    assert lm.POST_US == pytest.approx(post63["python_us_per_write_median"], abs=0.01)
    assert lm.SHM_POST_C_US == pytest.approx(sc[63]["post_us_per_write"] - lm.POST_US, abs=0.01)
    dec = next(k for k in _load("kernels.json")["kernels"] if k["preset"] == "decode")
    for const, kernel in (("K_ROUTE_TOKENS", "route_tokens"), ("K_PACK_TOKENS", "pack_tokens_by_expert"),
                          ("K_UNPACK_TOKENS", "unpack_tokens_by_expert"), ("K_PACK_COMBINE", "pack_combine_by_source"),
                          ("K_REDUCE_COMBINE", "reduce_combined_tokens")):
        assert getattr(lm, const) == pytest.approx(dec["kernels"][kernel]["triton"]["median_us"], abs=0.01)
    assert lm.LAUNCH_GPU_US == pytest.approx(dec["launch_us"], abs=0.01)
    assert lm.FLAG_RTT_US == pytest.approx(_load("flags.json")["flag_round_trip_us"]["median"], abs=0.01)


def test_constants_from_the_proxy_bench_and_the_traced_run_are_what_they_recorded():
    """The current protocol's proxy constants: `benchmarks/proxy.py` over shm (proxy_shm.json) and the proxy's own
    spans inside `bench e2e --trace-proxy` over shm (e2e_shm_trace.json), both 2026-12-01."""
    doc = _load("emulated/proxy_shm.json")
    assert doc["provider"] == "shm" and doc["date"].startswith("2026-12-01")
    bench = {r["world"]: r for r in doc["results"]}
    med = lambda w, k: bench[w]["parts"][k]["median"]  # noqa: E731
    w64, w256 = bench[64], bench[256]
    assert w64["remote_peers"] == 63 and w64["config"]["hidden_dim"] == 64
    assert lm.BENCH_POST_PRIVATE_US == pytest.approx(w64["post_us_per_write"]["dispatch_private"], abs=0.005)
    assert lm.BENCH_POST_COMBINE_US == pytest.approx(w64["post_us_per_write"]["combine"], abs=0.005)
    assert lm.IMM_US == pytest.approx(med(64, "dispatch_imms_rows_us") / 63, abs=0.0005)
    assert lm.COMBINE_IMM_US == pytest.approx(med(64, "combine_imms_us") / 63, abs=0.0005)
    assert lm.DISPATCH_STEPS_US == pytest.approx(
        bench[2]["dispatch_host_us"]["median"] - lm.BENCH_POST_PRIVATE_US - lm.IMM_US, abs=0.01)
    assert lm.COMBINE_STEPS_US == pytest.approx(
        bench[2]["combine_host_us"]["median"] - lm.BENCH_POST_COMBINE_US - lm.COMBINE_IMM_US, abs=0.01)
    assert lm.REMAINDER_ROW_US == pytest.approx(
        (med(256, "remainder_us") - med(64, "remainder_us")
         - w256["remainder_writes_per_call"] * lm.BENCH_POST_PRIVATE_US) / 255, abs=0.005)
    assert w64["remainder_writes_per_call"] == 0 and w256["remainder_writes_per_call"] > 0
    assert lm.BENCH_W2_PRIVATE_POST_US == pytest.approx(med(2, "dispatch_post_us"), abs=0.005)
    assert lm.BENCH_W2_COMBINE_POST_US == pytest.approx(med(2, "combine_post_us"), abs=0.005)
    assert lm.BENCH_W2_STEPS_US == pytest.approx(med(2, "remainder_us") + med(2, "dispatch_tail_us"), abs=0.005)
    assert lm.POST_PY_PRIVATE_US == pytest.approx(lm.BENCH_POST_PRIVATE_US - lm.SHM_POST_C_US)
    assert lm.POST_PY_COMBINE_US == pytest.approx(lm.BENCH_POST_COMBINE_US - lm.SHM_POST_C_US)
    run = _load("emulated/e2e_shm_trace.json")
    assert run["transport"] == "shm" and run["world"] == 2 and run["date"].startswith("2026-12-01")
    ranks = run["per_rank"]
    assert lm.RUN_PRIVATE_POST_US == pytest.approx(
        statistics.mean(r["proxy.private_post"]["median"] for r in ranks), abs=0.005)
    assert lm.RUN_COMBINE_POST_US == pytest.approx(
        statistics.mean(r["proxy.combine_post"]["median"] for r in ranks), abs=0.005)
    # the host-wait factor, straight from the two files (benchmarks.proxy.in_run_factor: per phase)
    factor = (sum(r["proxy.private_post"]["median"] + r["proxy.combine_post"]["median"] for r in ranks) / 2
              / (med(2, "dispatch_post_us") + med(2, "combine_post_us")))
    assert lm.PROXY_HOST_WAITS_FACTOR == pytest.approx(factor, rel=0.002)
    from benchmarks.proxy import in_run_factor
    per_phase = [in_run_factor(r, bench[2]) for r in ranks]
    lo = min(f[k] for f in per_phase for k in ("dispatch_post_us", "combine_post_us"))
    hi = max(f[k] for f in per_phase for k in ("dispatch_post_us", "combine_post_us"))
    assert lo < lm.PROXY_HOST_WAITS_FACTOR < hi


def _mps_spans(name: str, preset: str = "decode") -> list[dict]:
    """The proxy's spans (µs, benchmarks.proxy.PHASES) of each rank's traced call in an MPS run."""
    from benchmarks.proxy import proxy_phase_us

    return [proxy_phase_us(rk["trace"]) for rk in _load(f"gpu-2026-12-02-mps/{name}")["presets"][preset]["graph"]]


def test_constants_from_the_mps_runs_are_what_they_recorded():
    """The shared-GPU runs of 2026-12-02 (1 x H200, MPS, graph replay, kernel waits): the node-local totals,
    and from the W2-N1 run's traced calls the proxy's steps, its one-write posts and the carrier's latency;
    the CUDA carrier's cost per write alone (emulated_gpu_tests_helper.txt)."""
    for w in lm.MPS_WORLDS:
        ranks = _load(f"gpu-2026-12-02-mps/e2e_graph_w{w}n{w}_auto.json")["presets"]["decode"]["graph"]
        assert getattr(lm, f"MPS_NODE_LOCAL_W{w}_US") == pytest.approx(max(r["total"]["median"] for r in ranks),
                                                                       abs=0.06)
    run = _load("gpu-2026-12-02-mps/e2e_graph_w2n1_emulated.json")
    assert run["transport"] == "emulated" and (run["world"], run["node"]) == (2, 1) and "--graph" in run["command"]
    ranks = run["presets"]["decode"]["graph"]
    assert lm.MPS_EMULATED_W2_US == pytest.approx(max(r["total"]["median"] for r in ranks), abs=0.06)
    spans = _mps_spans("e2e_graph_w2n1_emulated.json")
    mean = lambda k: statistics.mean(sp[k] for sp in spans)  # noqa: E731
    assert lm.EMU_RUN_STEPS_US == pytest.approx(mean("remainder_us") + mean("dispatch_tail_us"), abs=0.005)
    assert lm.EMU_RUN_PRIVATE_POST_US == pytest.approx(mean("dispatch_post_us"), abs=0.005)
    assert lm.EMU_RUN_COMBINE_POST_US == pytest.approx(mean("combine_post_us"), abs=0.005)
    p0, p1 = (rk["trace"]["proxy"] for rk in ranks)
    assert ranks[0]["trace"]["epoch"] == ranks[1]["trace"]["epoch"]  # the same call on both ranks, one clock
    gaps = [(a[arr] - b[posted]) / 1e3 for a, b in ((p0, p1), (p1, p0))
            for posted, arr in (("private_posted", "count_rows_received"), ("combine_posted", "combine_received"))]
    assert lm.EMU_LATENCY_US == pytest.approx(statistics.mean(gaps), abs=0.005)
    helper = (RESULTS / "emulated" / "emulated_gpu_tests_helper.txt").read_text()
    per_write = json.loads(re.search(r"NIC 0: host time per zero-length write (\[[^]]+\])", helper).group(1))
    assert lm.EMU_POST_US == pytest.approx(statistics.mean(per_write), abs=0.01)
    # the in-run factor with kernel waits: the steps no carrier takes part in, in-run over the bench's
    assert lm.PROXY_IN_RUN_FACTOR == pytest.approx(lm.EMU_RUN_STEPS_US / lm.BENCH_W2_STEPS_US)
    assert 1.0 < lm.PROXY_IN_RUN_FACTOR < lm.PROXY_HOST_WAITS_FACTOR


def test_the_in_run_factor_in_the_held_out_runs_is_what_the_page_says():
    """The same steps in the W4-N2 and W8-N4 runs (held out) and in the prefill calls, over the bench's
    (W=8 against the bench at W=8, the others against W=2): the page quotes them."""
    bench = {r["world"]: r["parts"] for r in _load("emulated/proxy_shm.json")["results"]}
    steps = {w: bench[w]["remainder_us"]["median"] + bench[w]["dispatch_tail_us"]["median"] for w in (2, 8)}
    page = (ROOT / "docs" / "latency-model.md").read_text()
    for name, w in (("e2e_graph_w2n1_emulated.json", 2), ("e2e_graph_w4n2_emulated.json", 4),
                    ("e2e_graph_w8n4_emulated.json", 8)):
        for preset in ("decode", "prefill"):
            spans = _mps_spans(name, preset)
            run = statistics.median(sp["remainder_us"] + sp["dispatch_tail_us"] for sp in spans)
            factor = run / steps[8 if w == 8 else 2]
            assert 1.2 < factor < lm.PROXY_HOST_WAITS_FACTOR, (name, preset, factor)
            assert f"| W{w}-N{max(1, w // 2)} | {preset} | {len(spans)} | {run:.2f} | {factor:.2f} |" in page, \
                (name, preset, run, factor)


# ---- the model's arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize("fabric", lm.FABRICS)
@pytest.mark.parametrize("world", lm.WORLDS)
@pytest.mark.parametrize("kw", [{}, {"speed": "bench"}, {"speed": "host-waits"}, {"host_staged": True},
                                {"post_us": 0.2}])
def test_terms_sum_to_phase_totals(fabric, world, kw):
    r = lm.predict(world, fabric, **kw)
    for phase in ("dispatch", "combine"):
        parts = [r[f"{phase}.{t}"] for t in lm.TERMS]
        assert all(p >= 0 for p in parts)
        assert math.isclose(sum(parts), r[phase], rel_tol=1e-9)
    assert math.isclose(r["total"], r["dispatch"] + r["combine"])


@pytest.mark.parametrize("fabric", lm.FABRICS)
@pytest.mark.parametrize("speed", lm.SPEEDS)
def test_monotonic_in_world_size(fabric, speed):
    # more remote peers: more writes to post, more immediates to count, a larger remote share of the bytes
    for phase in ("dispatch", "combine", "total"):
        vals = [lm.predict(w, fabric, speed=speed)[phase] for w in lm.WORLDS]
        assert vals == sorted(vals) and vals[0] < vals[-1], (phase, vals)


def test_the_gpu_plans_the_writes():
    for w in lm.WORLDS:
        for f in lm.FABRICS:
            # plan_private_writes sits on the dispatch path before the pack: its launch at least
            assert lm.predict(w, f)["dispatch.plan_kernels"] >= lm.LAUNCH_GPU_US
    # the remainder path (REMAINDER_PLANNED round trip, table walk) only where a pair may overflow
    st = {w: lm.routing_stats(w) for w in lm.WORLDS}
    assert st[16]["p_any_remainder"] < 1e-9 < st[64]["p_any_remainder"]
    e16 = lm.predict(16, "efa")
    assert e16["dispatch.plan_kernels"] == pytest.approx(lm._plan_kernel_us(1))
    # host-staged, the remainder plan kernel reads every count row over PCIe (W * E int32)
    assert lm._plan_kernel_us(64) - lm._plan_kernel_us(8) == pytest.approx(
        56 * lm.ROUTE_ROW_BYTES / (lm.PLAN_PCIE_GBPS * 1e3))
    # node-local: no plan kernel, no proxy
    for w in (2, 8):
        r = lm.predict(w, None, node=w)
        assert r["dispatch.plan_kernels"] == r["dispatch.proxy_post"] == 0


def test_ranks_sharing_one_gpu():
    """The shared-GPU configuration (MPS): its factor gives back each node-local total it was fitted to,
    grows with the ranks sharing the GPU, leaves the host-side terms alone; EMU_GPU_FACTOR gives back the
    W2-N1 total; the emulated NIC's latency is the measured one at W=2 and grows with the sharing; the
    proxy's one-write posts at W=2 are the traced ones. Nothing of it reaches the EFA / CX7 predictions."""
    g = {w: lm.shared_gpu_factor(w) for w in lm.MPS_WORLDS}
    assert 1.0 < g[2] < g[4] < g[8]
    for w in lm.MPS_WORLDS:
        alone, shared = lm.predict(w, None, node=w), lm.predict(w, None, node=w, shared_gpu=True)
        assert shared["total"] == pytest.approx(getattr(lm, f"MPS_NODE_LOCAL_W{w}_US"))
        assert shared["dispatch.flags"] == alone["dispatch.flags"]
        assert shared["dispatch.kernels"] == pytest.approx(g[w] * alone["dispatch.kernels"])
    w2 = lm.predict(2, "emulated", node=1)
    assert w2["total"] == pytest.approx(lm.MPS_EMULATED_W2_US, abs=1e-6)
    assert w2["dispatch.proxy_post"] == pytest.approx(lm.EMU_RUN_PRIVATE_POST_US)
    assert w2["combine.proxy_post"] == pytest.approx(lm.EMU_RUN_COMBINE_POST_US)
    # the private write lands its bytes (at the shared GPU's copy rate) plus the latency measured at W=2
    s2 = lm.setup(2, "emulated", node=1)
    assert s2.gpu_share == pytest.approx(g[2] * lm.EMU_GPU_FACTOR) == pytest.approx(s2.wire_share_at)
    size = lm.TOKENS * lm.TOPK // 2 * lm.DISPATCH_ROW_BYTES + lm.ROUTE_ROW_BYTES
    assert w2["dispatch.wire"] == pytest.approx(lm.EMU_LATENCY_US + size / (lm.HBM_COPY_GBPS * 1e3))
    w8 = lm.predict(8, "emulated", node=4)
    assert w8["dispatch.wire"] > lm.EMU_LATENCY_US * g[8] / g[2] > w2["dispatch.wire"]
    assert lm.setup(16, "efa").gpu_share == 1.0 and lm.setup(16, "efa").fab.table_us == (0.0, 0.0)
    with pytest.raises(ValueError, match="measured at W"):
        lm.predict(16, "emulated", node=8)


def test_knobs_move_the_right_way():
    for w in lm.WORLDS:
        efa, cx7 = lm.predict(w, "efa", proxies=1), lm.predict(w, "cx7", proxies=1)
        assert cx7["total"] < efa["total"]  # one proxy each: the faster fabric wins
        # the library's default on EFA, one proxy per NIC, posts in parallel
        assert lm.setup(w, "efa").proxies == lm.EFA_NICS and lm.setup(w, "cx7").proxies == 1
        assert lm.predict(w, "efa")["total"] < efa["total"]
        assert lm.predict(w, "efa")["dispatch.proxy_post"] < efa["dispatch.proxy_post"]
        assert lm.predict(w, "efa", speed="bench")["total"] < efa["total"]
        assert lm.predict(w, "efa", speed="bench", post_us=lm.POST_US_C_HELPER)["total"] < \
            lm.predict(w, "efa", speed="bench")["total"]
        assert lm.predict(w, "efa", efa_efficiency=0.45, proxies=1)["total"] > efa["total"]
        assert lm.predict(w, "cx7", host_staged=True)["total"] > cx7["total"]


def test_node_local_has_no_proxy_and_shm_has_no_nic():
    a = lm.predict(2, None, node=2)
    for phase in ("dispatch", "combine"):
        assert a[f"{phase}.proxy_post"] == a[f"{phase}.proxy_steps"] == a[f"{phase}.wire"] == 0
        assert a[f"{phase}.pcie"] == 0 and a[f"{phase}.nvlink"] > 0
    b = lm.predict(2, "shm", node=1)
    assert b["dispatch.pcie"] > 0 and b["combine.wire"] > b["dispatch.wire"] > 0 and b["dispatch.nvlink"] == 0


def test_routing_statistics():
    for w in lm.WORLDS:
        st = lm.routing_stats(w)
        pmf = lm.rows_per_pair_pmf(w)
        assert math.isclose(pmf.sum(), 1.0, rel_tol=1e-9)
        mean = sum(i * p for i, p in enumerate(pmf))
        assert math.isclose(mean, lm.TOKENS * lm.TOPK / w, rel_tol=1e-9)
        assert st["private_rows"] >= 2 * st["rows_per_peer"] and st["private_rows"] % 8 == 0
        assert st["remote_peers"] == w - lm.GPUS_PER_NODE and st["local_peers"] == lm.GPUS_PER_NODE - 1
    assert lm.routing_stats(2, node=1)["p_any_remainder"] == 0.0     # P = T*K at 2 ranks


def test_bad_inputs():
    with pytest.raises(ValueError):
        lm.predict(12, "efa")
    with pytest.raises(ValueError):
        lm.predict(16, "ib")
    with pytest.raises(ValueError):
        lm.predict(16, "efa", speed="fast")
    with pytest.raises(ValueError):
        lm.predict(16, None)
    with pytest.raises(TypeError):
        lm.predict(16, "efa", protocol="2026-11-30")   # one protocol: the current one


# ---- the command line and the page ---------------------------------------------------------------------
@pytest.mark.slow  # matplotlib's first use on a machine runs fc-list to build its font cache
def test_main_writes_json_and_png(tmp_path, capsys):
    js, png = tmp_path / "m.json", tmp_path / "m.png"
    assert lm.main(["--json", str(js), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "MODEL, not measured" in out and "| EFA | 64 |" in out and "model / measured" in out
    assert "**ASSUMPTION**" in out and "| **held out** |" in out and "Outside the band" in out
    doc = json.loads(js.read_text())
    assert doc["kind"].startswith("MODEL")
    assert {(r["fabric"], r["world"]) for r in doc["predictions"]} == {(f, w) for f in lm.FABRICS for w in lm.WORLDS}
    assert len(doc["calibration"]) == len(lm.MEASURED)
    assert doc["constants"]["FLAG_RTT_US"] == lm.FLAG_RTT_US
    assert set(doc["provenance"]) == set(doc["constants"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert lm.main(["--speed", "host-waits", "--json", str(js)]) == 0
    assert "proxy speed 'host-waits'" in capsys.readouterr().out
    efa64 = next(r for r in json.loads(js.read_text())["predictions"] if r["fabric"] == "efa" and r["world"] == 64)
    assert efa64["total"] == pytest.approx(lm.predict(64, "efa", speed="host-waits")["total"])


@pytest.mark.parametrize("argv", [["--efa-efficiency", "2"], ["--post-us", "-1"], ["--post-us", "x"],
                                  ["--speed", "fast"], ["--protocol", "2026-11-29"]])
def test_main_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as e:
        lm.main(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def test_the_page_shows_what_the_model_computes():
    page = (ROOT / "docs" / "latency-model.md").read_text()
    assert lm.format_calibration(lm.calibration()) in page
    rows = lm.table()
    assert lm.format_table(rows) in page
    assert lm.format_targets(rows) in page
    assert lm.format_sensitivity() in page
    assert lm.format_provenance() in page
    assert lm.format_outside_band() in page
    assert lm.format_sources() in page
    assert lm.format_levers() in page
    assert lm.format_distinct_ranks() in page
    assert lm.format_variant_kernels() in page
    assert lm.format_issue46(lm.issue46_rows()) in page
    assert lm.format_issue46_missing() in page
    assert lm.format_issue46_bytes() in page
    assert lm.format_relay_bytes() in page
    assert lm.format_relay(lm.relay_table()) in page
    assert lm.format_relay_sensitivity() in page
    assert lm.format_relay_emulated() in page
    assert lm.format_relay_runs(lm.relay_runs()) in page
    assert lm.RELAY_MISSING[1] in page


# ---- the levers of issue 32 (fewer bytes) ----------------------------------------------------------------
ALL_LEVERS = {"rank_rows": True, "sender_reduce": True, "fp8_combine": True}
LEVER_SETS = [{"rank_rows": True}, {"rank_rows": True, "sender_reduce": True}, {"fp8_combine": True}, ALL_LEVERS]


@pytest.mark.parametrize("levers", LEVER_SETS, ids=lambda kw: "+".join(kw))
@pytest.mark.parametrize("fabric", lm.FABRICS)
def test_levers_save_bytes_and_charge_their_measured_kernels(fabric, levers):
    """Each lever moves fewer bytes, and its kernels cost what they measured at 2 ranks over the route rows'
    (wire_kernels_decode.json): the walk's kernel term moves by exactly that, its bytes only save."""
    s = lm.setup(16, fabric, **levers)
    extra = {ph: sum(lm._variant_kernel_us(s, k) for k in kernels)
             for ph, kernels in (("dispatch", ("send", "recv")), ("combine", ("combine_send", "combine_recv")))}
    for w in lm.WORLDS:
        today, r = lm.predict(w, fabric), lm.predict(w, fabric, **levers)
        for phase in ("dispatch", "combine"):
            assert math.isclose(sum(r[f"{phase}.{t}"] for t in lm.TERMS), r[phase], rel_tol=1e-9)
            assert r[f"{phase}.wire"] <= today[f"{phase}.wire"] + 1e-9 or (phase == "dispatch" and
                                                                          "sender_reduce" in levers)
            assert r[f"{phase}.kernels"] == pytest.approx(today[f"{phase}.kernels"] + extra[phase])
            assert r[f"{phase}.fanout"] == r[f"{phase}.node_reduce"] == 0   # the relay's terms only
        # what the bytes save is never lost: at most the kernels' extra time more than today
        assert r["total"] <= today["total"] + max(0.0, extra["dispatch"]) + max(0.0, extra["combine"]) + 1e-9
        if levers.get("fp8_combine"):
            assert r["combine.wire"] < today["combine.wire"]
        if levers.get("sender_reduce"):
            plain = lm.predict(w, fabric, rank_rows=True)
            assert r["combine.wire"] < plain["combine.wire"] and r["combine.nvlink"] < plain["combine.nvlink"]
    # node-local (8 ranks on one node): fewer rows over NVLink
    assert lm.predict(8, None, node=8, **levers)["dispatch.nvlink"] <= lm.predict(8, None, node=8)["dispatch.nvlink"]
    assert lm.predict(8, None, node=8, **levers)["combine.nvlink"] <= lm.predict(8, None, node=8)["combine.nvlink"]


def test_the_variants_kernel_constants_are_what_wire_kernels_recorded():
    """W2_*: rank 0's kernels per launch position (benchmarks/gpu/wire_kernels.py --world 2 --preset decode,
    1 x H200 under MPS), summed per half without the wait kernels; the fp8 route rows from the later run."""
    def halves(positions):
        names = [n for n, _ in positions]
        waits = [i for i, n in enumerate(names) if n == "_wait_apart_kernel"]
        combine = next(i for i, n in enumerate(names) if n == "moe_a2a::combine()")
        parts = {"send": positions[:waits[0]], "recv": positions[waits[0] + 1:combine],
                 "combine_send": positions[combine:waits[1]], "combine_recv": positions[waits[1] + 1:]}
        return {k: round(sum(us for _, us in v), 2) for k, v in parts.items()}

    doc = _load("gpu-2026-12-02-s11/lease3/wire_kernels_decode.json")
    assert (doc["world"], doc["preset"]) == (2, "decode")
    k = {wire: halves(pos) for wire, pos in doc["kernels"].items()}
    fp8 = halves(_load("gpu-2026-12-02-s11/lease3/wire_kernels_fp8_decode.json")["kernels"]["fp8_combine"])
    want = {"W2_SEND_ROUTE_US": k["per_route"]["send"], "W2_SEND_RANK_US": k["per_rank_dispatch"]["send"],
            "W2_UNPACK_US": k["per_route"]["recv"], "W2_EXPAND_US": k["per_rank_dispatch"]["recv"],
            "W2_COMBINE_PACK_US": k["per_route"]["combine_send"],
            "W2_REDUCE_BY_SOURCE_US": k["sender_reduced"]["combine_send"],
            "W2_REDUCE_BY_SOURCE_FP8_US": k["sender_reduced_fp8"]["combine_send"],
            "W2_REDUCE_US": k["per_route"]["combine_recv"], "W2_REDUCE_RANK_US": k["sender_reduced"]["combine_recv"],
            "W2_REDUCE_RANK_FP8_US": k["sender_reduced_fp8"]["combine_recv"],
            "W2_FP8_COMBINE_PACK_US": fp8["combine_send"], "W2_FP8_REDUCE_US": fp8["combine_recv"]}
    for name, us in want.items():
        assert getattr(lm, name) == pytest.approx(us, abs=0.006), name
    # the walk charges the difference over the 2-rank sharing factor; per_route none
    s = lm.setup(16, "efa", rank_rows=True, sender_reduce=True)
    assert lm._variant_kernel_us(s, "combine_send") == pytest.approx(
        (lm.W2_REDUCE_BY_SOURCE_US - lm.W2_COMBINE_PACK_US) / lm.shared_gpu_factor(2))
    assert all(lm._variant_kernel_us(lm.setup(16, "efa"), k) == 0
               for k in ("send", "recv", "combine_send", "combine_recv"))


def test_levers_are_refused_where_they_do_not_apply(capsys):
    with pytest.raises(ValueError, match="needs rank_rows"):
        lm.predict(16, "efa", sender_reduce=True)
    for argv in (["--sender-reduce"], ["--fp8-combine", "--protocol", "2026-11-30"]):
        with pytest.raises(SystemExit) as e:
            lm.main(argv)
        assert e.value.code == 2
    assert "--sender-reduce needs --rank-rows" in capsys.readouterr().err


def test_main_takes_the_levers(tmp_path, capsys):
    js = tmp_path / "m.json"
    assert lm.main(["--rank-rows", "--sender-reduce", "--fp8-combine", "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    efa64 = next(r for r in doc["predictions"] if r["fabric"] == "efa" and r["world"] == 64)
    assert efa64["total"] == pytest.approx(lm.predict(64, "efa", **ALL_LEVERS)["total"])
    assert [d["world"] for d in doc["distinct_ranks"]] == list(lm.LEVER_WORLDS)
    assert len(doc["levers"]) == len(lm.LEVERS)
    assert "Fewer bytes" in capsys.readouterr().out


def test_expected_distinct_ranks_analytic_monte_carlo_and_the_reference():
    """A token's 8 distinct experts of 256 hit W (1 - C(256 - L, 8) / C(256, 8)) ranks: ~7.68 at EP64 (dedup
    saves 4%), 5.29 at EP8 (1.51x), 1.99 at EP2 (4.01x). Checked by sampling, and against the bytes
    moe_a2a/reference.py counts for a sampled routing (row sizes included)."""
    import numpy as np
    import torch

    from moe_a2a import reference as R
    from moe_a2a.config import A2AConfig

    want = {2: 1.9930, 4: 3.6142, 8: 5.2947, 16: 6.5233, 32: 7.2668, 64: 7.6758}
    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((8000, lm.NUM_EXPERTS)), axis=1)[:, :lm.TOPK]
    for w, d in want.items():
        got = lm.expected_distinct_ranks(w)
        assert got["all"] == pytest.approx(d, abs=1e-4) and got["dedup"] == pytest.approx(lm.TOPK / d, rel=1e-4)
        L = lm.NUM_EXPERTS // w
        sampled = np.mean([len(set(row)) for row in (experts // L).tolist()])
        assert sampled == pytest.approx(d, rel=0.01), w
        st = lm.routing_stats(w, node=min(w, lm.GPUS_PER_NODE), per="rank")
        pmf = lm.rows_per_pair_pmf(w, "rank")
        per_peer = lm.TOKENS * got["all"] / w
        assert pmf.sum() == pytest.approx(1.0) and st["rows_per_peer"] == pytest.approx(per_peer)
        assert np.arange(len(pmf)) @ pmf == pytest.approx(per_peer)
    # the model's bytes a rank sends against reference.bytes_per_phase on a sampled routing (EP16, 2 nodes)
    W, node, T = 16, 8, lm.TOKENS
    cfg = A2AConfig(max_num_tokens=T, num_experts=lm.NUM_EXPERTS, experts_per_token=lm.TOPK, hidden_dim=7168,
                    in_dtype=torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(1)
    idx = [torch.rand(T, lm.NUM_EXPERTS, generator=g).argsort(1)[:, :lm.TOPK] for _ in range(W)]
    for name, levers in (("per_route", {}), ("sender_reduced", {"rank_rows": True, "sender_reduce": True}),
                         ("sender_reduced_fp8", ALL_LEVERS), ("per_rank_dispatch", {"rank_rows": True}),
                         ("fp8_combine", {"fp8_combine": True})):
        wire = R.WIRE_VARIANTS[name]
        s = lm.setup(W, "efa", node=node, **levers)
        assert R.row_bytes(cfg, wire) == {"dispatch": lm._dispatch_row_bytes(s), "combine": lm._combine_row_bytes(s)}
        ref = R.bytes_per_phase(cfg, idx, node, wire)
        model = lm.bytes_per_rank(W, node, **levers)
        for phase in ("dispatch", "combine"):
            total = sum(sum(r[phase].values()) for r in ref) / W
            remote = sum(r[phase]["remote"] for r in ref) / W
            assert total == pytest.approx(model[phase][0], rel=0.02), (name, phase)
            assert remote == pytest.approx(model[phase][1], rel=0.03), (name, phase)


def test_the_fp8_combine_prediction_against_the_issue_s_600_us():
    """Issue 32 asks the model for fp8-combine EFA EP64 <= 600 µs. What it says (the page's table): the fp8
    combine alone and all three levers, at in-run speed, under EFA_BW_EFFICIENCY."""
    fp8 = lm.predict(64, "efa", fp8_combine=True)["total"]
    every = lm.predict(64, "efa", **ALL_LEVERS)["total"]
    assert every < fp8 < lm.predict(64, "efa")["total"]
    assert fp8 <= lm.ISSUE_TARGETS_US[64] and every <= lm.ISSUE_TARGETS_US[64]
    assert lm.predict(64, "efa", efa_efficiency=0.45, **ALL_LEVERS)["total"] > lm.ISSUE_TARGETS_US[64]


# ---- issue 46: its runs of the wire variants, held out; the emulated NIC's settings -----------------------
def test_issue46_rows_are_held_out_and_in_the_band_or_name_what_is_missing():
    """The 12 runs of issue 46's table (and the one-node d / c): every row held out (no measured or derived
    constant comes from issue 46), each either within 25 % or naming the term the walk lacks."""
    rows = lm.issue46_rows()
    cells = {(r["setup"], r["wire"]) for r in rows if r["quantity"] == "dispatch + combine"}
    assert cells == {(s, w) for s in lm.ISSUE46_SETUPS for w in lm.ISSUE46_WIRES}      # 3 x 4 = 12 totals
    one = [r for r in rows if r["setup"] == "8 ranks, one node" and r["quantity"] != "dispatch + combine"]
    assert len(one) == 8 and len(rows) == 20
    for name, (kind, source) in lm.PROVENANCE.items():
        if kind in ("measured", "derived"):
            assert "issue 46" not in source, name
    assert lm.ISSUE46_MEASURED[0][3] == 275.0 and lm.ISSUE46_MEASURED[-1][3] == 1095.0   # the issue's numbers
    page = (ROOT / "docs" / "latency-model.md").read_text()
    keys = {(r["setup"], r["wire"], r["quantity"]) for r in rows}
    assert set(lm.ISSUE46_MISSING) <= keys and set(lm.ISSUE46_NOTES) <= keys
    for r in rows:
        assert r["in_band"] == (lm.BAND[0] <= r["predicted"] / r["measured"] <= lm.BAND[1])
        assert r["error_pct"] == pytest.approx(100 * (r["predicted"] / r["measured"] - 1))
        key = (r["setup"], r["wire"], r["quantity"])
        # outside the band <=> a named missing term (a name for an in-band row would be stale)
        assert (not r["in_band"]) == (key in lm.ISSUE46_MISSING), (key, r["ratio"])
        if r["missing"]:
            term, why = r["missing"]
            assert term and len(why) > 200 and why in page
    # the route rows and the per-rank dispatch, in every set-up, are inside the band
    for r in rows:
        if r["wire"] in ("per_route", "per_rank_dispatch") and r["quantity"] == "dispatch + combine":
            assert r["in_band"], r
    # the sender-side reduce's rows that are outside all name the same missing kernel term
    assert {t for (_, w, q), (t, _) in lm.ISSUE46_MISSING.items() if q != "dispatch"} == {lm._RBS}


def test_issue46_runs_agree_with_the_raw_files_of_the_same_configuration():
    """Two cells of the issue's table were also measured, with raw files, on 2026-12-02 (8 as 2 x 4 over the
    emulated NIC at full speed, per_route and per_rank_dispatch, 100 iterations): within 2 %."""
    issue = {(s, w): m for s, w, q, m in lm.ISSUE46_MEASURED if q == "dispatch + combine"}
    for wire in ("per_route", "per_rank_dispatch"):
        doc = _load(f"gpu-2026-12-02-s9/lease3/mps/e2e_bytes_w8n4_decode_{wire}.json")
        assert (doc["world"], doc["node"], doc["transport"], doc["wire"]) == (8, 4, "emulated", wire)
        slowest = max(r["total"]["median"] for r in doc["presets"]["decode"]["graph"])
        assert issue["2 x 4, emulated NIC, full speed", wire] == pytest.approx(slowest, rel=0.02)


def test_the_relay_runs_are_their_raw_files_held_out_and_name_what_the_walk_lacks():
    """Each relay run and the per_route run beside it: the slowest rank's median from the raw file (8 as 2 x 4,
    emulated NIC); no constant of the walk comes from them; the per_route rows fall inside the band; the relay's
    before its reduces walked several hidden chunks a program (rank_rows.REDUCE_H_CHUNKS = 4, tree 8c9906d) fall
    outside it with the missing term named, the runs with them inside it (at EFA's share too)."""
    for setup_name, gpu, tree, relay_us, per_route_us, raw in lm.RELAY_RUNS:
        for wire, us in (("relay", relay_us), ("per_route", per_route_us)):
            folder, name = raw.rsplit("/", 1)
            doc = _load(f"{folder}/{name.replace('relay', wire)}")
            assert (doc["world"], doc["node"], doc["transport"], doc["wire"]) == (8, 4, "emulated", wire)
            assert us == pytest.approx(max(r["total"]["median"] for r in doc["presets"]["decode"]["graph"]), abs=0.1)
    assert not any(run[5].split("/")[0] in str(v) for run in lm.RELAY_RUNS for v in lm.PROVENANCE.values())
    rows = lm.relay_runs()
    assert len(rows) == 2 * len(lm.RELAY_RUNS)
    for r in rows:
        chunked = r["tree"] not in ("dbdefb8", "cbbb503")   # the reduces walking 4 hidden chunks a program
        assert r["in_band"] == (r["missing"] is None) and r["in_band"] == (r["wire"] == "per_route" or chunked), r
        # the walk is short of the relay's runs before the chunked reduces
        assert r["predicted"] < r["measured"] or r["wire"] == "per_route" or chunked
    # at EFA's share (the wire slowed by the GPU's stretch) the relay is ahead of per_route, measured and walked
    scaled = {r["wire"]: r for r in rows if r["setup"] == lm._EFA_SCALED}
    assert scaled["relay"]["measured"] < scaled["per_route"]["measured"]
    assert scaled["relay"]["predicted"] < scaled["per_route"]["predicted"]


def test_issue46_bytes_are_the_benchmark_s_routing():
    """The bytes a rank sends in the issue's runs (MB, rounded to 0.1): the walk's rows with the benchmark's
    routing (each route -1 with probability 0.1, moe_a2a/bench/demo.py), every variant, both phases."""
    import inspect

    from moe_a2a.bench import demo
    assert "< 0.1] = -1" in inspect.getsource(demo.make_inputs)   # the masked share the check takes in
    for wire, (d, c) in lm.ISSUE46_BYTES_MB.items():
        b = lm.bench_bytes_to_others(8, 4, **lm.ISSUE46_WIRES[wire])
        assert b["dispatch"] == pytest.approx(d, abs=0.1) and b["combine"] == pytest.approx(c, abs=0.1), wire
        u = lm.bench_bytes_to_others(8, 4, mask=0.0, **lm.ISSUE46_WIRES[wire])
        assert u["dispatch"] > b["dispatch"] and u["combine"] > b["combine"]


def test_efa_at_the_run_s_stretch_is_the_efa_like_setting_slowed_by_the_gpu_s_stretch():
    """relay_scaled (run.sh mps relay): 12us,25GBps times / over emulated_stretch(8), rounded, in run.sh too."""
    f = lm.emulated_stretch(8)
    assert f == pytest.approx(lm.shared_gpu_factor(8) * lm.EMU_GPU_FACTOR) and 5 < f < 10
    assert lm.EMU_NIC_EFA_SCALED_LATENCY_US == pytest.approx(lm.EMU_NIC_EFA_LIKE_LATENCY_US * f, rel=0.03)
    assert lm.EMU_NIC_EFA_SCALED_GBPS == pytest.approx(lm.EMU_NIC_EFA_LIKE_GBPS / f, rel=0.03)
    run_sh = (ROOT / "benchmarks" / "gpu" / "run.sh").read_text()
    assert (f"RELAY_NIC_SCALED:-{lm.EMU_NIC_EFA_SCALED_LATENCY_US:g}us,{lm.EMU_NIC_EFA_SCALED_GBPS:g}GBps"
            in run_sh)
    # at EFA's share the relay's fewer bytes are less time in the walk, as they are on EFA
    world, fab, kw = lm.RELAY_SETUPS[lm._EFA_SCALED]
    relay, per_route = (lm.predict(world, fab, **kw, **levers)["total"] for levers in ({"relay": True}, {}))
    assert relay < per_route


def test_the_emulated_nic_s_settings():
    """MOE_A2A_EMULATED_NIC: a write lands at the later of its copy and the host-clock schedule (bytes / GB/s
    after the previous write, from its post) + latency; the carrier's post then costs EMU_POST_PACED_US."""
    full, paced = lm.predict(2, "emulated", node=1), lm.predict(2, "emulated", node=1, emulated_nic=(12.0, 25.0))
    assert paced["total"] > full["total"]
    s = lm.setup(2, "emulated", node=1, emulated_nic=(12.0, 25.0))
    assert s.emu_nic == (12.0, 25.0)
    assert lm._post_write_us(s, "private") == pytest.approx(s.speed * lm.EMU_POST_PACED_US)
    # one combine write at W=2 (512 rows of 14 336 B): at 25 GB/s it lands 294 µs + 12 after its post
    size = lm.TOKENS * lm.TOPK // 2 * lm.COMBINE_ROW_BYTES
    assert paced["combine.wire"] == pytest.approx(size / 25e3 + 12.0)
    # a bandwidth high enough and no latency: the copy lands later, as at full speed
    fast = lm.predict(2, "emulated", node=1, emulated_nic=(0.0, 1e6))
    assert fast["combine"] == pytest.approx(full["combine"], rel=0.01)
    with pytest.raises(ValueError, match="emulated NIC"):
        lm.predict(16, "efa", emulated_nic=(12.0, 25.0))


# ---- the relay (issue 46, item 4): a model of a protocol not yet timed on a GPU ------------------------------
def test_the_relay_reproduces_the_issue_s_bytes_table():
    """256 experts, top-8, 8 GPUs a node: a token hits 3.26 / 5.45 / 6.72 remote ranks and 1.00 / 2.71 / 4.63
    remote nodes at EP16 / 32 / 64, so one row per (token, node) sends 3.3x / 2.0x / 1.45x fewer network rows
    than one per (token, rank); checked analytically, by sampling, and as the walk's bytes."""
    import numpy as np

    want = {16: (3.26, 1.00, 3.3), 32: (5.45, 2.71, 2.0), 64: (6.72, 4.63, 1.45)}
    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((20000, lm.NUM_EXPERTS)), axis=1)[:, :lm.TOPK]
    for w, (ranks, nodes, fewer) in want.items():
        d = lm.expected_distinct_nodes(w)
        assert round(d["remote_ranks"], 2) == ranks and round(d["remote_nodes"], 2) == nodes
        assert round(d["fewer"], 2 if fewer < 2 else 1) == fewer
        per_node = lm.NUM_EXPERTS * lm.GPUS_PER_NODE // w           # experts on one node; rank 0 on node 0
        sampled = np.mean([len(set(row) - {0}) for row in (experts // per_node).tolist()])
        assert sampled == pytest.approx(nodes, rel=0.02), w
        b = lm.relay_bytes_per_rank(w)
        # the relay's row is the per-rank row (the same metadata): bytes fall as the rows do
        assert b["dispatch_per_rank"] / b["dispatch"] == pytest.approx(d["fewer"], rel=1e-9)
        assert b["combine_per_rank"] / b["combine"] == pytest.approx(d["fewer"], rel=1e-9)
        assert (b["writes_per_rank"], b["writes"]) == (w - 8, w // 8 - 1)
    assert "| 16 | 3.26 | 1.00 | 3.27x fewer | 8 -> 1 |" in lm.format_relay_bytes()


def test_the_relay_walk():
    """One write per remote node and phase; the NVLink fan-out and the node-level reduce as GPU terms (zero
    elsewhere, stretched by a shared GPU); the relay rests on the per-rank rows and the sender-side reduce;
    on one node it is the sender-reduced walk."""
    for f in lm.FABRICS:
        for w in lm.WORLDS:
            for fp8 in (False, True):
                r = lm.predict(w, f, relay=True, fp8_combine=fp8)
                per_rank = lm.predict(w, f, rank_rows=True, sender_reduce=True, fp8_combine=fp8)
                for phase in ("dispatch", "combine"):
                    assert math.isclose(sum(r[f"{phase}.{t}"] for t in lm.TERMS), r[phase], rel_tol=1e-9)
                assert r["dispatch.fanout"] > 0 and r["combine.node_reduce"] > 0
                assert r["dispatch.node_reduce"] == r["combine.fanout"] == 0
                if f == "efa":   # wire-bound there (CX7 EP64's per-rank dispatch is held by its 56 posts)
                    assert r["dispatch.wire"] < per_rank["dispatch.wire"]
                    assert r["combine.wire"] < per_rank["combine.wire"]
                assert r["dispatch.proxy_post"] <= per_rank["dispatch.proxy_post"]   # nodes - 1 writes, not W - 8
                assert lm.relay_stats(w)["writes"] == w // lm.GPUS_PER_NODE - 1
                assert r["total"] < per_rank["total"]
    s = lm.setup(64, "efa", relay=True)
    assert (s.dispatch_rows, s.combine_rows, s.relay) == ("rank", "rank", True)
    # as the library: one proxy per EFA NIC, each write in one piece per proxy (Layout.wire_pieces)
    assert s.proxies == 2 and s.relay_split and lm._relay_writes(s, 1.0, 7) == [0.5] * 14
    assert lm._relay_writes(lm.setup(64, "efa", relay=True, relay_split=False), 1.0, 7) == [1.0] * 7
    assert not lm.setup(64, "efa", relay=True, proxies=1).relay_split
    # EP16: one write a phase; whole, it rides one NIC of two; in pieces, both
    assert lm.predict(16, "efa", relay=True)["total"] < lm.predict(16, "efa", relay=True, relay_split=False)["total"]
    assert lm.predict(16, "cx7", relay=True, relay_split=False)["total"] == lm.predict(16, "cx7", relay=True)["total"]
    one = lm.predict(8, None, node=8, relay=True)
    assert one == lm.predict(8, None, node=8, rank_rows=True, sender_reduce=True)
    # the partials' NVLink bytes: an expert GPU's rows from other nodes' tokens, (G - 1) / G of them to others
    rs = lm.relay_stats(64)
    assert rs["partial_rows"] == pytest.approx(56 * lm.TOKENS * lm.p_token_hits_rank(64) * 7 / 8)
    assert rs["fanout_rows"] == pytest.approx(rs["rows_in"] * 8 * lm.p_token_hits_rank(64) / rs["p_node"] * 7 / 8)
    # on the shared GPU over the emulated NIC its GPU terms are stretched as every other
    e = lm.predict(8, "emulated", node=4, relay=True)
    assert e["dispatch.fanout"] > lm.predict(16, "efa", relay=True)["dispatch.fanout"]


def test_the_relay_against_issue_46_s_targets():
    """EP16/32/64 on EFA (bf16 and fp8 combine) against the issue's targets, CX7 beside: each row says whether
    it meets its target and which term holds it (the largest over both phases)."""
    rows = lm.relay_table()
    assert {(r["fabric"], r["combine_rows"], r["world"]) for r in rows} == {
        (f, c, w) for f in lm.FABRICS for c in ("bf16", "fp8") for w in lm.WORLDS}
    table = lm.format_relay(rows)
    for r in rows:
        both = {t: r[f"dispatch.{t}"] + r[f"combine.{t}"] for t in lm.TERMS}
        held = max(both, key=both.get)
        line = next(l for l in table.splitlines()
                    if l.startswith(f"| {r['fabric'].upper()} | {r['combine_rows']} | {r['world']} |"))
        assert f"{held} {both[held]:.0f} of {r['total']:.0f}" in line
        if r["fabric"] == "efa":
            assert r["target"] == lm.RELAY_TARGETS_US[r["combine_rows"]][r["world"]]
            assert ("**meets**" in line) == (r["total"] <= r["target"])
            assert ("misses" in line) == (r["total"] > r["target"])
        else:
            assert r["target"] is None and "no target" in line
    page = (ROOT / "docs" / "latency-model.md").read_text()
    relay = page[page.index("## The relay, modelled"):]
    assert "predictions, not measurements" in relay and "timed only with 8 ranks sharing one GPU" in relay


def test_main_takes_the_wire_by_name_and_the_relay(tmp_path, capsys):
    js = tmp_path / "m.json"
    assert lm.main(["--wire", "relay", "--fp8-combine", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "The relay, modelled" in out and "Issue 46's runs" in out
    doc = json.loads(js.read_text())
    efa64 = next(r for r in doc["predictions"] if r["fabric"] == "efa" and r["world"] == 64)
    assert efa64["total"] == pytest.approx(lm.predict(64, "efa", relay=True, fp8_combine=True)["total"])
    assert len(doc["issue46"]) == len(lm.ISSUE46_MEASURED) and len(doc["relay"]) == 12
    assert len(doc["relay_runs"]) == 2 * len(lm.RELAY_RUNS)
    assert lm.main(["--wire", "sender_reduced_fp8", "--json", str(js)]) == 0
    efa64 = next(r for r in json.loads(js.read_text())["predictions"] if r["fabric"] == "efa" and r["world"] == 64)
    assert efa64["total"] == pytest.approx(lm.predict(64, "efa", **ALL_LEVERS)["total"])
    capsys.readouterr()
    for argv in (["--relay-whole-writes"], ["--wire", "relay", "--rank-rows"], ["--wire", "pigeon"]):
        with pytest.raises(SystemExit) as e:
            lm.main(argv)
        assert e.value.code == 2
