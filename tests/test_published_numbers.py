"""The README's published numbers are the numbers of their raw files.

Each entry of `PUBLISHED` is one number (or range) as the README prints it, the file(s) under
`docs/results/` it comes from, how to get it from them, and the rounding the README uses (the number of
decimals printed). The test finds the printed text in its README section, reads the file(s), rounds
what it computes to the printed decimals and compares: editing a README number or a raw file without
the other fails here. Pure file reading; no process, no GPU.

The last test checks the other direction for every page: each file the README and `docs/*.md` name
under `docs/results/` exists.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
README = ROOT / "README.md"
MEASURED = "## Measured so far"
NOT_DONE = "## Not done, not tested"


# ---- how numbers are read from the raw files ------------------------------------------------------------
def _json(name: str):
    return json.loads((RESULTS / name).read_text())


def _runs(pattern: str) -> list:
    """Every JSON file matching `pattern` under docs/results, in name order."""
    paths = sorted(RESULTS.glob(pattern))
    assert paths, f"no file matches docs/results/{pattern}"
    return [json.loads(p.read_text()) for p in paths]


def ranks(run: dict, preset: str, kind: str, half: str) -> list[float]:
    """Per-rank medians of `bench e2e --graph` (kind "graph" or "eager"; half dispatch / combine / total)."""
    return [r[half]["median"] for r in run["presets"][preset][kind]]


def slowest(run: dict, preset: str, kind: str, half: str) -> float:
    return max(ranks(run, preset, kind, half))  # the slower rank is the call's latency


def nccl(run: dict, preset: str) -> list[float]:
    """Per-rank NCCL baseline: that rank's dispatch median + combine median."""
    return [r["dispatch"]["median"] + r["combine"]["median"] for r in run["presets"][preset]["nccl"]]


def e2e_totals(run: dict) -> list[float]:
    """Per-rank total medians of the eager `bench e2e` (per_rank layout)."""
    return [r["total"]["median"] for r in run["per_rank"]]


def span(values) -> tuple[float, float]:
    values = list(values)
    return min(values), max(values)


def kernels(run: dict, preset: str) -> dict:
    return next(k for k in run["kernels"] if k["preset"] == preset)["kernels"]


FIVE = ("route_tokens", "pack_tokens_by_expert", "unpack_tokens_by_expert", "pack_combine_by_source",
        "reduce_combined_tokens")  # the kernels of one dispatch + combine (quantize_fp8 is the caller's)
LOCAL_DISPATCH = FIVE[:3]


def gpu_us(run, names) -> list[float]:
    return [kernels(run, "decode")[n]["triton"]["median_us"] for n in names]


def torch_us(run, names) -> list[float]:
    return [kernels(run, "decode")[n]["torch"]["median_us"] for n in names]


def proxy_phase(run: dict, world: int, phase: str) -> float:
    return next(r for r in run["results"] if r["world"] == world)[f"{phase}_host_us"]["median"]


def proxy_goal(run: dict) -> tuple[float, float]:
    """(fixed µs, µs per remote peer) of the goal the bench recorded per world size."""
    (w0, g0), (w1, g1) = [(r["remote_peers"], r["goal_us"]) for r in run["results"][:2]]
    per_peer = (g1 - g0) / (w1 - w0)
    return g0 - per_peer * w0, per_peer


def decode_graph_total(run: dict) -> float:
    return slowest(run, "decode", "graph", "total")


X2_N1 = "x2_n1_2026-11-30/"
BYTES = "gpu-2026-12-02-s10/lease3/mps/e2e_bytes_w2n2_"  # issue 32's levers, 2 ranks of one node under MPS


def sent_bytes(run: dict, preset: str, phases=("dispatch", "combine")) -> float:
    """Bytes a rank sent in the traced call (node-local and remote), mean over ranks, over `phases`."""
    per_rank = run["presets"][preset]["bytes_per_rank"]
    return statistics.fmean(sum(r[ph]["node_sent"] + r[ph]["remote_sent"] for ph in phases) for r in per_rank)


# ---- the table: (README text, files, how to extract, decimals printed) ---------------------------------
class Published(NamedTuple):
    text: str                      # exactly as printed in the README section
    files: tuple[str, ...]         # under docs/results/ (glob patterns allowed)
    value: Callable                # loaded files -> a number, or a (low, high) pair for a range
    decimals: int = 0              # the README prints the value(s) rounded to this many decimals
    section: str = MEASURED


def _load(files):
    return [(_runs(f) if any(c in f for c in "*?") else _json(f)) for f in files]


MEASURED_ROWS = [
    # dispatch + combine, one node, one rank per GPU, graph
    Published("**dispatch 39 µs", ("e2e_graph_x2.json",), lambda d: slowest(d, "decode", "graph", "dispatch")),
    Published("combine 37 µs**", ("e2e_graph_x2.json",), lambda d: slowest(d, "decode", "graph", "combine")),
    Published("75 µs for both", ("e2e_graph_x2_fasthost.json",), decode_graph_total),
    Published("NCCL's 1115–1178 µs", ("e2e_graph_x2_fasthost.json",), lambda d: span(nccl(d, "decode"))),
    Published("**15–16× faster**", ("e2e_graph_x2_fasthost.json",),
              lambda d: (min(nccl(d, "decode")) / decode_graph_total(d),
                         max(nccl(d, "decode")) / min(ranks(d, "decode", "graph", "total")))),
    # eager, three runs on three hosts
    Published("167–286 µs for both halves",
              ("e2e_graph_x2_fasthost.json", "e2e_graph_x2.json", "e2e_graph_x2_slowhost.json"),
              lambda *runs: span(t for d in runs for t in ranks(d, "decode", "eager", "total"))),
    # prefill
    Published("1.2 ms for both halves", ("e2e_graph_x2.json",),
              lambda d: slowest(d, "prefill", "graph", "total") / 1e3, 1),
    Published("NCCL baseline 6.90–6.96 ms", ("e2e_graph_x2_fasthost.json",),
              lambda d: tuple(v / 1e3 for v in span(nccl(d, "prefill"))), 2),
    # the kernels, GPU time
    Published("**26 µs** in all", ("quick/kernels.json",), lambda d: sum(gpu_us(d, FIVE))),
    Published("(3–8 µs each)", ("quick/kernels.json",), lambda d: span(gpu_us(d, FIVE))),
    Published("route + pack + unpack 14.6 µs", ("quick/kernels.json",),
              lambda d: sum(gpu_us(d, LOCAL_DISPATCH)), 1),
    Published("against 1265 µs for the same work in plain torch", ("quick/kernels.json",),
              lambda d: sum(torch_us(d, LOCAL_DISPATCH))),
    # flag round trip
    Published("6.1 µs median", ("flags.json",), lambda d: d["flag_round_trip_us"]["median"], 1),
    # across two simulated nodes (medians over runs of the slower rank's median)
    Published("2.6 ms (medians", (X2_N1 + "staged_remote_first_*.json",),
              lambda runs: statistics.median(map(decode_graph_total, runs)) / 1e3, 1),
    Published("medians of 5–7 runs", (X2_N1 + "staged_remote_first_*.json", X2_N1 + "staged_pack_all_at_once_*.json"),
              lambda first, all_at_once: (len(first), len(all_at_once))),
    Published("only remote rows staged 2584–2597 µs",
              (X2_N1 + "staged_remote_first_*.json", X2_N1 + "staged_pack_all_at_once_*.json"),
              lambda first, all_at_once: (statistics.median(map(decode_graph_total, first)),
                                          statistics.median(map(decode_graph_total, all_at_once)))),
    Published("every row staged 2708 µs", (X2_N1 + "host_*.json",),
              lambda runs: statistics.median(map(decode_graph_total, runs))),
    # ranks sharing one GPU
    Published("1.54–1.57 ms per dispatch + combine", ("e2e_w4n4_shared_fixed.json",),
              lambda d: tuple(v / 1e3 for v in span(e2e_totals(d))), 2),
    # ranks sharing one GPU under MPS, graph, decode (slowest rank's dispatch + combine)
    Published("**78 / 165 / 285 µs at 2 / 4 / 8 ranks**",
              ("gpu-2026-12-02-mps/e2e_graph_w2n2_auto.json", "gpu-2026-12-02-mps/e2e_graph_w4n4_auto.json",
               "gpu-2026-12-02-mps/e2e_graph_w8n8_auto.json"),
              lambda *runs: tuple(slowest(d, "decode", "graph", "total") for d in runs) + (2, 4, 8)),
    Published("emulated NIC: 260 / 438 / 799 µs",
              ("gpu-2026-12-02-mps/e2e_graph_w2n1_emulated.json", "gpu-2026-12-02-mps/e2e_graph_w4n2_emulated.json",
               "gpu-2026-12-02-mps/e2e_graph_w8n4_emulated.json"),
              lambda *runs: tuple(slowest(d, "decode", "graph", "total") for d in runs)),
    # issue 32's levers: bytes a rank sends, and the per-rank dispatch's time, against one row per route
    Published("**0.19x** with all three", (BYTES + "prefill_sender_reduced_fp8.json", BYTES + "prefill_per_route.json"),
              lambda lev, base: sent_bytes(lev, "prefill") / sent_bytes(base, "prefill"), 2),
    Published("0.19x at decode too", (BYTES + "decode_sender_reduced_fp8.json", BYTES + "decode_per_route.json"),
              lambda lev, base: sent_bytes(lev, "decode") / sent_bytes(base, "decode"), 2),
    Published("dispatch rows per (token, rank) 0.28x", (BYTES + "prefill_per_rank_dispatch.json",
                                                        BYTES + "prefill_per_route.json"),
              lambda lev, base: sent_bytes(lev, "prefill", ("dispatch",)) / sent_bytes(base, "prefill", ("dispatch",)),
              2),
    Published("363 µs against 510", (BYTES + "prefill_per_rank_dispatch.json", BYTES + "prefill_per_route.json"),
              lambda lev, base: (slowest(lev, "prefill", "graph", "dispatch"), slowest(base, "prefill", "graph",
                                                                                       "dispatch"))),
    Published("dispatch + combine 1006 µs against 1196", (BYTES + "prefill_per_rank_dispatch.json",
                                                          BYTES + "prefill_per_route.json"),
              lambda lev, base: (slowest(lev, "prefill", "graph", "total"), slowest(base, "prefill", "graph", "total"))),
    Published("(1015 µs against 690)", (BYTES + "prefill_sender_reduced.json", BYTES + "prefill_per_route.json"),
              lambda lev, base: (slowest(lev, "prefill", "graph", "combine"), slowest(base, "prefill", "graph",
                                                                                      "combine"))),
    # the proxy's host time per phase
    Published("**36 / 29 µs at 8 ranks", ("emulated/proxy_shm.json",),
              lambda d: (proxy_phase(d, 8, "dispatch"), proxy_phase(d, 8, "combine"))),
    Published("198 / 171 µs at 64**", ("emulated/proxy_shm.json",),
              lambda d: (proxy_phase(d, 64, "dispatch"), proxy_phase(d, 64, "combine"))),
    Published("1109 / 839 µs at 256", ("emulated/proxy_shm.json",),
              lambda d: (proxy_phase(d, 256, "dispatch"), proxy_phase(d, 256, "combine"))),
    Published("the goal 10 + 0.9 µs per peer", ("emulated/proxy_shm.json",), proxy_goal, 1),
    # the emulated NIC (slower rank)
    Published("1.67 ms (EFA-like", ("emulated/e2e_emulated.json",), lambda d: max(e2e_totals(d)) / 1e3, 2),
    Published("`12us,25GBps`: 1.93 ms)", ("emulated/e2e_emulated_efa.json",),
              lambda d: max(e2e_totals(d)) / 1e3, 2),
]

# The DeepEP facade against AllToAll fed pre-quantised rows, eleven runs in three leases of one H200.
S12_FACADE = ("gpu-2026-12-02-s12/lease2/facade_new_*.json", "gpu-2026-12-02-s12/lease3/facade_new_*.json",
              "gpu-2026-12-02-s12/lease4/facade_new_*.json")

# The facade's graph gap, three runs on one H100 (2026-12-07): e7fe048's kernels, then twice at c0b484d.
GAP_RUNS = ("gpu-2026-12-07/callA/gap_base.json", "gpu-2026-12-07/call5/gap_*.json")

NOT_DONE_ROWS = [
    Published("1.2 ms for dispatch + combine at 2 ranks", ("e2e_graph_x2.json",),
              lambda d: slowest(d, "prefill", "graph", "total") / 1e3, 1, NOT_DONE),
    Published("eager dispatch + combine is 167–286 µs",
              ("e2e_graph_x2_fasthost.json", "e2e_graph_x2.json", "e2e_graph_x2_slowhost.json"),
              lambda *runs: span(t for d in runs for t in ranks(d, "decode", "eager", "total")), 0, NOT_DONE),
    Published("1.54–1.57 ms per call", ("e2e_w4n4_shared_fixed.json",),
              lambda d: tuple(v / 1e3 for v in span(e2e_totals(d))), 2, NOT_DONE),
    Published("decode, 2.6 ms", (X2_N1 + "staged_remote_first_*.json",),
              lambda runs: statistics.median(map(decode_graph_total, runs)) / 1e3, 1, NOT_DONE),
    Published("1.5× faster", ("e2e_w4n1_k1.json", "e2e_w4n1_k3.json"),
              lambda one, three: max(e2e_totals(one)) / max(e2e_totals(three)), 1, NOT_DONE),
    Published("costs 5.3 µs a pair more than `AllToAll`", GAP_RUNS,
              lambda one, two: statistics.median(r["gap_us"]["facade-plain"] for r in [one, *two]), 1, NOT_DONE),
    Published("4.8-5.7; 3.9 µs of it the scales", GAP_RUNS,
              lambda one, two: (*span(r["gap_us"]["facade-plain"] for r in [one, *two]),
                                statistics.median(r["gap_us"]["layout (deep-plain)"] for r in [one, *two])),
              1, NOT_DONE),
    Published("16 µs eager (median of eleven runs", S12_FACADE,
              lambda *leases: statistics.median(r["per_rank"][0]["facade_minus_a2a_interleaved_eager_us"]["median"]
                                                for runs in leases for r in runs) if sum(map(len, leases)) == 11
              else None, 0, NOT_DONE),
]

NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def _printed_numbers(text: str) -> list[float]:
    """The numbers of `text`, in order, leaving out what is inside backticks (a setting such as
    `12us,25GBps`). The published value is the first one (two for a range or a pair); what follows is
    context ("at 8 ranks"), which the exact-text check covers."""
    return [float(m) for m in NUMBER.findall(re.sub(r"`[^`]*`", "", text))]


@pytest.mark.parametrize("entry", MEASURED_ROWS + NOT_DONE_ROWS, ids=lambda e: e.text)
def test_readme_number_is_its_files_number(entry: Published):
    section = _section(README.read_text(), entry.section)
    assert entry.text in section, f"README ({entry.section}) no longer prints {entry.text!r}: update this table"
    value = entry.value(*_load(entry.files))
    computed = [round(v, entry.decimals) for v in (value if isinstance(value, tuple) else (value,))]
    printed = _printed_numbers(entry.text)[:len(computed)]
    assert printed == computed, (f"README prints {entry.text!r}; {', '.join(entry.files)} give(s) "
                                 f"{value} -> {computed} at {entry.decimals} decimals")


def test_every_row_of_the_measured_table_is_checked():
    """Each row of the README's table has at least one entry above, and names its raw file(s), which
    the entries read."""
    rows = [l for l in _section(README.read_text(), MEASURED).splitlines()
            if l.startswith("| ") and not l.startswith("| what")]
    assert rows
    for row in rows:
        checked = [e for e in MEASURED_ROWS if e.text in row]
        assert checked, f"no entry checks this row of the README's table: {row[:80]}"
        named = {f.rstrip("/") for f in re.findall(r"`([^`]+\.json|[^`]+/)`", row.split("|")[-2])}
        used = {f for e in checked for f in e.files}
        assert named, f"the row names no raw file: {row[:80]}"
        for f in named:
            assert any(u == f or u.startswith(f + "/") for u in used), \
                f"the row names {f}, which none of its entries reads"


def test_the_check_catches_an_edited_number():
    """The comparison itself: a README number one off, or a file value moved, is a mismatch."""
    entry = MEASURED_ROWS[0]
    value = round(entry.value(*_load(entry.files)), entry.decimals)
    assert _printed_numbers(entry.text) == [value]
    assert _printed_numbers(entry.text.replace("39", "38")) != [value]
    assert _printed_numbers(entry.text) != [round(value + 1, entry.decimals)]


# ---- every file the pages name under docs/results/ exists ---------------------------------------------
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# `docs/results/x`, `results/x` (links from docs/), and bare names in backticks, e.g. `flags.json`
RESULT_PATH = re.compile(r"(?:docs/)?results/([\w.*/-]+)")
BARE_NAME = re.compile(r"`([\w*.-]+(?:/[\w*.-]+)*\.(?:json|txt|png)|[\w-]+_20\d\d-\d\d-\d\d\w*/)`")


def _resolves(name: str) -> bool:
    name = re.sub(r"^(docs/)?results/", "", name.rstrip("/."))
    if (RESULTS / name).exists() or any(RESULTS.glob(name)):
        return True
    return any(RESULTS.rglob(name))  # a bare file name, or a path relative to a results/ subfolder


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_results_file_a_page_names_exists(page: Path):
    missing = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        names = set(RESULT_PATH.findall(line)) | set(BARE_NAME.findall(line))
        for name in names:
            if name.startswith("<") or "$" in name or not name.rstrip("/."):
                continue
            if not _resolves(name):
                missing.append(f"{page.relative_to(ROOT)}:{n}: {name}")
    assert not missing, "files named under docs/results/ that are not there:\n" + "\n".join(missing)
