"""The maintainers' instruments as commands (`python -m benchmarks.<name>`, benchmarks/_cli.py): every option
documented, --help exits 0, bad values are one-line argparse errors naming the flag, a provider libfabric
does not offer is one error line (exit 2), not a traceback."""
from __future__ import annotations

import argparse

import pytest

from benchmarks import flags, proxy, soak, transport

INSTRUMENTS = {"flags": flags, "proxy": proxy, "soak": soak, "transport": transport}


@pytest.mark.parametrize("name", sorted(INSTRUMENTS))
def test_every_option_is_documented_and_help_exits_0(name, capsys):
    parser = INSTRUMENTS[name].add_arguments(argparse.ArgumentParser())
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"benchmarks.{name} {action.option_strings} has no help text"
    with pytest.raises(SystemExit) as e:
        INSTRUMENTS[name].main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks.{name}")


@pytest.mark.parametrize("name, argv, flag", [
    ("flags", ["--reps", "0"], "--reps"),
    ("transport", ["--provider", "shm,foo"], "--provider"),
    ("transport", ["--peers", "1,0"], "--peers"),
    ("soak", ["--world", "3", "--node", "2"], "--node"),
    ("soak", ["--calls", "0"], "--calls"),
    ("proxy", ["--worlds", "0"], "--worlds"),
])
def test_bad_values_are_one_line_errors_naming_the_flag(name, argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        INSTRUMENTS[name].main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "error:" in last and flag in last and "Traceback" not in err, err


def test_missing_provider_is_an_error_line_not_a_traceback(capsys, monkeypatch):
    from moe_a2a.proxy import libfabric as lf

    listed = lf.list_providers
    # efa absent (as on every machine we have): taken out of the list where an EFA device is present
    monkeypatch.setattr(lf, "list_providers", lambda: [p for p in listed() if p != "efa"])
    assert transport.main(["--provider", "efa", "--plan-worlds", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m benchmarks.transport: error: --provider efa") and len(err.strip().splitlines()) == 1


def test_flags_says_it_needs_a_gpu(capsys, monkeypatch):
    from moe_a2a.bench import _util

    monkeypatch.setattr(_util, "has_cuda", lambda: False)
    assert flags.main([]) == 2
    assert capsys.readouterr().err.strip() == "python -m benchmarks.flags: needs a CUDA GPU (none found)"
