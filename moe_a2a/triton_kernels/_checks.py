"""Argument checks of every launcher (private: `from . import _checks as check`, then `check.tensor(...)`).

A kernel given a wrong pointer, dtype or stride crashes or silently corrupts memory, so each launcher
checks its tensors before any pointer leaves Python. Every failure is one ValueError shape:
`"<argument>: expected <what>, got <actual>"` (names the argument, shows expected and actual).
"""
from __future__ import annotations

from typing import NoReturn

import torch

from ..config import A2AConfig, Layout


def fail(name: str, expected: str, got: str) -> NoReturn:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def tensor(name: str, t, *, dtypes=None, shape=None, device=None, host_ok: bool = False,
           strides: str = "last") -> None:
    """The one tensor checker.

    dtypes: allowed dtypes (None: any). shape: one entry per dimension: an int (that size), a str (any
    size; it names the dimension in the message, e.g. "T") or None (any size). device: required device
    (None: any); with `host_ok`, a pinned host tensor is accepted for a CUDA device. strides: "last"
    (stride 1 in the last dimension), "contiguous" or "any".
    """
    if shape is not None:
        want_shape = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
    if not isinstance(t, torch.Tensor):
        fail(name, f"a {want_shape} tensor" if shape is not None else "a torch.Tensor", type(t).__name__)
    if shape is not None and (t.dim() != len(shape) or any(
            isinstance(want, int) and want != got for want, got in zip(shape, t.shape))):
        fail(name, f"a {want_shape} tensor", f"shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(name, "dtype " + _one_of([str(d).removeprefix("torch.") for d in dtypes]),
             str(t.dtype).removeprefix("torch."))
    if device is not None and not same_device(t.device, device) and not (
            host_ok and device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()):
        fail(name, f"device {device}" + (" (or pinned host memory)" if host_ok else ""), str(t.device))
    if strides == "last" and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(name, "last stride 1", f"strides {t.stride()}")
    if strides == "contiguous" and not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}")


def canonical_device(device=None) -> torch.device:
    """The device an instance works on, as its tensors report theirs (`t.device`), or ValueError: None ->
    the current CUDA device if there is one, else the CPU; "cuda" / `torch.device("cuda")` -> `cuda:<current
    device>`; "cuda:N" -> itself (N must be a device of this process); "cpu", "cpu:N" -> `cpu` (CPU tensors
    report no index). Anything else (another device type, a string torch does not parse) is refused, so
    a device no tensor can match is refused at construction rather than at every call."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ValueError(f"device: expected a str, int or torch.device, got {type(device).__name__} {device!r}")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)  # int: torch's rule
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device: {device!r} is not a device ({exc})") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device: expected a CPU or CUDA device, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} needs CUDA, which is not available here")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device: {device!r}: this process sees {count} CUDA device(s)")
    return torch.device("cuda", index)


def same_device(have: torch.device, want) -> bool:
    """`have` (a tensor's device) is `want` as `canonical_device` reads it ("cuda" is the current CUDA device,
    "cpu:0" the CPU); never raises: a device no tensor can be on is simply not matched."""
    if have == want:
        return True
    try:
        want = torch.device(want)
    except (RuntimeError, TypeError, ValueError):
        return False
    if want.type != have.type:
        return False
    return want.type == "cpu" or (want.type == "cuda" and want.index is None
                                  and have.index == torch.cuda.current_device())


def integer(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """A Python int (not a bool) in [lo, hi) (either bound may be None)."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, "a Python int", repr(value))
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        fail(name, f"an int in [{lo}, {hi})" if hi is not None else f"an int >= {lo}", repr(value))
    return value


def scalar(name: str, t, dtype: torch.dtype, device, host_ok: bool = False) -> None:
    """A `[1]` tensor of `dtype` on `device`: a word the kernels read or write (bound_m, epoch, ...)."""
    tensor(name, t, dtypes=(dtype,), shape=(1,), device=device, host_ok=host_ok)


def bound_m(t, device) -> None:
    if t is not None:
        scalar("bound_m", t, torch.int32, device)


def config(cfg) -> None:
    if not isinstance(cfg, A2AConfig):
        fail("cfg", "an A2AConfig", type(cfg).__name__)


def layout(lay, cfg: A2AConfig) -> None:
    """`lay` must be `cfg.layout(W, node_size)` for some W: same sizes and strides."""
    fields = ("num_experts", "max_num_tokens", "experts_per_token", "expert_padding",
              "dispatch_stride_bytes", "combine_stride_bytes")
    if not isinstance(lay, Layout):
        fail("layout", "a Layout (cfg.layout(world_size))", type(lay).__name__)
    bad = [f for f in fields if getattr(lay, f) != getattr(cfg, f)]
    if bad:
        fail("layout", "cfg.layout(world_size) of this cfg", ", ".join(f"{f}={getattr(lay, f)}" for f in bad))


def counts(t, W: int, E: int, device) -> None:
    """The `[W, E]` int32 routing matrix (device or pinned host memory)."""
    tensor("counts", t, dtypes=(torch.int32,), shape=(W, E), device=device, host_ok=True)


def peer_table(name: str, t, W: int, device) -> None:
    """A `[W]` int64 table of same-node peers' buffer offsets (-1: remote)."""
    tensor(name, t, dtypes=(torch.int64,), shape=(W,), device=device, host_ok=True, strides="contiguous")


def split(name: str, remote_offset_bytes, node_slots, device) -> bool:
    """Only remote rows staged: `remote_offset_bytes` and `node_slots` come together. True when given."""
    if (remote_offset_bytes is None) != (node_slots is None):
        fail(name, "given together with node_slots (both or neither)",
             f"{name}={remote_offset_bytes!r}, node_slots={'a tensor' if node_slots is not None else None}")
    if node_slots is None:
        return False
    integer(name, remote_offset_bytes)
    tensor("node_slots", node_slots, dtypes=(torch.int32,), shape=(2,), device=device)
    return True


def _one_of(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def expert_rows(name: str, rows, dtype, cfg: A2AConfig, lay) -> tuple:
    """A launcher's common checks of its config, its layout and its `[R, hidden_dim]` expert-row tensor `name`
    of `dtype`; returns `(W, L, E, device, R)`."""
    config(cfg)
    layout(lay, cfg)
    tensor(name, rows, dtypes=(dtype,), shape=(None, cfg.hidden_dim))
    return lay.world_size, lay.num_local_experts, cfg.num_experts, rows.device, rows.shape[0]
