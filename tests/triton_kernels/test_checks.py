"""`_checks`: the one tensor checker of every launcher. Each message names the argument and shows what
was expected and what came (the launchers' own tests check that each argument is refused)."""
from __future__ import annotations

import re

import pytest
import torch

from moe_a2a.triton_kernels import _checks as check


def refused(call, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        call()


def test_each_property_names_the_argument_with_expected_and_actual() -> None:
    t = torch.zeros(4, 3, dtype=torch.int64)
    refused(lambda: check.tensor("a", [1]), "a: expected a torch.Tensor, got list")
    refused(lambda: check.tensor("a", [1], shape=("T", 3)), "a: expected a [T, 3] tensor, got list")
    refused(lambda: check.tensor("a", t, shape=("T", 2)), "a: expected a [T, 2] tensor, got shape [4, 3]")
    refused(lambda: check.tensor("a", t, shape=(None,)), "a: expected a [*] tensor, got shape [4, 3]")
    refused(lambda: check.tensor("a", t, dtypes=(torch.int32, torch.float32)),
            "a: expected dtype int32 or float32, got int64")
    refused(lambda: check.tensor("a", t, device=torch.device("cuda", 0), host_ok=True),
            "a: expected device cuda:0 (or pinned host memory), got cpu")
    refused(lambda: check.tensor("a", t.t()), "a: expected last stride 1, got strides (1, 3)")
    refused(lambda: check.tensor("a", t[:, :2], strides="contiguous"),
            "a: expected a contiguous tensor, got strides (3, 1)")
    check.tensor("a", t.t(), dtypes=(torch.int64,), shape=(3, "T"), device=t.device, strides="any")  # all fine


def test_scalars_and_ints() -> None:
    refused(lambda: check.scalar("epoch", torch.zeros(1, 1, dtype=torch.int64), torch.int64, torch.device("cpu")),
            "epoch: expected a [1] tensor, got shape [1, 1]")
    refused(lambda: check.integer("rank", 4, 0, 4), "rank: expected an int in [0, 4), got 4")
    refused(lambda: check.integer("block", 0, lo=1), "block: expected an int >= 1, got 0")
    refused(lambda: check.integer("rank", True), "rank: expected a Python int, got True")
    assert check.integer("rank", 3, 0, 4) == 3
