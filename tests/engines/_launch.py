"""Start an engine scenario's 2 rank processes and collect what each reports (tests/engines)."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORLD = 2
RANK_TIMEOUT_S = 300  # a rank's whole run (imports ~10 s, two calls in the interpreter)


def _free_ports(count: int) -> int:
    """A port p with p .. p + count - 1 free now (vLLM takes the next ports for its data-parallel groups)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + count):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free ports")


def run_ranks(module: str, scenario: str, tmp_path: pathlib.Path, env_extra: dict | None = None) -> list[dict]:
    """Run `python -m MODULE SCENARIO RANK WORLD PORT OUT` for each rank, from `tmp_path` (the installed
    distribution's entry points are what the engines' plugin loaders read); return each rank's report. With
    `MOE_A2A_ENGINES_RESULTS=DIR` set, the reports are also written there (docs/results/)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_A2A_")}
    env.update(MOE_A2A_AS_DEEP_EP="1", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), **(env_extra or {}))
    port = _free_ports(8)
    outs = [tmp_path / f"{scenario}-rank{r}.json" for r in range(WORLD)]
    logs = [open(tmp_path / f"{scenario}-rank{r}.log", "w") for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, "-m", module, scenario, str(r), str(WORLD), str(port), str(outs[r])],
                              cwd=tmp_path, env=env, stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(WORLD)]
    try:
        for p in procs:
            p.wait(timeout=RANK_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    reports = []
    for r in range(WORLD):
        if not outs[r].exists():
            tail = (tmp_path / f"{scenario}-rank{r}.log").read_text()[-3000:]
            raise AssertionError(f"{module} {scenario}: rank {r} wrote no report (exit {procs[r].returncode}):\n{tail}")
        reports.append(json.loads(outs[r].read_text()))
    assert not any("error" in rep for rep in reports), "\n".join(rep.get("error", "") for rep in reports)
    results = os.environ.get("MOE_A2A_ENGINES_RESULTS")
    if results:
        pathlib.Path(results).mkdir(parents=True, exist_ok=True)
        name = f"{module.rsplit('.', 1)[-1].strip('_')}-{scenario}.json"
        (pathlib.Path(results) / name).write_text(json.dumps(reports, indent=1) + "\n")
    return reports


def rank_main(run, argv) -> int:
    """A rank script's entry point: `run(scenario, rank, world, port)`'s dict (or the traceback) to the file
    `argv[4]`, then out past the engines' and the facade's atexit handlers (the test reads the file)."""
    import traceback

    scenario, rank, world, port, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    try:
        result = run(scenario, rank, world, port)
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        result = {"error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)

