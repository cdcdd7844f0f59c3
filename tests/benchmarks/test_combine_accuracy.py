"""benchmarks/combine_accuracy.py: a small run writes its JSON and plot, and docs/accuracy.md shows the
tables of the recorded run (docs/results/accuracy-2026-12-02/)."""
import json
import pathlib

from benchmarks import combine_accuracy as ca

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "results" / "accuracy-2026-12-02" / "combine_accuracy.json"


def test_quick_run_writes_json_and_png(tmp_path, capsys):
    assert ca.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "combine_accuracy.json").read_text())
    assert doc["command"].endswith("--quick") and len(doc["cases"]) == len(ca.INPUTS)
    for c in doc["cases"]:
        e = c["errors"]
        assert e["receiver_bf16"]["max_ulpA"] <= 1.0 + 1e-9           # one bf16 rounding of the sum
        assert e["sender_bf16"]["max_ulpA"] <= 3.0                     # 2u|S| + uA, |S| <= A
        assert e["receiver_fp32"]["rel_l2"] < 1e-6
        assert e["receiver_bf16"]["frac_differs_from_today"] == 0.0
    assert (tmp_path / "combine_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "receiver_bf16" in capsys.readouterr().out


def test_the_page_shows_the_recorded_run():
    doc = json.loads(RUN.read_text())
    page = (ROOT / "docs" / "accuracy.md").read_text()
    assert doc["command"] == "python -m benchmarks.combine_accuracy" and doc["command"] in page
    assert ca.summary_table(doc["cases"]) in page
    assert ca.worst_table(doc["cases"]) in page
    assert doc["date"][:10] in page and doc["host"]["torch"] in page
    assert len(doc["cases"]) == len(ca.grid(quick=False))
