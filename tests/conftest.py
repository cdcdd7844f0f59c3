"""Test settings shared by every test.

CI has no GPU: kernels run in the Triton interpreter on CPU tensors. On the GPU machine run the same
property tests with compiled kernels by setting MOE_A2A_TEST_DEVICE=cuda (and not TRITON_INTERPRET),
e.g. `MOE_A2A_TEST_DEVICE=cuda python -m pytest tests/triton_kernels`.
"""
import os

TEST_DEVICE = os.environ.get("MOE_A2A_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def examples(n: int) -> int:
    """Hypothesis examples for a property test: all of them in CI; a quarter with compiled kernels,
    where every new shape costs a compilation (about a second) on the GPU machine."""
    return n if TEST_DEVICE == "cpu" else max(10, n // 4)
