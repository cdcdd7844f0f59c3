"""The report: every check in order, the exit status, the summary, the text and JSON forms, and
`moe-a2a doctor` itself (`run`, its args from cli.py)."""
from __future__ import annotations

import json
from dataclasses import asdict

from .common import SCHEMA, VERDICTS, Check, _rdma_provider
from .devices import check_gpus, check_nic_map, check_proxy_gpu, check_rdma_cm, check_rdma_devices
from .facts import collect_facts, registration_sizes
from .fabric import check_efa_installer, check_libfabric, check_local_provider, check_rdma_provider, check_transport
from .limits import check_environment, check_memlock
from .registration import check_fi_hmem, check_gpu_peer_memory, check_gpu_registration, check_registration


def run_checks(facts: dict) -> list[Check]:
    """Every check, in the order shown."""
    return [check_libfabric(facts), check_local_provider(facts, "tcp"), check_local_provider(facts, "shm"),
            check_rdma_devices(facts), check_rdma_provider(facts, "efa"), check_rdma_provider(facts, "verbs"),
            check_rdma_cm(facts), check_efa_installer(facts), check_transport(facts), check_gpus(facts),
            check_fi_hmem(facts), check_gpu_peer_memory(facts), check_gpu_registration(facts), check_proxy_gpu(facts),
            check_nic_map(facts), check_memlock(facts), check_registration(facts), check_environment(facts)]


def exit_code(checks: list[Check]) -> int:
    """1 when a check fails, else 0 (warnings do not change the exit status)."""
    return 1 if any(c.verdict == "fail" for c in checks) else 0


def summary(facts: dict, checks: list[Check]) -> str:
    failed = [c.name for c in checks if c.verdict == "fail"]
    warned = [c.name for c in checks if c.verdict == "warn"]
    prov = _rdma_provider(facts)
    if failed:
        return f"{len(failed)} check(s) failed ({', '.join(failed)}): fix them before running moe_a2a here."
    if prov is None:
        return ("No EFA or verbs device: moe_a2a runs on this host only (LocalCluster, tests, benchmarks over "
                "shm/tcp); nothing failed, so the exit status is 0.")
    return f"Ready for inter-node runs over {prov}" + (f", with warnings ({', '.join(warned)})." if warned else ".")


def report(facts: dict, checks: list[Check] | None = None) -> dict:
    """The `--json` document: schema, exit_code, summary, counts, checks, facts."""
    checks = run_checks(facts) if checks is None else checks
    return {"schema": SCHEMA, "exit_code": exit_code(checks), "summary": summary(facts, checks),
            "counts": {v: sum(c.verdict == v for c in checks) for v in VERDICTS},
            "checks": [asdict(c) for c in checks], "facts": facts}


def format_text(doc: dict) -> str:
    """The human-readable report: one line per check (details of several lines indented), the fix under
    anything not ok, then the summary."""
    width = max(len(c["name"]) for c in doc["checks"])
    out = [f"moe-a2a doctor ({doc['facts'].get('source', 'facts')})"]
    for c in doc["checks"]:
        first, *rest = c["detail"].splitlines() or [""]
        out.append(f"  {c['verdict']:<4}  {c['name']:<{width}}  {first}")
        out += [f"  {'':<4}  {'':<{width}}    {line}" for line in rest]
        if c["verdict"] != "ok" and c["fix"]:
            out.append(f"  {'':<4}  {'':<{width}}  fix: {c['fix']}")
    n = doc["counts"]
    out.append(f"{n['ok']} ok, {n['warn']} warn, {n['fail']} fail. {doc['summary']} (exit {doc['exit_code']})")
    return "\n".join(out)


def load_facts(path: str) -> dict:
    """Recorded facts (e.g. tests/data/doctor/p5_efa.json); keys starting with "_" are notes."""
    try:
        with open(path) as f:
            facts = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--facts {path}: {e}") from None
    if not isinstance(facts, dict) or facts.get("schema") != SCHEMA:
        raise ValueError(f"--facts {path}: not facts of schema {SCHEMA} (a --json report's 'facts')")
    facts.setdefault("source", f"recorded: {path}")
    return facts


def run(args) -> int:
    """`moe-a2a doctor` (args from cli.py): print the report, return the exit status."""
    if args.facts:
        facts = load_facts(args.facts)
        if "sizes" not in facts:
            facts["sizes"] = registration_sizes(args.world, args.node, args.tokens)
    else:
        facts = collect_facts(world=args.world, node=args.node, tokens=args.tokens)
    doc = report(facts)
    print(json.dumps(doc, indent=1) if args.json else format_text(doc))
    return doc["exit_code"]
