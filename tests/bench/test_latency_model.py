"""Fast checks of the scale-out latency MODEL (moe_a2a/bench/latency_model.py); no GPU, no network."""
import json
import math

import pytest

from moe_a2a.bench import latency_model as lm


@pytest.mark.parametrize("fabric", lm.FABRICS)
def test_monotonic_in_world_size(fabric):
    # more remote peers: more writes to post and a larger remote share of the bytes
    for phase in ("dispatch", "combine", "total"):
        vals = [lm.predict(w, fabric)[phase] for w in lm.WORLDS]
        assert vals == sorted(vals) and vals[0] < vals[-1], (phase, vals)
        posting = [lm.predict(w, fabric)[f"{phase}.proxy_posting"] for w in lm.WORLDS] \
            if phase != "total" else None
        if posting:
            assert posting == sorted(posting)


@pytest.mark.parametrize("fabric", lm.FABRICS)
@pytest.mark.parametrize("world", lm.WORLDS)
@pytest.mark.parametrize("kw", [{}, {"barrier": False}, {"graphs": False}, {"post_us": 0.2}])
def test_terms_sum_to_phase_totals(fabric, world, kw):
    r = lm.predict(world, fabric, **kw)
    for phase in ("dispatch", "combine"):
        parts = [r[f"{phase}.{t}"] for t in lm.TERMS]
        assert all(p >= 0 for p in parts)
        assert math.isclose(sum(parts), r[phase], rel_tol=1e-9)
    assert math.isclose(r["total"], r["dispatch"] + r["combine"])


def test_cx7_faster_than_efa_and_knobs_move_the_right_way():
    for w in lm.WORLDS:
        efa, cx7 = lm.predict(w, "efa"), lm.predict(w, "cx7")
        assert cx7["total"] < efa["total"]
        assert lm.predict(w, "efa", post_us=1.8)["total"] > lm.predict(w, "efa", post_us=1.0)["total"]
        assert lm.predict(w, "efa", barrier=False)["total"] < efa["total"]
        assert lm.predict(w, "efa", efa_efficiency=0.45)["total"] > efa["total"]
        assert lm.predict(w, "cx7", graphs=False)["total"] > cx7["total"]


def test_routing_statistics():
    for w in lm.WORLDS:
        st = lm.routing_stats(w)
        pmf = lm.rows_per_pair_pmf(w)
        assert math.isclose(pmf.sum(), 1.0, rel_tol=1e-9)
        mean = sum(i * p for i, p in enumerate(pmf))
        assert math.isclose(mean, lm.TOKENS * lm.TOPK / w, rel_tol=1e-9)
        assert st["private_rows"] >= 2 * st["rows_per_peer"] and st["private_rows"] % 8 == 0
        assert st["remote_peers"] == w - lm.GPUS_PER_NODE
        assert lm.kernel_scale(w) == pytest.approx(1.0)   # uniform routing: T*K rows per rank


def test_bad_inputs():
    with pytest.raises(ValueError):
        lm.predict(12, "efa")
    with pytest.raises(ValueError):
        lm.predict(16, "ib")


def test_main_writes_json_and_png(tmp_path, capsys):
    js, png = tmp_path / "m.json", tmp_path / "m.png"
    assert lm.main(["--json", str(js), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "MODEL (not measured)" in out and "| efa | 64 |" in out
    doc = json.loads(js.read_text())
    assert doc["kind"] == "MODEL (not measured)"
    assert {(r["fabric"], r["world"]) for r in doc["predictions"]} == \
        {(f, w) for f in lm.FABRICS for w in lm.WORLDS}
    assert doc["constants"]["FLAG_RTT_US"] == lm.FLAG_RTT_US
    assert any(p["source"] == "pplx-garden README" for p in doc["published"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("argv", [["--efa-efficiency", "2"], ["--post-us", "-1"], ["--post-us", "x"]])
def test_main_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as e:
        lm.main(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err
