"""Shared pieces of the command lines: argparse `type=` checkers (a bad value is a one-line argparse
error naming the flag), the "needs a CUDA GPU" refusal, and a progress bar that stays out of the way.

Standard library only at import time: the `moe-a2a` parser is built from these without torch.
"""
from __future__ import annotations

import argparse
import sys


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def int_at_least(low: int):
    """`type=` for an integer >= low; argparse reports `argument --x: must be >= low (got v)`."""
    def check(text: str) -> int:
        v = _int(text)
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low} (got {v})")
        return v
    check.__name__ = f"int >= {low}"
    return check


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def positive_float(text: str) -> float:
    v = _float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return v


def nonneg_float(text: str) -> float:
    v = _float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {text})")
    return v


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    v = _float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (got {text})")
    return v


def int_list(low: int = 1, allow_empty: bool = False):
    """`type=` for a comma-separated list of integers >= low ("1,7,63")."""
    one = int_at_least(low)

    def check(text: str) -> list[int]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        if not items and not allow_empty:
            raise argparse.ArgumentTypeError("must be a comma-separated list of integers, got nothing")
        try:
            return [one(s) for s in items]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"every entry {e} in {text!r}") from None
    check.__name__ = "int list"
    return check


def choice_list(choices: tuple[str, ...], allow_empty: bool = False):
    """`type=` for a comma-separated list of names out of `choices` ("shm,tcp")."""
    def check(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        if not items and not allow_empty:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list of {', '.join(choices)}")
        bad = [s for s in items if s not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}: choose from {', '.join(choices)}")
        return items
    check.__name__ = "name list"
    return check


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def refuse_without_cuda(what: str) -> int:
    """0 when a CUDA GPU is present; else print `<what>: needs a CUDA GPU (none found)` and return 2."""
    if has_cuda():
        return 0
    print(f"{what}: needs a CUDA GPU (none found)", file=sys.stderr)
    return 2


def progress(iterable=None, **kwargs):
    """A tqdm bar on stderr that disappears when done (`leave=False`) and is off when stderr is not a
    terminal; the plain iterable when tqdm is not installed. Callers show one bar at a time, from
    one process only."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(iterable)
    kwargs.setdefault("leave", False)
    kwargs.setdefault("file", sys.stderr)
    if kwargs.get("disable") is not True:
        kwargs["disable"] = not sys.stderr.isatty()
    return tqdm(iterable, **kwargs)


class _NoBar:
    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def write_json(path: str | None, result: dict) -> None:
    """Write a benchmark's `result` to `path` (nothing without one), stamped with the date and the command."""
    if path:
        import datetime
        import json
        import os
        import sys

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv), **result}
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
