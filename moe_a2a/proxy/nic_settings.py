"""The emulated NIC's settings (`MOE_A2A_EMULATED_NIC`, e.g. "12us,25GBps"): a one-way latency per write and
a bandwidth cap per NIC, what `emulated.EmulatedCarrier` adds to a bare copy (docs/transport.md, "The
emulated NIC"). Read by the model process when it builds an AllToAll, handed to its proxies in the
`ProxySpec`; torch-free."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

NIC_ENV = "MOE_A2A_EMULATED_NIC"

_LATENCY_UNITS = {"ns": 1, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9}  # in ns
# Bytes per second; a lower-case b is bits (Gbps = gigabits per second).
_BANDWIDTH_UNITS = {"Bps": 1.0, "B/s": 1.0, "KBps": 1e3, "KB/s": 1e3, "MBps": 1e6, "MB/s": 1e6,
                    "GBps": 1e9, "GB/s": 1e9, "Gbps": 1e9 / 8, "Gbit/s": 1e9 / 8}
_TOKEN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]+)\s*$")


@dataclass(frozen=True)
class NicSettings:
    """What the emulated NIC adds to a bare copy: a one-way latency per write (whole nanoseconds) and a
    bandwidth cap per NIC (whole bytes per second, None: none). `NicSettings()` is full speed."""

    latency_ns: int = 0
    bandwidth_Bps: int | None = None

    @property
    def latency_s(self) -> float:
        return self.latency_ns / 1e9

    @property
    def full_speed(self) -> bool:
        return self.latency_ns == 0 and self.bandwidth_Bps is None

    def __str__(self) -> str:
        """The canonical text (what `parse_nic_settings` reads back exactly): e.g. "12us,25GBps", or "0"."""
        if self.full_speed:
            return "0"
        parts = []
        if self.latency_ns:
            parts.append(_exact(self.latency_ns, (("s", 10**9), ("ms", 10**6), ("us", 10**3), ("ns", 1))))
        if self.bandwidth_Bps is not None:
            parts.append(_exact(self.bandwidth_Bps, (("GBps", 10**9), ("MBps", 10**6), ("KBps", 10**3), ("Bps", 1))))
        return ",".join(parts)

    def describe(self) -> str:
        if self.full_speed:
            return "full speed (no latency or bandwidth cap added)"
        parts = []
        if self.latency_ns:
            parts.append(f"latency {self.latency_ns / 1e3:g} µs per write")
        if self.bandwidth_Bps is not None:
            parts.append(f"bandwidth {self.bandwidth_Bps / 1e9:g} GB/s per NIC")
        return ", ".join(parts)


def _exact(value: int, units) -> str:
    """`value` in the largest unit that divides it (units: (name, size), largest first)."""
    for name, size in units:
        if value % size == 0:
            return f"{value // size}{name}"
    raise AssertionError("the last unit has size 1")


def parse_nic_settings(text: str | None, name: str = NIC_ENV) -> NicSettings:
    """`"12us,25GBps"` (any order, either part optional) -> NicSettings; None, "", "0", "off": full
    speed. ValueError naming `name` for anything else."""
    if text is None or text.strip().lower() in ("", "0", "off", "none"):
        return NicSettings()
    latency, bandwidth = None, None
    for token in text.split(","):
        m = _TOKEN.match(token)
        why = None
        if not m:
            why = f"cannot read {token.strip()!r}"
        else:
            value, unit = float(m.group(1)), m.group(2)
            if unit in _LATENCY_UNITS:
                if latency is not None:
                    why = "two latencies"
                latency = round(value * _LATENCY_UNITS[unit])  # whole ns
            elif unit in _BANDWIDTH_UNITS:
                if bandwidth is not None:
                    why = "two bandwidths"
                bandwidth = round(value * _BANDWIDTH_UNITS[unit])  # whole bytes per second
                if bandwidth <= 0:
                    why = f"bandwidth {token.strip()!r} must be at least 1 B/s"
            else:
                why = f"unknown unit {unit!r} in {token.strip()!r}"
        if why:
            raise ValueError(f"{name}={text!r}: {why}; expected a latency and/or a per-NIC bandwidth such as "
                             f"'12us,25GBps' (latency units {', '.join(_LATENCY_UNITS)}; bandwidth units "
                             f"{', '.join(_BANDWIDTH_UNITS)}), or '0' for full speed")
    return NicSettings(latency or 0, bandwidth)


def nic_settings_from_env(environ=None) -> NicSettings:
    """`MOE_A2A_EMULATED_NIC` of `environ` (default os.environ), parsed. Read by the model process when
    it builds an AllToAll (never at import)."""
    return parse_nic_settings((os.environ if environ is None else environ).get(NIC_ENV))


_logged: set = set()


def log_settings(nic: NicSettings, carrier: str) -> None:
    """Say once per process which carrier and settings the emulated NIC runs with (model process, rank 0)."""
    if (nic, carrier) in _logged:
        return
    _logged.add((nic, carrier))
    import logging

    how = ("CUDA carrier (cuMemcpyAsync between GPU buffers, one stream per proxy)" if carrier == "cuda"
           else "host carrier (memmove between mapped host buffers)")
    logging.getLogger("moe_a2a").warning(
        "moe_a2a: transport 'emulated' is an instrument, not a network: remote traffic between simulated nodes of "
        "this host goes through the proxies and is carried by a %s; NIC %s (%s=%r); its numbers are emulated",
        how, nic.describe(), NIC_ENV, str(nic))
