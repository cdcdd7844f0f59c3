"""`import deep_ep` as `moe_a2a.compat.deep_ep`, for processes started by `python -m moe_a2a.compat.launch`.

This directory's parent is on `PYTHONPATH` only through the launcher, which also sets
`MOE_A2A_AS_DEEP_EP=1`. If the variable is off here anyway (a process that cleared it), this package
steps aside: it loads the next `deep_ep` on `sys.path` (a real DeepEP) in its place, or raises
ImportError as if it were not there.
"""
import importlib.machinery
import importlib.util
import os
import sys

from moe_a2a.compat.plugin import enabled as _enabled

if __name__ == "deep_ep":
    if _enabled():
        from moe_a2a.compat import deep_ep as _facade

        sys.modules[__name__] = _facade
    else:
        _here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        _rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
        _spec = importlib.machinery.PathFinder.find_spec("deep_ep", _rest)
        if _spec is None or _spec.loader is None:
            del sys.modules[__name__]
            raise ModuleNotFoundError("No module named 'deep_ep' (moe_a2a's alias is on sys.path but "
                                      "MOE_A2A_AS_DEEP_EP is not 1)", name="deep_ep")
        _real = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _real
        _spec.loader.exec_module(_real)
