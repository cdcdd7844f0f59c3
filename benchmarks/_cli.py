"""The entry point the instruments share: `python -m benchmarks.<name> ...` parses, runs, and reports a
configuration the library refuses (a ValueError) as one error line with exit status 2, as `moe-a2a` does."""
from __future__ import annotations

import argparse
import sys


def main(name: str, doc: str, add_arguments, run_args, argv: list[str] | None = None) -> int:
    """Parse `argv` with the instrument's `add_arguments`, then `run_args(args)` (`args.error` is the
    parser's, for cross-flag problems: a one-line argparse error, exit 2)."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_arguments(parser).parse_args(argv)
    args.error = parser.error
    try:
        return run_args(args) or 0
    except ValueError as e:  # a configuration the library refuses (e.g. a missing provider)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
