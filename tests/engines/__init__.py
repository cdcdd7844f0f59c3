"""The engines lane: vLLM's and SGLang's own DeepEP backends driving the facade, on the CPU.

Each test starts 2 rank processes (gloo, the facade's kernels in the Triton interpreter) that run an engine's
own code path (`_vllm_rank.py`, `_sglang_rank.py`) with toy SwiGLU experts and check it against a dense
reference (`_toy.py`). Marked `engines` (and `slow`); skipped, saying so, where the engine is not importable,
as in CI. `tests/engines/build_env.sh VENV` builds an environment where it runs (vLLM 0.33.0, SGLang 0.5.23
`--no-deps` over it, a CPU-only host); then `VENV/bin/python -m pytest -m engines tests/engines`.
"""
