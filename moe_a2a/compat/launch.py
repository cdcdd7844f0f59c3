"""`python -m moe_a2a.compat.launch [--] COMMAND [ARGS...]`: run COMMAND with `import deep_ep` resolving
to `moe_a2a.compat.deep_ep` in it and in every process it starts.

It sets `MOE_A2A_AS_DEEP_EP=1`, puts `moe_a2a/compat/_alias` (a directory holding only a `deep_ep`
package that aliases the facade) first on `PYTHONPATH`, and replaces itself with COMMAND (`exec`). The
engine then starts as it always does; its workers inherit the environment whatever the start method
(spawn, fork, forkserver, a new interpreter through `subprocess`), so each one finds the alias when it
first imports `deep_ep`. For engines without a plugin hook (SGLang), e.g.:

    python -m moe_a2a.compat.launch python -m sglang.launch_server --model-path ... \\
        --moe-a2a-backend deepep --deepep-mode low_latency

`python -m moe_a2a.compat.launch --print-env` prints the two `export` lines instead, for process
managers that start the workers some other way.
"""
from __future__ import annotations

import os
import shlex
import sys

from .plugin import ENV_VAR

ALIAS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_alias")


def environment(environ=None) -> dict:
    """`environ` (default: this process's) with the switch on and the alias directory first on PYTHONPATH."""
    env = dict(os.environ if environ is None else environ)
    env[ENV_VAR] = "1"
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ALIAS_DIR]
    env["PYTHONPATH"] = os.pathsep.join([ALIAS_DIR, *rest])
    return env


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--print-env"]:
        env = environment()
        print(f"export {ENV_VAR}=1")
        print(f"export PYTHONPATH={shlex.quote(env['PYTHONPATH'])}")
        return 0
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv else 2
    os.execvpe(argv[0], argv, environment())
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
