"""`moe-a2a bench` (moe_a2a/bench/main.py) and the `moe-a2a` parser: every option documented, nested
sub-commands take --help, bad values are one-line argparse errors, e2e writes JSON and PNG (CPU)."""
import json

import pytest

from moe_a2a.bench import main as bench_main
from moe_a2a.cli import main as cli_main
from ..conftest import interpreter_only


def test_every_bench_option_is_documented():
    import argparse

    from moe_a2a.bench import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"kernels", "e2e", "timeline", "nccl"}  # the instruments: benchmarks/
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"bench {name} {action.option_strings} has no help text"


def test_every_cli_option_is_documented():
    import argparse

    from moe_a2a.cli import build_parser

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, path + [name])
            elif action.option_strings and action.dest != "help":
                assert action.help, f"moe-a2a {' '.join(path)} {action.option_strings} has no help text"
                yield path

    paths = {tuple(p) for p in walk(build_parser(), [])}
    assert ("demo",) in paths and ("bench", "e2e") in paths and ("bench", "nccl") in paths


@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "-h"], ["bench", "kernels", "--help"],
                                  ["bench", "nccl", "--help"], ["bench", "e2e", "-h"], ["demo", "--help"]])
def test_nested_help_exits_0(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: moe-a2a")


@pytest.mark.parametrize("argv, flag", [
    (["demo", "--world-size", "0"], "--world-size"),
    (["demo", "--world-size", "3", "--node-size", "2", "--device", "cpu"], "--node-size"),
    (["demo", "--iters", "-1"], "--iters"),
    (["demo", "--timeout", "0"], "--timeout"),
    (["bench", "e2e", "--world", "3", "--node", "2"], "--node"),
    (["bench", "e2e", "--warmup", "-1"], "--warmup"),
    (["bench", "kernels", "--iters", "zero"], "--iters"),
    (["bench", "nccl", "--world", "0"], "--world"),
])
def test_bad_values_are_one_line_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "error:" in last and flag in last and "Traceback" not in err, err


@pytest.mark.parametrize("name", ["flags", "transport", "proxy", "soak"])
def test_the_instruments_are_not_bench_commands(name, capsys):
    # maintainers' instruments live in benchmarks/ (python -m benchmarks.<name>), not in the package
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", name])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_bench_main_alone_parses_like_the_cli():
    with pytest.raises(SystemExit) as e:
        bench_main(["e2e", "--world", "0"])
    assert e.value.code == 2


@interpreter_only("its ranks run on the CPU (--device cpu / device='cpu')")
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_e2e_bench_writes_json_and_png(tmp_path):
    out_json, out_png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    assert bench_main(["e2e", "--world", "2", "--node", "1", "--iters", "2", "--warmup", "1", "--device", "cpu",
                       "--json", str(out_json), "--png", str(out_png)]) == 0
    data = json.loads(out_json.read_text())
    assert len(data["per_rank"]) == 2
    for rank in data["per_rank"]:
        assert set(rank) == {"dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "total"}
        assert all(rank[p]["n"] == 2 and rank[p]["min"] > 0 for p in rank)
    assert out_png.stat().st_size > 10_000
    # the last call's bytes per rank (runtime/traffic.py): two simulated nodes, so every byte is remote, and
    # at least a count row (4 bytes per expert) goes each way; what one rank sends the other receives
    nbytes, experts = data["bytes_per_rank"], 8 * 2  # bench e2e's CPU sizes: 8 experts per rank
    assert len(nbytes) == 2
    for b in nbytes:
        assert set(b) == {"dispatch", "combine"}
        assert all(b[ph]["node_sent"] == b[ph]["node_received"] == 0 for ph in b)
        assert b["dispatch"]["remote_sent"] >= 4 * experts and b["dispatch"]["remote_received"] >= 4 * experts
    for ph in ("dispatch", "combine"):
        assert nbytes[0][ph]["remote_sent"] == nbytes[1][ph]["remote_received"]
        assert nbytes[1][ph]["remote_sent"] == nbytes[0][ph]["remote_received"]


@interpreter_only("its ranks run on the CPU (--device cpu / device='cpu')")
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_e2e_bench_runs_with_two_proxies_per_rank(tmp_path):
    out_json = tmp_path / "e2e.json"
    assert bench_main(["e2e", "--world", "3", "--node", "1", "--iters", "2", "--warmup", "1", "--device", "cpu",
                       "--proxies", "2", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["proxies"] == 2 and len(data["per_rank"]) == 3


@interpreter_only("its ranks run on the CPU (--device cpu / device='cpu')")
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_timeline_json_carries_the_traced_calls_bytes(tmp_path, capsys):
    out_json = tmp_path / "timeline.json"
    assert bench_main(["timeline", "--world", "2", "--node", "2", "--device", "cpu", "--png", str(tmp_path / "t.png"),
                       "--json", str(out_json)]) == 0
    traces = json.loads(out_json.read_text())["traces"]
    assert [t["rank"] for t in traces] == [0, 1]
    for t in traces:  # one node: the count row and rows go to the node peer, nothing remote
        b = t["bytes"]
        assert b["dispatch"]["node_sent"] >= 4 * 16 and b["dispatch"]["remote_sent"] == 0
        assert b["combine"]["remote_sent"] == b["combine"]["remote_received"] == 0
    assert traces[0]["bytes"]["combine"]["node_sent"] == traces[1]["bytes"]["combine"]["node_received"]
    assert "bytes sent" in capsys.readouterr().out
