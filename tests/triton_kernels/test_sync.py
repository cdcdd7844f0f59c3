"""Flag signal/wait: the host wait on CPU, the kernels under the interpreter, and (GPU only) the
PTX path on pinned host memory."""
from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from moe_a2a.protocol.words import FLAG_SLOT_BYTES, Flag
from moe_a2a.triton_kernels import sync
from moe_a2a.triton_kernels.sync import PeerError, signal_flag, wait_flag

from ..conftest import TEST_DEVICE

WORDS = FLAG_SLOT_BYTES // 8

# The tests that launch the USE_PTX=False kernels directly are about the interpreter's path: compiled
# (MOE_A2A_TEST_DEVICE=cuda, no TRITON_INTERPRET) they would get CPU pointers and are not the code a GPU
# runs; the GPU's PTX path is tested below (test_gpu_*, test_device_epoch_offsets_signal_and_wait_targets).
interpreter_only = pytest.mark.skipif(
    TEST_DEVICE == "cuda",
    reason="tests the interpreter path (USE_PTX=False kernels on CPU tensors under TRITON_INTERPRET=1); "
           "with compiled kernels the PTX path is covered by the test_gpu_* tests")


def new_flags() -> torch.Tensor:
    return torch.zeros(int(Flag.NUM_FLAGS) * WORDS, dtype=torch.int64)


def word(slot: Flag) -> int:
    return sync.flag_word(slot)


@pytest.mark.timeout(30)
def test_signal_sets_value_and_uint8_view():
    flags = new_flags()
    signal_flag(flags, word(Flag.SEND_READY), 5)
    signal_flag(flags.view(torch.uint8), word(Flag.COMBINE_SEND_READY), 2**40 + 3)  # int64 epochs
    assert int(flags[word(Flag.SEND_READY)]) == 5
    assert int(flags[word(Flag.COMBINE_SEND_READY)]) == 2**40 + 3
    assert int(flags.count_nonzero()) == 2                       # nothing else touched


@pytest.mark.timeout(30)
def test_host_wait_already_raised():
    flags = new_flags()
    flags[word(Flag.DISPATCH_RECV_READY)] = 7
    start = time.monotonic()
    assert wait_flag(flags, word(Flag.DISPATCH_RECV_READY), 7, timeout_s=5.0) is None
    assert wait_flag(flags, word(Flag.DISPATCH_RECV_READY), 3, timeout_s=5.0) is None  # older epoch: >= holds
    assert time.monotonic() - start < 1.0


@pytest.mark.timeout(30)
def test_host_wait_raised_by_thread():
    flags = new_flags()
    timer = threading.Timer(0.05, lambda: signal_flag(flags, word(Flag.COMBINE_RECV_READY), 1))
    start = time.monotonic()
    timer.start()
    try:
        wait_flag(flags, word(Flag.COMBINE_RECV_READY), 1, timeout_s=10.0)
    finally:
        timer.join()
    assert 0.04 < time.monotonic() - start < 5.0


def _raise_later(flags: torch.Tensor, index: int, value: int, delay_s: float) -> None:
    time.sleep(delay_s)
    flags.numpy()[index] = value


@pytest.mark.timeout(60)
def test_host_wait_raised_by_process():
    """The proxy is a separate process: the flag memory is shared, not copied."""
    flags = new_flags().share_memory_()
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_raise_later, args=(flags, word(Flag.DISPATCH_WRITES_DONE), 3, 0.1))
    child.start()
    try:
        wait_flag(flags, word(Flag.DISPATCH_WRITES_DONE), 3, timeout_s=20.0)
    finally:
        child.join(10)
    assert child.exitcode == 0


@pytest.mark.timeout(30)
def test_host_wait_timeout_within_deadline():
    flags = new_flags()
    flags[word(Flag.SEND_READY)] = 1                             # previous epoch only
    timeout_s, slack_s = 0.2, 1.0  # slack for a loaded 2-core CI machine; a hang would take 30 s
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="waiting for SEND_READY"):
        wait_flag(flags, word(Flag.SEND_READY), 2, timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert timeout_s <= elapsed < timeout_s + slack_s


@pytest.mark.timeout(30)
def test_host_wait_peer_error_and_flag_wins():
    flags = new_flags()
    flags[word(Flag.ERROR)] = 9
    with pytest.raises(PeerError, match="error 9 while waiting for the combine barrier"):
        wait_flag(flags, word(Flag.COMBINE_WRITES_DONE), 1, timeout_s=5.0, what="the combine barrier")
    flags[word(Flag.COMBINE_WRITES_DONE)] = 1                        # data complete: success despite error
    wait_flag(flags, word(Flag.COMBINE_WRITES_DONE), 1, timeout_s=5.0)


@pytest.mark.timeout(30)
def test_bad_arguments():
    flags = new_flags()
    with pytest.raises(ValueError, match="flags"):
        wait_flag(flags.to(torch.int32), word(Flag.SEND_READY), 1)
    with pytest.raises(ValueError, match=f"word {flags.numel()} is outside"):
        signal_flag(flags, flags.numel(), 1)
    with pytest.raises(ValueError, match="error_slot"):
        wait_flag(flags, word(Flag.SEND_READY), 1, -1)
    with pytest.raises(ValueError, match="timeout_s"):
        wait_flag(flags, word(Flag.SEND_READY), 1, timeout_s=0)
    with pytest.raises(ValueError, match="uint8 view"):
        signal_flag(torch.zeros(12, dtype=torch.uint8), 0, 1)


# ---- the kernels themselves, under TRITON_INTERPRET=1 (plain loads, spin cap instead of a clock) ----
def run_wait_kernel(flags, slot, target, max_spins=50):
    status = torch.full((1,), -7, dtype=torch.int64)
    sync._launch_wait_kernel(flags, status, word(slot), word(Flag.ERROR), target, 10**9, max_spins, False)
    return int(status[0])


@interpreter_only
@pytest.mark.timeout(60)
def test_wait_kernel_interpreted():
    flags = new_flags()
    flags[word(Flag.ROUTE_READY)] = 4
    assert run_wait_kernel(flags, Flag.ROUTE_READY, 4) == sync.STATUS_OK       # already raised
    assert run_wait_kernel(flags, Flag.ROUTE_READY, 2**33) == sync.STATUS_TIMEOUT  # spin cap hit
    flags[word(Flag.ERROR)] = 1
    assert run_wait_kernel(flags, Flag.ROUTE_READY, 5) == sync.STATUS_PEER_ERROR
    assert run_wait_kernel(flags, Flag.ROUTE_READY, 4) == sync.STATUS_OK       # raised flag wins


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
def test_device_epoch_offsets_signal_and_wait_targets():
    """CUDA-graph mode: value and target are relative to an epoch counter read when the kernel runs.

    On CPU: the USE_PTX=False kernels under the interpreter (the CPU launchers wait on the host and take
    no epoch). On cuda: the launchers (PTX kernels) on pinned host flags with a device epoch tensor."""
    if TEST_DEVICE == "cuda":
        flags = new_flags().pin_memory()   # registered host memory, as in production (reached via UVA)
        epoch = torch.tensor([41], dtype=torch.int64, device=TEST_DEVICE)
        signal_flag(flags, word(Flag.SEND_READY), 1, device=TEST_DEVICE, epoch=epoch)
        torch.cuda.synchronize()
        assert int(flags[word(Flag.SEND_READY)]) == 42
        status = wait_flag(flags, word(Flag.SEND_READY), 1, timeout_s=10.0, device=TEST_DEVICE, epoch=epoch)
        assert int(status.cpu()[0]) == sync.STATUS_OK
        status = wait_flag(flags, word(Flag.SEND_READY), 2, timeout_s=0.05, device=TEST_DEVICE, epoch=epoch)
        assert int(status.cpu()[0]) == sync.STATUS_TIMEOUT  # 43 never arrives: %globaltimer ends it
        return
    flags = new_flags()
    epoch = torch.tensor([41], dtype=torch.int64)
    sync._signal_flag_kernel[(1,)](flags, word(Flag.SEND_READY), 1, epoch, USE_PTX=False, HAS_EPOCH=True)
    assert int(flags[word(Flag.SEND_READY)]) == 42
    status = torch.full((1,), -1, dtype=torch.int64)
    sync._launch_wait_kernel(flags, status, word(Flag.SEND_READY), word(Flag.ERROR), 1, 10**9, 5, False, epoch)
    assert int(status) == sync.STATUS_OK
    sync._launch_wait_kernel(flags, status, word(Flag.SEND_READY), word(Flag.ERROR), 2, 10**9, 5, False, epoch)
    assert int(status) == sync.STATUS_TIMEOUT  # 43 never arrives: the spin cap ends it


@pytest.mark.timeout(30)
def test_positional_form_used_by_all_to_all():
    """wait_flag(flags, word, target, error_word, timeout_s): the call shape of AllToAll._wait."""
    flags = new_flags()
    flags[word(Flag.SEND_READY)] = 2
    wait_flag(flags, word(Flag.SEND_READY), 2, word(Flag.ERROR), 1.0, what="x")
    with pytest.raises(TimeoutError, match="waiting for flags\\[3\\]"):
        wait_flag(flags, 3, 1, word(Flag.ERROR), 0.05)


@pytest.mark.timeout(30)
def test_check_status():
    sync.check_status(torch.tensor([0]), "x")
    with pytest.raises(TimeoutError, match="waiting for x"):
        sync.check_status(torch.tensor([1]), "x")
    with pytest.raises(PeerError):
        sync.check_status(torch.tensor([2]), "x")


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
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA GPU: tests st.release.sys / ld.acquire.sys / %globaltimer")


@needs_gpu
@pytest.mark.timeout(60)
def test_gpu_signal_and_wait_on_pinned_host_flags():
    flags = new_flags().pin_memory()
    signal_flag(flags, word(Flag.SEND_READY), 3, device="cuda")
    torch.cuda.synchronize()
    assert int(flags[word(Flag.SEND_READY)]) == 3
    # The host raises the flag while the kernel spins.
    timer = threading.Timer(0.05, lambda: flags.numpy().__setitem__(word(Flag.DISPATCH_RECV_READY), 1))
    timer.start()
    status = wait_flag(flags, word(Flag.DISPATCH_RECV_READY), 1, timeout_s=10.0, device="cuda")
    torch.cuda.synchronize()
    timer.join()
    sync.check_status(status, "DISPATCH_RECV_READY")
    start = time.monotonic()
    status = wait_flag(flags, word(Flag.COMBINE_RECV_READY), 1, timeout_s=0.05, device="cuda")
    torch.cuda.synchronize()
    assert time.monotonic() - start < 2.0
    with pytest.raises(TimeoutError):
        sync.check_status(status, "COMBINE_RECV_READY")
    flags[word(Flag.ERROR)] = 1
    status = wait_flag(flags, word(Flag.COMBINE_RECV_READY), 1, timeout_s=10.0, device="cuda")
    with pytest.raises(PeerError):
        sync.check_status(status, "COMBINE_RECV_READY")


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
