"""The configuration fingerprint every rank checks at bootstrap, before any buffer exists.

Ranks built with different sizes map each other's buffers with different layouts: one writes past the
end of what the other allocated (SIGSEGV), or reads rows at the wrong offsets (silently wrong data).
So `AllToAll` sends, with the host name of its first bootstrap exchange, everything that shapes the
buffers or the protocol: every field of `A2AConfig`, the `buffers` placement, the transport, the node
size, the number of proxies, the device type and the library version. If any of them differs, every
rank raises the same `ValueError`, naming each differing field and which ranks had which value.

The values are plain strings, so comparing them can fail on no input (a peer's unpicklable or
unorderable value never reaches the comparison). `differences` is shared with the DeepEP facade, which
checks its own first-call arguments the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from . import __version__
from .config import A2AConfig


def _text(value: Any) -> str:
    """How a value is compared and shown (`torch.bfloat16`, `128`, `None`, `'auto'`)."""
    return repr(value) if isinstance(value, str) else str(value)


def node_size_of(node_group) -> int | str:
    """What `node_group` says about the node size before the host names are known: an int, or "auto"."""
    if isinstance(node_group, int) and not isinstance(node_group, bool):
        return node_group
    if node_group is None or node_group == "auto":
        return "auto"
    import torch.distributed as dist

    return dist.get_world_size(node_group)  # a process group: its size


def _resolve_node_size(declared: int | str, hosts: Sequence[str]) -> str:
    """A rank's node size as `AllToAll` will use it: "auto" counts the ranks on the first host (ranks
    grouped contiguously by host in equal numbers); a grouping that does not allow it stays visible."""
    if declared != "auto":
        return _text(declared)
    n = hosts.count(hosts[0])
    if len(hosts) % n or any(hosts[i] != hosts[i // n * n] for i in range(len(hosts))):
        return "'auto' (hosts not grouped contiguously in equal numbers)"
    return str(n)  # compared as the int it resolves to


def of(cfg: A2AConfig, *, node_group, transport: str, buffers: str, proxies, device) -> dict[str, Any]:
    """This rank's fingerprint (plain values; the node size may still say "auto")."""
    fp: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        if f.init:  # every field a user sets; new fields are covered without a change here
            fp[f.name] = _text(getattr(cfg, f.name))
    fp["scale_block"] = _text(getattr(cfg, "block_size", cfg.scale_block))  # resolved: "auto" is 128 for fp8
    fp["buffers"] = _text(buffers)
    fp["transport"] = _text(transport)
    fp["node size"] = node_size_of(node_group)
    fp["proxies"] = _text(proxies)
    fp["device type"] = _text(getattr(device, "type", device))
    fp["moe_a2a version"] = _text(__version__)
    return fp


# What a difference in these fields means, said after their line.
_HINTS = {"proxies": "every rank must run the same number of proxy processes",
          "node size": "every rank must see the same node size (node_group)",
          "moe_a2a version": "every rank must run the same moe_a2a"}


def differences(table: Sequence[dict[str, str]]) -> list[str]:
    """One line per field whose value differs between ranks: `field: v1 on rank(s) 0, 2; v2 on rank(s) 1`
    (values in the order of the first rank that has each)."""
    lines = []
    names = list(dict.fromkeys(name for row in table for name in row))
    for name in names:
        by_value: dict[str, list[int]] = {}
        for rank, row in enumerate(table):
            by_value.setdefault(row.get(name, "(missing)"), []).append(rank)
        if len(by_value) > 1:
            lines.append(f"{name}: " + "; ".join(
                f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                for value, ranks in by_value.items()) + (f" ({_HINTS[name]})" if name in _HINTS else ""))
    return lines


def check(table: Sequence[Any], hosts: Sequence[str], rank: int) -> None:
    """Raise ValueError (alike on every rank: every rank holds the same table) when the fingerprints in
    `table` (one per rank, from the bootstrap exchange) differ."""
    rows = []
    for r, fp in enumerate(table):
        if not isinstance(fp, dict):
            rows.append({"fingerprint": f"(not a fingerprint: {type(fp).__name__})"})
            continue
        row = {k: str(v) for k, v in fp.items() if k != "node size"}
        row["node size"] = _resolve_node_size(fp.get("node size", "(missing)"), hosts)
        rows.append(row)
    diff = differences(rows)
    if diff:
        raise ValueError(f"rank {rank}: AllToAll was built with different configurations on different ranks "
                         f"(every rank must pass the same A2AConfig, buffers, transport, node_group and proxies); "
                         f"refused on every rank before any buffer was allocated:\n  " + "\n  ".join(diff))


def all_gather(group, obj) -> list:
    """Every rank's picklable `obj`, indexed by group rank (`group` None: WORLD)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def exchange(group, cfg: A2AConfig, *, node_group, transport: str, buffers: str, proxies, device) -> list[str]:
    """The first bootstrap exchange of `AllToAll`: the host names (returned, indexed by group rank) with
    each rank's fingerprint, checked (`check`) before anything else happens."""
    import socket

    import torch.distributed as dist

    mine = of(cfg, node_group=node_group, transport=transport, buffers=buffers, proxies=proxies, device=device)
    table = all_gather(group, (socket.gethostname(), mine))
    hosts = [t[0] if isinstance(t, tuple) and len(t) == 2 else str(t) for t in table]
    check([t[1] if isinstance(t, tuple) and len(t) == 2 else None for t in table], hosts, dist.get_rank(group))
    return hosts


__all__ = ["all_gather", "check", "differences", "exchange", "of"]
