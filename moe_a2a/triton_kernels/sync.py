"""One-program kernels between the GPU stream and the host: time stamps and a flag store.

- `stamp_time`: when the stream gets there, one program writes `(tag, %globaltimer ns)` into two int64
  words (`AllToAll`'s trace of the model's phases); `gpu_clock_offset_ns` maps that clock onto the
  host's CLOCK_MONOTONIC.
- `signal_flag`: one program stores a value with a system-scope release after everything earlier on
  the stream. `AllToAll` raises its flags in the epilogues of the data kernels instead (`node_sync.py`);
  this stand-alone launch is the one-launch floor `moe-a2a bench kernels` times.

Both take an area of int64 words (int64, or uint8 viewed as int64: e.g. the flags area or the trace
area of a rank's shared segment, registered host memory that a kernel reaches through UVA) and a word
index into it, plus optionally the `device` to run on (default: the tensor's device). On CPU the host
writes the words at once: the interpreter runs kernels synchronously, so that is when the stream
gets there.
"""
from __future__ import annotations

import time

import torch

from . import _checks as check
from ._sync_kernels import _signal_flag_kernel, _stamp_time_kernel


def stamp_time(words: torch.Tensor, index: int, value: int, *, device=None, epoch=None) -> None:
    """Record `(tag, time_ns)` at int64 words `index`, `index + 1` of `words` (e.g. a trace area).

    On a GPU one program runs on the current stream when everything before it has finished and reads
    `%globaltimer` (the GPU's nanosecond clock: `gpu_clock_offset_ns` maps it to CLOCK_MONOTONIC);
    the tag is `value`, plus `epoch[0]` when a `[1]` int64 device tensor is given (read when the kernel
    runs, so a CUDA graph replay stamps the replay's epoch). On CPU the host writes
    `(value, time.monotonic_ns())` at once."""
    words = _int64_words(words, "words")
    index = _word_index(words, index + 1, "index") - 1
    run_on = _cuda_run(words, device, epoch)
    if run_on is not None:
        with torch.cuda.device(run_on):
            _stamp_time_kernel[(1,)](words, index, int(value), epoch if epoch is not None else words,
                                     HAS_EPOCH=epoch is not None, num_warps=1)
    else:
        w = words.numpy()
        w[index + 1] = time.monotonic_ns()
        w[index] = int(value)


def gpu_clock_offset_ns(words: torch.Tensor, host_words, index: int, *, device=None, reps: int = 20,
                        timeout_s: float = 5.0) -> int:
    """CLOCK_MONOTONIC minus %globaltimer, in ns, for the GPU that runs `stamp_time(words, ..., device=)`
    (`words`: pinned host memory, `host_words`: a numpy int64 view of the same memory).

    Each rep stamps `words[index:index+2]` from the GPU while the host polls it: the stamp is read
    within ~1 µs of its write (PCIe), so `monotonic_at_sight - stamp` over-estimates the offset by that
    latency; the smallest of `reps` is kept."""
    best = None
    for _ in range(reps):
        host_words[index + 1] = 0
        stamp_time(words, index, 0, device=device)
        deadline = time.monotonic() + timeout_s
        while host_words[index + 1] == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"gpu_clock_offset_ns: no GPU time stamp within {timeout_s:g}s")
        seen = time.monotonic_ns()
        offset = seen - int(host_words[index + 1])
        best = offset if best is None else min(best, offset)
    return best


def signal_flag(flags: torch.Tensor, slot: int, value: int, *, device=None, epoch=None) -> None:
    """Set `flags[slot] = value` after all earlier work on the current stream of `device`.

    Args:
        flags: the flags area, `[N]` int64 or `[8N]` uint8 (indexed as int64). On a GPU run: registered
            host memory (as a CUDA tensor view, or a CPU tensor plus `device`) or device memory.
        slot: int64 word index into `flags` (`flag_word(Flag.X)` for a Flag).
        value: the epoch to publish (int64).
        device: where to run; None = `flags.device`. A CUDA device launches one program (async, safe in a
            CUDA graph); a CPU device stores from the host immediately.
        epoch: CUDA only: optional `[1]` int64 device tensor; publishes `epoch[0] + value`, read when the
            kernel runs (so a CUDA graph replay publishes the current epoch, not the captured one).
    """
    words = _int64_words(flags, "flags")
    index = _word_index(words, slot, "slot")
    run_on = _cuda_run(words, device, epoch)
    if run_on is not None:
        with torch.cuda.device(run_on):
            _signal_flag_kernel[(1,)](words, index, int(value), epoch if epoch is not None else words,
                                      USE_PTX=True, HAS_EPOCH=epoch is not None, num_warps=1)
    else:
        words.numpy()[index] = int(value)  # an aligned 8-byte store: atomic on x86 and arm64


def _cuda_run(words: torch.Tensor, device, epoch) -> torch.device | None:
    """The CUDA device a one-program launch runs on (`epoch` checked there), or None: the host stores."""
    run_on = _run_device(words, device)
    if run_on.type != "cuda":
        return None
    if epoch is not None:
        check.scalar("epoch", epoch, torch.int64, run_on)
    return run_on


def _int64_words(t: torch.Tensor, name: str) -> torch.Tensor:
    """`t` as a 1-D int64 tensor (a view; the memory is shared)."""
    check.tensor(name, t, dtypes=(torch.int64, torch.uint8), shape=(None,), strides="contiguous")
    if t.dtype == torch.uint8:
        if t.numel() % 8 or t.data_ptr() % 8:
            check.fail(name, "a uint8 view 8-byte aligned and a multiple of 8 bytes",
                       f"{t.numel()} bytes at address % 8 = {t.data_ptr() % 8}")
        t = t.view(torch.int64)
    return t


def _word_index(words: torch.Tensor, index: int, name: str) -> int:
    check.integer(name, index, lo=0)
    if index >= words.numel():
        raise ValueError(f"{name}: word {index} is outside the area of {words.numel()} int64 words")
    return index


def _run_device(words: torch.Tensor, device) -> torch.device:
    return check.canonical_device(device if device is not None else words.device)


__all__ = ["stamp_time", "gpu_clock_offset_ns", "signal_flag"]
