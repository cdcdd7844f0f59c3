"""Flag primitives between the GPU stream and the host: system-scope acquire loads, the GPU clock,
and stand-alone one-program flag kernels.

`AllToAll` no longer launches the stand-alone kernels below (`signal_flag`, `wait_flag`,
`advance_epoch`): its waits and signals are the prologues and epilogues of the data kernels
(`node_sync.py`), which build on `_load_acquire_sys` and `_globaltimer_ns` from here, and its trace
stamps use `stamp_time`. The stand-alone kernels stay as the measured baseline of one flag hand-off
(`moe-a2a bench kernels` times `signal_flag`) and are tested as such.

Flags are int64 epoch values, one per 64-byte line (`config.FLAG_SLOT_BYTES`), at the start of a
rank's shared host segment (`Flag` names the slots). A flag is raised for epoch e when it reads >= e;
flags are never reset, so there is no ABA. On a GPU host the segment is pinned and
`cudaHostRegister`ed, so a kernel reaches it through UVA with the host pointer; the launchers take the
flags area as a tensor (int64, or uint8 viewed as int64) and a word index `slot` into it (Flag f is
word `flag_word(f) = f * FLAG_SLOT_BYTES / 8`), plus optionally the `device` to run on (default: the
tensor's device, so a CUDA tensor view of the registered segment runs the kernels).

- `signal_flag`: one program stores the value with a system-scope release (`st.release.sys`). It is a
  separate launch, so everything earlier on the stream has finished before it runs, and the release
  makes those writes visible to the host no later than the flag.
- `wait_flag`: one program spins with system-scope acquire loads until the flag reaches the target
  or the ERROR flag is nonzero, bounded by `%globaltimer`; it writes a status word (0 ok, 1 timeout,
  2 peer error) that the host reads at its next sync (`check_status`). Measured: a spinning kernel
  answered by another process round-trips in 4.2 µs, where `cuStreamWaitValue32` took >= 46 µs.
  On CPU there is no stream to block and the interpreter cannot read a clock, so the launcher waits on
  the host (spin a few µs, then yield, then short sleeps) and raises `TimeoutError` / `PeerError`.

The kernels also run under `TRITON_INTERPRET=1` (plain loads/atomics instead of PTX, and a spin cap
instead of the clock), which is how the tests exercise them without a GPU.
"""
from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from ..protocol.words import WORDS_PER_FLAG, Flag, flag_word

STATUS_OK = 0
STATUS_TIMEOUT = 1
STATUS_PEER_ERROR = 2


class PeerError(RuntimeError):
    """The proxy (or a peer through it) raised the ERROR flag while we waited."""


@triton.jit
def _globaltimer_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _load_acquire_sys(ptr, USE_PTX: tl.constexpr):
    if USE_PTX:
        # A system-scope acquire: sees the host's (or the NIC's) store, and orders our later reads of
        # the data it guards after it. A plain load could be served from L1 forever.
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr],
                                         dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.load(ptr, volatile=True)


@triton.jit(do_not_specialize=["flag_index", "value"])
def _signal_flag_kernel(
    flags_ptr,        # (N,) int64 flags area (host memory reached through UVA on GPU)
    flag_index,       # int64 element index of the flag: slot * FLAG_SLOT_BYTES / 8
    value,            # int64 epoch to publish (added to *epoch_ptr with HAS_EPOCH)
    epoch_ptr,        # (1,) int64 device epoch counter (CUDA graphs: read at replay, not capture)
    USE_PTX: tl.constexpr,  # GPU: st.release.sys; interpreter: an atomic exchange
    HAS_EPOCH: tl.constexpr,
):
    """Grid: (1,). Publishes `value` after everything earlier on the stream."""
    ptr = flags_ptr + flag_index.to(tl.int64)
    v = value.to(tl.int64)
    if HAS_EPOCH:
        v += tl.load(epoch_ptr)
    if USE_PTX:
        # A store, not an atomic: a posted PCIe write with release semantics at system scope.
        tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l", [ptr, v],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_xchg(ptr, v, sem="release", scope="sys")


@triton.jit(do_not_specialize=["flag_index", "error_index", "target", "timeout_ns", "max_spins"])
def _wait_flag_kernel(
    flags_ptr,        # (N,) int64 flags area
    status_ptr,       # (1,) int64 out: 0 ok, 1 timeout, 2 peer error
    flag_index,       # int64 element index of the awaited flag
    error_index,      # int64 element index of the ERROR flag
    target,           # int64: done when flag >= target (+ *epoch_ptr with HAS_EPOCH)
    timeout_ns,       # int64: give up after this long (%globaltimer; USE_PTX only)
    max_spins,        # int64: give up after this many polls; 0 = no cap (the interpreter needs one)
    epoch_ptr,        # (1,) int64 device epoch counter
    USE_PTX: tl.constexpr,
    HAS_EPOCH: tl.constexpr,
):
    """Grid: (1,). Spins until the flag reaches `target`, the ERROR flag is set, or time runs out;
    a raised flag wins over a set error (the data is complete)."""
    flag_ptr = flags_ptr + flag_index.to(tl.int64)
    error_ptr = flags_ptr + error_index.to(tl.int64)
    target = target.to(tl.int64)
    if HAS_EPOCH:
        target += tl.load(epoch_ptr)
    timeout_ns = timeout_ns.to(tl.int64)
    max_spins = max_spins.to(tl.int64)
    if USE_PTX:
        start = _globaltimer_ns()
    else:
        start = tl.zeros([], dtype=tl.int64)
    spins = tl.zeros([], dtype=tl.int64)
    status = tl.full([], -1, dtype=tl.int32)  # int32: what tl.where of int literals gives
    while status < 0:
        value = _load_acquire_sys(flag_ptr, USE_PTX)
        error = _load_acquire_sys(error_ptr, USE_PTX)
        spins += 1
        if USE_PTX:
            elapsed = _globaltimer_ns() - start
        else:
            elapsed = tl.zeros([], dtype=tl.int64)
        timed_out = (elapsed > timeout_ns) | ((max_spins > 0) & (spins >= max_spins))
        status = tl.where(value >= target, 0, tl.where(error != 0, 2, tl.where(timed_out, 1, -1)))
    tl.store(status_ptr, status)


def _flag_words(flags: torch.Tensor, name: str = "flags") -> torch.Tensor:
    """The flags area as a 1-D int64 tensor (a view; the memory is shared)."""
    if not isinstance(flags, torch.Tensor) or flags.dim() != 1 or flags.dtype not in (torch.int64, torch.uint8):
        raise ValueError(f"{name}: expected a 1-D int64 or uint8 tensor, got "
                         f"{(tuple(flags.shape), flags.dtype) if isinstance(flags, torch.Tensor) else type(flags)}")
    if not flags.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {flags.stride()}")
    if flags.dtype == torch.uint8:
        if flags.numel() % 8 or flags.data_ptr() % 8:
            raise ValueError(f"{name}: a uint8 view must be 8-byte aligned and a multiple of 8 bytes, got "
                             f"{flags.numel()} bytes at address % 8 = {flags.data_ptr() % 8}")
        flags = flags.view(torch.int64)
    return flags


def _flag_index(flags: torch.Tensor, slot: int, name: str) -> int:
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise ValueError(f"{name}: expected an int64 word index >= 0, got {slot!r}")
    if slot >= flags.numel():
        raise ValueError(f"{name}: word {int(slot)} is outside the flags area of {flags.numel()} int64 words")
    return int(slot)


def _run_device(flags: torch.Tensor, device) -> torch.device:
    run_on = torch.device(device) if device is not None else flags.device
    if run_on.type == "cuda" and run_on.index is None:
        run_on = torch.device("cuda", torch.cuda.current_device())
    return run_on


@triton.jit(do_not_specialize=["index", "value"])
def _stamp_time_kernel(words_ptr, index, value, epoch_ptr, HAS_EPOCH: tl.constexpr):
    """Grid: (1,). words[index], words[index + 1] = (tag, %globaltimer ns) when the stream gets here."""
    tag = value
    if HAS_EPOCH:
        tag = tl.load(epoch_ptr) + value
    tl.store(words_ptr + index + 1, _globaltimer_ns())
    tl.store(words_ptr + index, tag)


def stamp_time(words: torch.Tensor, index: int, value: int, *, device=None, epoch=None) -> None:
    """Record `(tag, time_ns)` at int64 words `index`, `index + 1` of `words` (e.g. a trace area).

    On a GPU one program runs on the current stream when everything before it has finished and reads
    `%globaltimer` (the GPU's nanosecond clock: `gpu_clock_offset_ns` maps it to CLOCK_MONOTONIC);
    the tag is `value`, plus `epoch[0]` when a `[1]` int64 device tensor is given (CUDA-graph safe, as
    `signal_flag`). On CPU the host writes `(value, time.monotonic_ns())` at once (the interpreter runs
    kernels synchronously, so that is when the stream gets here)."""
    words = _flag_words(words, "words")
    index = _flag_index(words, index + 1, "index") - 1
    run_on = _run_device(words, device)
    if run_on.type == "cuda":
        _check_epoch(epoch, run_on)
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


@triton.jit
def _advance_epoch_kernel(epoch_ptr):
    """Grid: (1,). epoch += 1, on the stream: a CUDA graph replay advances it too."""
    tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


def advance_epoch(epoch: torch.Tensor) -> None:
    """Increment a `[1]` int64 device epoch counter on the current stream (CUDA-graph safe)."""
    if epoch.numel() != 1 or epoch.dtype != torch.int64 or epoch.device.type != "cuda":
        raise ValueError(f"epoch: expected a [1] int64 CUDA tensor, got {tuple(epoch.shape)} {epoch.dtype} "
                         f"on {epoch.device}")
    with torch.cuda.device(epoch.device):
        _advance_epoch_kernel[(1,)](epoch, num_warps=1)


def _check_epoch(epoch, run_on) -> None:
    if epoch is not None and (epoch.numel() != 1 or epoch.dtype != torch.int64 or epoch.device != run_on):
        raise ValueError(f"epoch: expected a [1] int64 tensor on {run_on}, got {tuple(epoch.shape)} "
                         f"{epoch.dtype} on {epoch.device}")


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
    words = _flag_words(flags)
    index = _flag_index(words, slot, "slot")
    run_on = _run_device(words, device)
    if run_on.type == "cuda":
        _check_epoch(epoch, run_on)
        with torch.cuda.device(run_on):
            _signal_flag_kernel[(1,)](words, index, int(value), epoch if epoch is not None else words,
                                      USE_PTX=True, HAS_EPOCH=epoch is not None, num_warps=1)
    else:
        words.numpy()[index] = int(value)  # an aligned 8-byte store: atomic on x86 and arm64


def check_status(status: torch.Tensor, what: str) -> None:
    """Raise for a status word written by the wait kernel (syncs with the device)."""
    code = int(status.reshape(-1)[0])
    if code == STATUS_TIMEOUT:
        raise TimeoutError(f"timed out on the GPU waiting for {what}")
    if code == STATUS_PEER_ERROR:
        raise PeerError(f"the proxy reported an error while the GPU waited for {what}")
    if code != STATUS_OK:
        raise RuntimeError(f"unexpected wait status {code} for {what}")


def _host_wait(words: torch.Tensor, index: int, error_index: int, target: int, timeout_s: float, what: str) -> None:
    view = words.numpy()  # same memory; numpy indexing re-reads it on every access
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        if int(view[index]) >= target:
            return
        error = int(view[error_index])
        if error != 0:
            raise PeerError(f"the proxy reported error {error} while waiting for {what}")
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.3f} s waiting for {what} "
                               f"(flag {int(view[index])} < {target})")
        waited = now - start
        # Spin for the first 20 µs (a proxy answers in a few µs), then yield the core, then sleep a
        # little so a long wait does not starve the proxy of a core on a 2-core machine.
        if waited > 1e-3:
            time.sleep(min(1e-4, deadline - now))
        elif waited > 2e-5:
            time.sleep(0)


def _launch_wait_kernel(words, status, index, error_index, target, timeout_ns, max_spins, use_ptx,
                        epoch=None) -> None:
    _wait_flag_kernel[(1,)](words, status, index, error_index, int(target), int(timeout_ns), int(max_spins),
                            epoch if epoch is not None else words, USE_PTX=use_ptx, HAS_EPOCH=epoch is not None,
                            num_warps=1)


def wait_flag(
    flags: torch.Tensor,
    slot: int,
    target: int,
    error_slot: int = flag_word(Flag.ERROR),
    timeout_s: float = 30.0,
    *,
    status: torch.Tensor | None = None,
    device=None,
    what: str | None = None,
    epoch: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Wait until `flags[slot] >= target` or `flags[error_slot] != 0`, at most `timeout_s`.

    Args:
        flags: the flags area, as for `signal_flag`.
        slot, error_slot: int64 word indices into `flags` of the awaited flag and of the proxy's error
            flag (`flag_word(Flag.X)`).
        target: the epoch awaited.
        timeout_s: > 0.
        status: CUDA runs only: optional `[1]` int64 device tensor for the result (0 ok, 1 timeout,
            2 peer error); pass it to make the call CUDA-graph safe (allocated otherwise).
        device: where to wait; None = `flags.device`.
        what: names the awaited event in error messages (default: the Flag's name).
        epoch: CUDA only: optional `[1]` int64 device tensor; the target becomes `epoch[0] + target`.

    Returns:
        On CUDA: the status tensor, valid once the stream reaches this point (stream-ordered, no CPU
        sync; read it with `check_status`). On CPU: None, after the flag is raised; raises
        `TimeoutError` after `timeout_s`, and `PeerError` when the error flag is set while the awaited
        flag is not raised (a raised flag wins: its data is complete).
    """
    words = _flag_words(flags)
    index = _flag_index(words, slot, "slot")
    error_index = _flag_index(words, error_slot, "error_slot")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected > 0, got {timeout_s!r}")
    if what is None:
        is_flag = slot % WORDS_PER_FLAG == 0 and slot // WORDS_PER_FLAG in Flag._value2member_map_
        what = Flag(slot // WORDS_PER_FLAG).name if is_flag else f"flags[{slot}]"
    run_on = _run_device(words, device)
    if run_on.type != "cuda":
        _host_wait(words, index, error_index, int(target), float(timeout_s), what)
        return None
    if status is None:
        status = torch.empty(1, dtype=torch.int64, device=run_on)
    elif status.numel() != 1 or status.dtype != torch.int64 or status.device != run_on:
        raise ValueError(f"status: expected a 1-element int64 tensor on {run_on}, got "
                         f"{tuple(status.shape)} {status.dtype} on {status.device}")
    _check_epoch(epoch, run_on)
    with torch.cuda.device(run_on):
        _launch_wait_kernel(words, status, index, error_index, target, int(timeout_s * 1e9), 0, True, epoch)
    return status


__all__ = ["signal_flag", "wait_flag", "advance_epoch", "check_status", "flag_word", "PeerError",
           "STATUS_OK", "STATUS_TIMEOUT", "STATUS_PEER_ERROR"]
