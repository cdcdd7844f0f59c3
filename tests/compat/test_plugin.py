"""The opt-in that makes `import deep_ep` resolve to our facade in an engine's processes
(`moe_a2a.compat.plugin`, `moe_a2a.compat.launch`), each case in fresh interpreters.

- vLLM: `vllm.plugins.load_general_plugins()` loads every entry point of the group
  `vllm.general_plugins` and calls it, in each process it starts; the child here does the same through
  `importlib.metadata` (vLLM is not installed here), then asks `importlib.util.find_spec("deep_ep")` as
  vLLM's `has_deep_ep()` does, then imports it as `deepep_ll.py` does.
- SGLang: its schedulers are `multiprocessing` processes started with the spawn method, which import
  `deep_ep` themselves (the parent never does); the launcher's child starts one such process.

The children run from a temporary directory, so that the installed distribution's metadata is what
`entry_points` reads (as in an engine), not a build's `moe_a2a.egg-info` left in the checkout.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow]

ENTRY = "moe_a2a.compat.plugin:install"


def _run(code: str, tmp_path, env_on: bool):
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_A2A_AS_DEEP_EP", "PYTHONPATH")}
    if env_on:
        env["MOE_A2A_AS_DEEP_EP"] = "1"
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# What vLLM does in each process (load_general_plugins), then has_deep_ep() and the import; SGLang's
# `sglang.srt.plugins` group likewise, in the same interpreter (loading both is harmless: idempotent).
_VLLM_CHILD = """
    import importlib.metadata, importlib.util, sys
    installed = []
    for group in ("vllm.general_plugins", "sglang.srt.plugins"):
        eps = [ep for ep in importlib.metadata.entry_points(group=group) if ep.value == "%s"]
        assert len(eps) == 1, ("the entry point is not installed: run .ci/setup.sh (pip install -e .)",
                               group, list(importlib.metadata.entry_points(group=group)))
        installed.append(eps[0].load()())
    found = importlib.util.find_spec("deep_ep") is not None
    try:
        import deep_ep
        kind = "facade" if deep_ep.Buffer.__module__ == "moe_a2a.compat.deep_ep" else "other"
    except ImportError:
        kind = "none"
    print(*installed, found, kind, "torch" in sys.modules)
""" % ENTRY


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="a real deep_ep is installed here")
def test_entry_points_alias_deep_ep_only_when_opted_in(tmp_path):
    assert _run(_VLLM_CHILD, tmp_path, env_on=True).split() == ["True", "True", "True", "facade", "True"]
    # Off: the plugin imports nothing heavy (no torch) and `import deep_ep` fails as before.
    assert _run(_VLLM_CHILD, tmp_path, env_on=False).split() == ["False", "False", "False", "none", "False"]


_SPAWN_CHILD = """
    import multiprocessing as mp, sys

    def child(q):
        import deep_ep
        q.put(deep_ep.Buffer.__module__)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        print(q.get(timeout=60), "deep_ep" in sys.modules)
        p.join()
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="a real deep_ep is installed here")
def test_launcher_reaches_spawned_workers(tmp_path):
    (tmp_path / "engine.py").write_text(textwrap.dedent(_SPAWN_CHILD))
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_A2A_AS_DEEP_EP", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-m", "moe_a2a.compat.launch", sys.executable, "engine.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["moe_a2a.compat.deep_ep", "False"]
    # A process that clears the variable gets no alias: the alias package steps aside.
    proc = subprocess.run([sys.executable, "-m", "moe_a2a.compat.launch", "env", "-u", "MOE_A2A_AS_DEEP_EP",
                           sys.executable, "-c", "import deep_ep"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "No module named 'deep_ep'" in proc.stderr, proc.stderr


def test_launcher_environment_and_switch():
    from moe_a2a.compat import launch, plugin

    env = launch.environment({"PYTHONPATH": f"/a{os.pathsep}{launch.ALIAS_DIR}"})
    assert env["MOE_A2A_AS_DEEP_EP"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [launch.ALIAS_DIR, "/a"]
    assert os.path.isfile(os.path.join(launch.ALIAS_DIR, "deep_ep", "__init__.py"))
    assert plugin.enabled({"MOE_A2A_AS_DEEP_EP": "1"}) and not plugin.enabled({})
    assert not plugin.enabled({"MOE_A2A_AS_DEEP_EP": "0"})


# Stand-ins (not the engines: tests/engines/ runs those) for the two modules the plugin patches, with the
# engines' module paths and the lines that matter: SGLang 0.5.23's dispatcher binds `Buffer, Config` from
# `deep_ep` at its import, before SGLang loads its plugins; vLLM's all2all_utils defines the DeepEP
# low-latency class only on CUDA-like platforms and reads it from its globals.
_STAND_INS = {
    "sglang/srt/layers/moe/token_dispatcher/deepep.py": """
        _deepep_import_error = None
        try:
            from deep_ep import Buffer, Config
            use_deepep = True
        except Exception as exc:
            use_deepep = False
            _deepep_import_error = exc
    """,
    "vllm/model_executor/layers/fused_moe/all2all_utils.py": """
        def maybe_make_prepare_finalize(handle, max_num_tokens, world_size):
            return DeepEPLLPrepareAndFinalize(handle, max_tokens_per_rank=max_num_tokens, num_dispatchers=world_size,
                                              use_fp8_dispatch=[128, 128] == DEEPEP_QUANT_BLOCK_SHAPE)

        def maybe_roundup_layer_hidden_size(hidden_size):
            return DeepEPLLPrepareAndFinalize.maybe_roundup_layer_hidden_size(hidden_size)
    """,
}

_PATCH_CHILD = """
    import importlib, sys
    from moe_a2a.compat import plugin
    import sglang.srt.layers.moe.token_dispatcher.deepep as dispatcher  # before the plugin, as in SGLang
    assert dispatcher.use_deepep is False and dispatcher._deepep_import_error is not None
    print(plugin.install(), "vllm.model_executor.layers.fused_moe.all2all_utils" in sys.modules)
    from moe_a2a.compat import deep_ep as facade
    print(dispatcher.use_deepep, dispatcher._deepep_import_error, dispatcher.Buffer is facade.Buffer,
          dispatcher.Config is facade.Config)
    a2a = importlib.import_module("vllm.model_executor.layers.fused_moe.all2all_utils")  # after: patched at import
    print(a2a.DeepEPLLPrepareAndFinalize.__module__, a2a.DEEPEP_QUANT_BLOCK_SHAPE,
          a2a.maybe_roundup_layer_hidden_size(1000), a2a.__loader__.get_filename().endswith("all2all_utils.py"))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="a real deep_ep is installed here")
def test_plugin_patches_engine_modules_stand_ins(tmp_path):
    for rel, code in _STAND_INS.items():
        path = tmp_path / rel
        for parent in reversed(path.relative_to(tmp_path).parents[:-1]):
            (tmp_path / parent).mkdir(exist_ok=True)
            (tmp_path / parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_A2A_AS_DEEP_EP", "PYTHONPATH")}
    env["PYTHONPATH"] = str(tmp_path)
    child = [sys.executable, "-c", textwrap.dedent(_PATCH_CHILD)]
    env["MOE_A2A_VLLM_PREPARE_FINALIZE"] = "1"  # implies the alias
    proc = subprocess.run(child, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split() for line in proc.stdout.splitlines()] == [
        ["True", "False"],
        ["True", "None", "True", "True"],
        ["moe_a2a.compat.vllm", "[128,", "128]", "1000", "True"]]
    # Alias only: vLLM's own class name stays as vLLM defines it (here: not at all).
    env.pop("MOE_A2A_VLLM_PREPARE_FINALIZE")
    env["MOE_A2A_AS_DEEP_EP"] = "1"
    proc = subprocess.run(child, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "has no attribute 'DeepEPLLPrepareAndFinalize'" in proc.stderr, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[1].split()[0] == "True"
