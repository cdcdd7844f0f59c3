"""benchmarks/gpu/summarise_bytes.py: two small `bench e2e --graph` results of the JSON schema graph.run writes
(per_route and sender_reduced of one run) give one markdown table with the slowest rank's medians, the bytes per
rank and their ratio to per_route; other JSON files are passed over."""
import importlib.util
import json
import pathlib

from moe_a2a.bench.main import WIRE_NAMES

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("summarise_bytes", ROOT / "benchmarks" / "gpu" / "summarise_bytes.py")
sb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sb)


def _stats(median: float) -> dict:
    return {"median": median, "p10": median - 1, "p90": median + 1, "min": median - 2, "n": 100}


def _bytes(d_node: int, c_node: int) -> dict:
    return {"dispatch": {"node_sent": d_node, "remote_sent": 0, "node_received": d_node, "remote_received": 0},
            "combine": {"node_sent": c_node, "remote_sent": 0, "node_received": c_node, "remote_received": 0}}


def _result(wire: str, d_us: tuple, c_us: tuple, nbytes: list[dict], problems: list[str]) -> dict:
    """What `moe-a2a bench e2e --graph --no-nccl --preset decode --world 2 --node 2 --wire WIRE --json` writes."""
    graph = [{"dispatch": _stats(d), "combine": _stats(c), "total": _stats(d + c), "node_local": True,
              "trace": {"rank": r, "model": {}, "proxy": {}, "bytes": b}}
             for r, (d, c, b) in enumerate(zip(d_us, c_us, nbytes))]
    return {"date": "2026-12-02T06:00:00+00:00", "command": f"bench e2e --graph --wire {wire}", "world": 2, "node": 2,
            "proxies": "auto", "buffers": "auto", "transport": "auto", "wire": wire, "device": "NVIDIA H200",
            "torch": "2.11.0", "presets": {"decode": {
                "config": "A2AConfig(...)", "graph": graph, "eager": [{"dispatch": _stats(90), "combine": _stats(90),
                                                                       "total": _stats(180)}] * 2,
                "floor": {"dispatch": 10.0, "combine": 12.0}, "bytes_per_rank": nbytes,
                "check": {"calls": 1, "problems": problems}, "seconds": 12.3}}}


def test_wire_order_is_the_references():
    assert sb.WIRE_ORDER == WIRE_NAMES


def test_one_table_with_medians_bytes_and_ratios(tmp_path, capsys):
    (tmp_path / "e2e_bytes_w2n2_decode_sender_reduced.json").write_text(json.dumps(
        _result("sender_reduced", (30.0, 32.5), (20.0, 19.0), [_bytes(600_000, 500_000), _bytes(400_000, 500_000)],
                [])))
    (tmp_path / "e2e_bytes_w2n2_decode_per_route.json").write_text(json.dumps(
        _result("per_route", (40.0, 41.0), (37.0, 39.5), [_bytes(1_000_000, 2_000_000)] * 2, ["rank 0: one problem"])))
    (tmp_path / "eager.json").write_text(json.dumps({"world": 2, "per_rank": [], "bytes_per_rank": []}))
    (tmp_path / "notes.json").write_text("not json")
    assert sb.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| world | ranks per node | preset | wire |") and lines[1].startswith("|---")
    per_route, sender = lines[2], lines[3]  # per_route first (the reference's order), whatever the file names
    assert per_route == ("| 2 | 2 | decode | per_route | 41.0 | 39.5 | 80.5 | 1,000,000 / 0 | 2,000,000 / 0 | "
                         "1.00 / 1.00 / 1.00 | 1 problem |")
    # the slowest rank per column; bytes the mean over ranks; ratios against per_route of the same run
    assert sender == ("| 2 | 2 | decode | sender_reduced | 32.5 | 20.0 | 51.5 | 500,000 / 0 | 500,000 / 0 | "
                      "0.50 / 0.25 / 0.33 | ok |")
    assert len([ln for ln in lines if ln.startswith("| 2 |")]) == 2


def test_without_per_route_the_ratio_is_a_dash(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(
        _result("fp8_combine", (30.0, 30.0), (20.0, 20.0), [_bytes(10, 20)] * 2, [])))
    assert sb.main([str(tmp_path)]) == 0
    assert "| 2 | 2 | decode | fp8_combine | 30.0 | 20.0 | 50.0 | 10 / 0 | 20 / 0 | - | ok |" in capsys.readouterr().out


def test_an_empty_folder_says_so(tmp_path, capsys):
    assert sb.main([str(tmp_path)]) == 1
    assert "no bench e2e --graph results" in capsys.readouterr().err


def test_runs_with_several_proxies_a_rank_are_labelled_and_compared_with_one_proxy_s_per_route(tmp_path, capsys):
    for wire, proxies, us in (("per_route", 1, 40.0), ("per_route", 2, 80.0), ("relay", 2, 30.0)):
        doc = _result(wire, (us, us), (us, us), [_bytes(1_000, 2_000)] * 2, [])
        doc["proxies"] = proxies
        (tmp_path / f"{wire}_{proxies}.json").write_text(json.dumps(doc))
    assert sb.main([str(tmp_path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 2 |")]
    assert [ln.split(" | ")[3] for ln in lines] == ["per_route", "per_route:2", "relay:2"]
    assert lines[1].split(" | ")[6] == "160.0" and lines[1].split(" | ")[9] == "1.00 / 1.00 / 1.00"
