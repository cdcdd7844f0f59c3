"""One-program kernels of `sync.py`: time stamps (host clock on CPU, %globaltimer mapped onto it on a
GPU) and the stand-alone flag store (the host store on CPU, the kernel under the interpreter, the PTX
path on pinned host memory on a GPU)."""
from __future__ import annotations

import time

import pytest
import torch

from moe_a2a.protocol.words import FLAG_SLOT_BYTES, Flag, flag_word
from moe_a2a.triton_kernels import sync
from moe_a2a.triton_kernels.sync import signal_flag

from ..conftest import TEST_DEVICE
from ..conftest import interpreter_only as _interpreter_only

WORDS = FLAG_SLOT_BYTES // 8

# The tests that launch the USE_PTX=False kernel directly are about the interpreter's path: compiled
# (MOE_A2A_TEST_DEVICE=cuda, no TRITON_INTERPRET) it would get CPU pointers and is not the code a GPU
# runs; the GPU's PTX path is tested below (test_gpu_*, test_device_epoch_offsets_the_signalled_value).
interpreter_only = _interpreter_only("tests the USE_PTX=False kernels on CPU tensors; with compiled kernels "
                                     "the PTX path is covered by the test_gpu_* tests")


def new_flags() -> torch.Tensor:
    return torch.zeros(int(Flag.NUM_FLAGS) * WORDS, dtype=torch.int64)


def word(slot: Flag) -> int:
    return flag_word(slot)


@pytest.mark.timeout(30)
def test_signal_sets_value_and_uint8_view():
    flags = new_flags()
    signal_flag(flags, word(Flag.SEND_READY), 5)
    signal_flag(flags.view(torch.uint8), word(Flag.COMBINE_SEND_READY), 2**40 + 3)  # int64 epochs
    assert int(flags[word(Flag.SEND_READY)]) == 5
    assert int(flags[word(Flag.COMBINE_SEND_READY)]) == 2**40 + 3
    assert int(flags.count_nonzero()) == 2                       # nothing else touched


@pytest.mark.timeout(30)
def test_bad_arguments():
    flags = new_flags()
    with pytest.raises(ValueError, match="flags"):
        signal_flag(flags.to(torch.int32), word(Flag.SEND_READY), 1)
    with pytest.raises(ValueError, match=f"word {flags.numel()} is outside"):
        signal_flag(flags, flags.numel(), 1)
    with pytest.raises(ValueError, match="slot"):
        signal_flag(flags, -1, 1)
    with pytest.raises(ValueError, match="uint8 view"):
        signal_flag(torch.zeros(12, dtype=torch.uint8), 0, 1)


@interpreter_only
@pytest.mark.timeout(60)
def test_signal_kernel_interpreted():
    flags = new_flags()
    sync._signal_flag_kernel[(1,)](flags, word(Flag.SEND_READY), 1, flags, USE_PTX=False,   # 1: a value Triton
                                   HAS_EPOCH=False)                                        # would specialise
    sync._signal_flag_kernel[(1,)](flags, word(Flag.ROUTE_READY), 2**35, flags, USE_PTX=False, HAS_EPOCH=False)
    assert int(flags[word(Flag.SEND_READY)]) == 1 and int(flags[word(Flag.ROUTE_READY)]) == 2**35
    assert int(flags.count_nonzero()) == 2


@pytest.mark.timeout(60)
def test_device_epoch_offsets_the_signalled_value():
    """CUDA-graph mode: the value is relative to an epoch counter read when the kernel runs.

    On CPU: the USE_PTX=False kernel under the interpreter (the CPU launcher stores on the host and
    takes no epoch). On cuda: the launcher (PTX kernel) on pinned host flags with a device epoch tensor."""
    if TEST_DEVICE == "cuda":
        flags = new_flags().pin_memory()   # registered host memory, as in production (reached via UVA)
        epoch = torch.tensor([41], dtype=torch.int64, device=TEST_DEVICE)
        signal_flag(flags, word(Flag.SEND_READY), 1, device=TEST_DEVICE, epoch=epoch)
        torch.cuda.synchronize()
        assert int(flags[word(Flag.SEND_READY)]) == 42
        return
    flags = new_flags()
    epoch = torch.tensor([41], dtype=torch.int64)
    sync._signal_flag_kernel[(1,)](flags, word(Flag.SEND_READY), 1, epoch, USE_PTX=False, HAS_EPOCH=True)
    assert int(flags[word(Flag.SEND_READY)]) == 42


@pytest.mark.timeout(30)
def test_stamp_time_on_cpu_uses_the_host_clock():
    words = torch.zeros(8, dtype=torch.int64)
    t0 = time.monotonic_ns()
    sync.stamp_time(words, 2, 7)
    t1 = time.monotonic_ns()
    assert int(words[2]) == 7 and t0 <= int(words[3]) <= t1
    assert int(words.count_nonzero()) == 2
    with pytest.raises(ValueError, match="outside"):
        sync.stamp_time(words, 7, 1)  # the pair would end past the area


# ---- GPU: the PTX path on pinned host memory reached through UVA ----
needs_gpu = pytest.mark.gpu(reason="tests st.release.sys / %globaltimer")


@needs_gpu
@pytest.mark.timeout(60)
def test_gpu_signal_on_pinned_host_flags():
    flags = new_flags().pin_memory()
    signal_flag(flags, word(Flag.SEND_READY), 3, device="cuda")
    torch.cuda.synchronize()
    assert int(flags[word(Flag.SEND_READY)]) == 3


@needs_gpu
@pytest.mark.timeout(60)
def test_gpu_stamps_map_onto_the_host_clock():
    words = torch.zeros(8, dtype=torch.int64).pin_memory()
    offset = sync.gpu_clock_offset_ns(words, words.numpy(), 6, device="cuda")
    t0 = time.monotonic_ns()
    sync.stamp_time(words, 0, 5, device="cuda")
    torch.cuda.synchronize()
    t1 = time.monotonic_ns()
    assert int(words[0]) == 5
    assert t0 - 20_000 <= int(words[1]) + offset <= t1 + 20_000  # within the calibration's error
