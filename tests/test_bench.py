"""The `moe-a2a` command line: every bench option documented, e2e writes JSON and PNG (CPU)."""
import json

import pytest

from moe_a2a.bench import main as bench_main
from moe_a2a.cli import main as cli_main


def test_every_bench_option_is_documented():
    import argparse

    from moe_a2a.bench import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"kernels", "flags", "e2e", "timeline", "nccl", "transport"}
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"bench {name} {action.option_strings} has no help text"


def test_demo_rejects_bad_world_before_starting():
    with pytest.raises(ValueError, match="divisible|node_size"):
        cli_main(["demo", "--world-size", "3", "--node-size", "2", "--device", "cpu"])


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
