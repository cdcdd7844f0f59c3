"""One markdown table of issue 32's wire variants from `bash benchmarks/gpu/run.sh mps bytes`.

    python3 benchmarks/gpu/summarise_bytes.py RESULTS_DIR

Reads every `moe-a2a bench e2e --graph` JSON in RESULTS_DIR (run.sh names them
`e2e_bytes_w<W>n<N>_<preset>_<wire>.json`; any graph JSON is read by its contents, not its name) and prints,
per (world, ranks per node, preset, wire variant): the slowest rank's graph-replay medians of dispatch,
combine and both halves (µs; the d + c column is the slowest rank's median of the sum), the bytes each rank
sent per phase, node-local and remote (the mean over ranks of `bytes_per_rank`: the traced graph call,
`AllToAll.bytes_last_call()`), their ratio to per_route's of the same world, node size and preset (all
variants route the same inputs, so the ratio is the variant's alone), and the oracle's verdict (decode only).
Files older than the `wire` field count as per_route. Standard library only.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

# reference.WIRE_VARIANTS' names in its order (tests/benchmarks/test_summarise_bytes.py holds them to it)
WIRE_ORDER = ("per_route", "per_rank_dispatch", "sender_reduced", "fp8_combine", "sender_reduced_fp8")
PRESET_ORDER = ("decode", "prefill")
PHASES = ("dispatch", "combine")


def _slowest(graph: list[dict], half: str) -> float:
    return max(r[half]["median"] for r in graph)  # the slowest rank is the call's latency


def _mean_sent(bytes_per_rank: list[dict], phase: str, where: str) -> float:
    return sum(b[phase][f"{where}_sent"] for b in bytes_per_rank) / len(bytes_per_rank)


def _n_problems(n: int) -> str:
    return f"{n} problem" + ("s" if n != 1 else "")


def rows_of(doc: dict, source: str) -> list[dict]:
    """The table's rows of one `bench e2e --graph` result (one per preset); none for another kind of JSON."""
    if not isinstance(doc.get("presets"), dict):
        return []
    rows = []
    for preset, res in doc["presets"].items():
        graph = res.get("graph") or []
        if not graph:
            continue
        nbytes = res.get("bytes_per_rank") or [g["trace"]["bytes"] for g in graph if "bytes" in g.get("trace", {})]
        check = res.get("check")
        proxies = doc.get("proxies")
        rows.append({
            # WIRE:K where the run had K > 1 proxies a rank (`run.sh mps relay`'s per_route:2, relay:2)
            "world": doc["world"], "node": doc["node"], "preset": preset,
            "wire": doc.get("wire", "per_route") + (f":{proxies}" if isinstance(proxies, int) and proxies > 1 else ""),
            "transport": doc.get("transport", "?"), "source": source,
            "dispatch_us": _slowest(graph, "dispatch"), "combine_us": _slowest(graph, "combine"),
            "total_us": _slowest(graph, "total"),
            "bytes": None if not nbytes else {ph: {w: _mean_sent(nbytes, ph, w) for w in ("node", "remote")}
                                              for ph in PHASES},
            "check": "-" if check is None else "ok" if not check["problems"] else _n_problems(len(check["problems"])),
        })
    return rows


def _base(row: dict) -> str:
    return row["wire"].split(":")[0]


def load(results_dir: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"summarise_bytes: skipping {path}: {e}", file=sys.stderr)
            continue
        if isinstance(doc, dict):
            rows += rows_of(doc, os.path.basename(path))
    key = lambda r: (r["world"], -r["node"], PRESET_ORDER.index(r["preset"]) if r["preset"] in PRESET_ORDER else 9,
                     WIRE_ORDER.index(_base(r)) if _base(r) in WIRE_ORDER else 9, r["wire"])  # noqa: E731
    return sorted(rows, key=key)


def _total(b: dict, phase: str | None = None) -> float:
    return sum(b[ph][w] for ph in ((phase,) if phase else PHASES) for w in ("node", "remote"))


def _ratios(row: dict, base: dict | None) -> str:
    if row["bytes"] is None or base is None or base["bytes"] is None:
        return "-"
    parts = []
    for phase in (*PHASES, None):
        den = _total(base["bytes"], phase)
        parts.append(f"{_total(row['bytes'], phase) / den:.2f}" if den else "-")
    return " / ".join(parts)


def table(rows: list[dict]) -> str:
    """The markdown table (header, separator, one line per row)."""
    base = {(r["world"], r["node"], r["preset"]): r for r in rows if r["wire"] == "per_route"}
    out = ["| world | ranks per node | preset | wire | dispatch µs | combine µs | d + c µs | dispatch B/rank "
           "node / remote | combine B/rank node / remote | bytes vs per_route: d / c / d + c | check |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["bytes"]
        fmt = (lambda ph: f"{b[ph]['node']:,.0f} / {b[ph]['remote']:,.0f}") if b else (lambda ph: "-")
        out.append(f"| {r['world']} | {r['node']} | {r['preset']} | {r['wire']} | {r['dispatch_us']:.1f} | "
                   f"{r['combine_us']:.1f} | {r['total_us']:.1f} | {fmt('dispatch')} | {fmt('combine')} | "
                   f"{_ratios(r, base.get((r['world'], r['node'], r['preset'])))} | {r['check']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results_dir", metavar="RESULTS_DIR", help="the folder of the bench e2e --graph JSON files")
    args = p.parse_args(argv)
    rows = load(args.results_dir)
    if not rows:
        print(f"summarise_bytes: no bench e2e --graph results in {args.results_dir}", file=sys.stderr)
        return 1
    print(table(rows))
    print("\nµs: graph replay, median of the slowest rank. B/rank: bytes each rank sent in the traced graph call, "
          "mean over ranks (node: the other ranks of its node; remote: other nodes). check: the oracle on one "
          "decode replay (-: not checked).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
