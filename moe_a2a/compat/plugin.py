"""Opt-in: `import deep_ep` resolves to `moe_a2a.compat.deep_ep` in every process of an engine.

The switch is one environment variable, `MOE_A2A_AS_DEEP_EP=1`, which the engine's worker processes
inherit. Without it nothing here changes anything: a real DeepEP, if installed, stays what `import
deep_ep` finds.

- vLLM loads the entry points of the group `vllm.general_plugins` in every process it starts (the
  driver, the engine core, each worker) before it builds the model; `install` is registered there
  (pyproject.toml). It must run before vLLM first asks `has_deep_ep()`, because that answer
  (`importlib.util.find_spec("deep_ep")`) is cached for the life of the process: an alias installed
  after it would be too late for the `deepep_low_latency` backend to be chosen.
- SGLang versions that have `sglang.srt.plugins` entry points call `install` the same way. For those
  that have none, `python -m moe_a2a.compat.launch COMMAND ...` (`moe_a2a.compat.launch`) sets the
  variable and puts a directory holding a `deep_ep` package on `PYTHONPATH`, then runs the command:
  every process it starts, by any start method, inherits both.
"""
from __future__ import annotations

import os
import sys

ENV_VAR = "MOE_A2A_AS_DEEP_EP"


def enabled(environ=None) -> bool:
    """Whether the user opted in: `MOE_A2A_AS_DEEP_EP` is `1` (or `true` / `yes` / `on`)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def install_alias() -> None:
    """Make `deep_ep` (already imported or not) the facade in this process, whatever the variable says."""
    from . import deep_ep as facade

    sys.modules["deep_ep"] = facade


def install() -> bool:
    """The plugin function: alias `deep_ep` to the facade when `MOE_A2A_AS_DEEP_EP=1`; else do nothing.

    Returns whether it installed the alias. Idempotent; cheap when off (imports nothing)."""
    if not enabled():
        return False
    install_alias()
    return True


__all__ = ["ENV_VAR", "enabled", "install", "install_alias"]
