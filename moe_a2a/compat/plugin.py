"""Opt-in: `import deep_ep` resolves to `moe_a2a.compat.deep_ep` in every process of an engine.

The switch is one environment variable, `MOE_A2A_AS_DEEP_EP=1`, which the engine's worker processes
inherit. Without it nothing here changes anything: a real DeepEP, if installed, stays what `import
deep_ep` finds.

- vLLM loads the entry points of the group `vllm.general_plugins` in every process it starts (the
  driver, the engine core, each worker) before it builds the model; `install` is registered there
  (pyproject.toml). It must run before vLLM first asks `has_deep_ep()`, because that answer
  (`importlib.util.find_spec("deep_ep")`) is cached for the life of the process: an alias installed
  after it would be too late for the `deepep_low_latency` backend to be chosen.
- With `MOE_A2A_VLLM_PREPARE_FINALIZE=1` as well (it implies the alias), vLLM's `deepep_low_latency`
  selection builds our `moe_a2a.compat.vllm.MoeA2APrepareAndFinalize` instead of vLLM's own
  `DeepEPLLPrepareAndFinalize`: the name is replaced in `all2all_utils`, the module whose
  `maybe_make_prepare_finalize` constructs it, when that module is imported (now, if it already is). Not at
  plugin time otherwise: importing vLLM's fused-MoE modules from a plugin would import half of vLLM early.
- SGLang (0.5.23) calls `install` through its `sglang.srt.plugins` entry points in each process, but after
  its DeepEP dispatcher module (`token_dispatcher/deepep.py`) ran `from deep_ep import Buffer, Config`: that
  module keeps a real `deep_ep`'s classes (SGLang's own dependency sgl-deep-ep installs one) or, without
  one, `use_deepep = False`. So `install` also patches that module when it is already imported: `Buffer`,
  `Config`, `use_deepep` and `_deepep_import_error`. `python -m moe_a2a.compat.launch COMMAND ...`
  (`moe_a2a.compat.launch`) sets the variable and puts a directory holding a `deep_ep` package first on
  `PYTHONPATH`, then runs the command: every process it starts, by any start method, inherits both, and
  `import deep_ep` finds the facade first everywhere (also where SGLang's `deepep_v2` looks for
  `ElasticBuffer`: that backend is then unavailable).
"""
from __future__ import annotations

import importlib.abc
import os
import sys

ENV_VAR = "MOE_A2A_AS_DEEP_EP"
VLLM_PREPARE_FINALIZE_ENV_VAR = "MOE_A2A_VLLM_PREPARE_FINALIZE"
VLLM_ALL2ALL_UTILS = "vllm.model_executor.layers.fused_moe.all2all_utils"
SGLANG_DISPATCHER = "sglang.srt.layers.moe.token_dispatcher.deepep"


def _switch(name: str, environ=None) -> bool:
    value = (os.environ if environ is None else environ).get(name, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def enabled(environ=None) -> bool:
    """Whether the user opted in: `MOE_A2A_AS_DEEP_EP` (or `MOE_A2A_VLLM_PREPARE_FINALIZE`, which implies it)
    is `1` (or `true` / `yes` / `on`)."""
    return _switch(ENV_VAR, environ) or vllm_prepare_finalize_enabled(environ)


def vllm_prepare_finalize_enabled(environ=None) -> bool:
    """Whether vLLM's `deepep_low_latency` backend is to build `MoeA2APrepareAndFinalize`."""
    return _switch(VLLM_PREPARE_FINALIZE_ENV_VAR, environ)


def patch_sglang_dispatcher(module) -> None:
    """Point SGLang's DeepEP dispatcher module (`token_dispatcher/deepep.py`, imported before the plugins
    run) at the facade: the names its `from deep_ep import Buffer, Config` bound, and its flags."""
    from . import deep_ep as facade

    module.Buffer, module.Config = facade.Buffer, facade.Config
    module.use_deepep, module._deepep_import_error = True, None


def install_alias() -> None:
    """Make `deep_ep` (already imported or not) the facade in this process, whatever the variable says, and
    patch SGLang's DeepEP dispatcher module if it is already imported."""
    from . import deep_ep as facade

    sys.modules["deep_ep"] = facade
    dispatcher = sys.modules.get(SGLANG_DISPATCHER)
    if dispatcher is not None:
        patch_sglang_dispatcher(dispatcher)


def _vllm_all2all_utils_imported(module) -> None:
    from .vllm import install_as_deepep_low_latency

    install_as_deepep_low_latency(module)


def install() -> bool:
    """The plugin function: alias `deep_ep` to the facade when `MOE_A2A_AS_DEEP_EP=1`, and with
    `MOE_A2A_VLLM_PREPARE_FINALIZE=1` also route vLLM's `deepep_low_latency` backend to
    `MoeA2APrepareAndFinalize`; else do nothing.

    Returns whether it installed the alias. Idempotent; cheap when off (imports nothing)."""
    if not enabled():
        return False
    install_alias()
    if vllm_prepare_finalize_enabled():
        when_imported(VLLM_ALL2ALL_UTILS, _vllm_all2all_utils_imported)
    return True


# ---- run a function on a module once it is imported (now, if it is already) ------------------------
class _AfterExec(importlib.abc.Loader):
    """Wraps a module's loader: runs the module, then `fn(module)`."""

    def __init__(self, loader, fn) -> None:
        self._loader, self._fn = loader, fn

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._fn(module)

    def __getattr__(self, name):  # get_source, get_filename, ...: the wrapped loader's (tracebacks, inspect)
        return getattr(self._loader, name)


class _WhenImported(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, fn) -> None:
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the finders below must not find this one again
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _AfterExec(spec.loader, self.fn)
                return spec
        return None


def when_imported(name: str, fn) -> None:
    """Call `fn(module)` once module `name` is imported: now if it is, else right after it runs (a finder
    first on `sys.meta_path`, removed at that import). Once per name and function."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
        return
    if not any(isinstance(f, _WhenImported) and f.name == name and f.fn is fn for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported(name, fn))


__all__ = ["ENV_VAR", "VLLM_PREPARE_FINALIZE_ENV_VAR", "enabled", "vllm_prepare_finalize_enabled", "install",
           "install_alias", "patch_sglang_dispatcher", "when_imported"]
