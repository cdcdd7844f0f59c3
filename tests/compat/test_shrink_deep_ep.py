"""DeepEP's `--shrink-test` sequence with the facade, between real processes (issue 31): each dispatch's handle
is combined twice, once from `x` and once zero-copy (from `get_next_low_latency_combine_buffer`, with the
routes to masked ranks set to -1 in between, as DeepEP's check does), while ranks stop: one at its first
dispatch, one at its first combine, one between its two combines. Every survivor's combined tokens are
compared exactly with the reference sum (fp32, k order, one cast; a route to a rank masked by the end of
that combine adds 0), in bf16 with zero-copy second and in fp8 with zero-copy first.

The defect this holds (DeepEP's test at 8 processes: `diff=0.0010752 ... dispatch_use_fp8=False,
zero_copy=True`): the facade combines a handle a second time by dispatching its tokens again; a rank masked
since the handle's dispatch is missing from that dispatch, so its rows are gone and the rows of the sources
after it moved up, while the expert outputs given to the combine are laid out as the handle's dispatch
laid them out: the sources after a masked one got other rows' outputs back."""
from __future__ import annotations

import os

import pytest
import torch

from moe_a2a.oracle import combine_problems, default_max_ulps
from moe_a2a.triton_kernels.quant import dequantize_fp8

from ..conftest import TEST_DEVICE
from ..proxy._peers import run_peers
from ..triton_kernels.test_quant import torch_quantize
from .test_deep_ep import _dequantize

pytestmark = [pytest.mark.slow]

W, T, E, K, H = 5, 4, 10, 4, 128
# Who stops calling where (each then stays alive and silent, its Buffer open, until the survivors are done, as
# DeepEP's failed ranks wait in its final barrier): rank 1 at its first dispatch, rank 2 at its first combine,
# rank 3 between its first two combines.
STOPS = {1: "dispatch", 2: "combine", 3: "second combine"}
SURVIVORS = [r for r in range(W) if r not in STOPS]
ROUNDS = 2  # the second: every mask settled, return_recv_hook=True
# The masking time (Buffer(timeout_s=)): a survivor masks a silent rank after this. A call takes well under
# a second here (the interpreter, 5 processes on 2 cores): a live rank is not masked.
TIMEOUT_S = 4.0


def _inputs(rank: int, rnd: int):
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.15] = -1
    w = torch.rand(T, K, generator=g, dtype=torch.float32)
    return x, idx, w


def _owner_masked(idx: torch.Tensor, masked: list[int]) -> torch.Tensor:
    L = E // W
    return (idx >= 0) & torch.isin(torch.where(idx >= 0, idx // L, 0), torch.tensor(masked, dtype=torch.int64,
                                                                                    device=idx.device))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes (fp8 and bf16 compared bitwise; fp32 scales are column-major, DeepEP's layout)."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t


def _rank(comm, store: str, use_fp8: bool, zero_copy_first: bool, device: str):
    """One rank of DeepEP's shrink sequence: per round, dispatch, expert (2 x what arrived), combine twice
    (the zero-copy one first or second), DeepEP's -1 edit of the routes between them, clean. Returns per
    round what it saw, as plain lists."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from moe_a2a.compat import Buffer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=comm.rank, world_size=comm.size)
    rank = comm.rank
    buf = Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, W, E), enable_shrink=True,
                 explicitly_destroy=True, transport="shm", timeout_s=TIMEOUT_S, device=device)
    status = torch.zeros(W, dtype=torch.int32, device=device)
    stop, seen = STOPS.get(rank), []

    def mask() -> list[int]:
        buf.low_latency_query_mask_buffer(status)
        return status.nonzero().flatten().tolist()

    def rounds() -> None:  # returns where this rank stops
        for rnd in range(ROUNDS):
            hook_mode = rnd == 1
            x, idx, w = (t.to(device) for t in _inputs(rank, rnd))
            got = {}
            if stop == "dispatch":
                return
            for _ in range(2 if rnd == 0 else 1):  # DeepEP's first dispatch is made twice: one never combined
                recv_x, count, handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=use_fp8,
                                                                          return_recv_hook=hook_mode)
                if hook_mode:
                    hook()
            got["mask_dispatch"] = mask()
            y = (2 * _dequantize(recv_x, H)).to(torch.bfloat16)  # the expert: 2 x what arrived, dequantised
            # What the dispatch returned, to see that the combines leave it as it was.
            returned = ((recv_x,) if not use_fp8 else recv_x) + (count, handle[0], handle[1])
            before = [_bits(t).clone() for t in returned]
            for n, zero_copy in enumerate((zero_copy_first, not zero_copy_first)):
                if stop == ("combine", "second combine")[n]:
                    return
                if zero_copy:
                    buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
                out = torch.empty(T, H, dtype=torch.bfloat16, device=device)
                # Zero-copy sends the buffer: the x given is not read (zeros here, so that reading it would show).
                combined, _, chook = buf.low_latency_combine(torch.zeros_like(y) if zero_copy else y, idx, w,
                                                             handle, zero_copy=zero_copy,
                                                             return_recv_hook=hook_mode, out=out)
                if hook_mode:
                    chook()
                got[f"mask_combine{n}"] = m = mask()
                got[f"combined{n}"] = combined.float().tolist()
                # DeepEP's check sets the routes to masked ranks to -1, in place, before the next combine.
                idx = torch.where(_owner_masked(idx, m), torch.full_like(idx, -1), idx)
            got["unchanged"] = all(torch.equal(_bits(t), b) for t, b in zip(returned, before))
            buf.clean_low_latency_buffer(T, H, E)
            got["mask_clean"] = mask()
            seen.append(got)

    rounds()
    # A stopped rank stays alive and silent, its Buffer open, until the survivors are done (as DeepEP's
    # failed ranks wait in its final barrier).
    comm.allgather(None)
    buf.destroy()
    return seen


def _expected(rank: int, rnd: int, masked: list[int], use_fp8: bool) -> torch.Tensor:
    """The reference's combined tokens of `rank`: sum_k w * 2 * x (x as it arrived: fp8 dequantised), fp32,
    k order, one cast; a route to a rank in `masked` adds 0."""
    x, idx, w = _inputs(rank, rnd)
    xf = dequantize_fp8(*torch_quantize(x, 128), 128) if use_fp8 else x.float()
    y = (2 * xf).to(torch.bfloat16).float()
    keep = (idx >= 0) & ~_owner_masked(idx, masked)
    acc = torch.zeros(T, H, dtype=torch.float32)
    for k in range(K):
        acc += torch.where(keep[:, k], w[:, k], 0.0)[:, None] * y
    return acc.to(torch.bfloat16)


# Each payload with one combine order (the order and the payload meet no common code; four runs were ~80 s of CI).
@pytest.mark.timeout(180)
@pytest.mark.parametrize("use_fp8,zero_copy_first", [(False, False), (True, True)],
                         ids=["bf16-zero-copy-second", "fp8-zero-copy-first"])
def test_deep_ep_shrink_sequence_combines_each_handle_twice_exactly(tmp_path, use_fp8, zero_copy_first):
    """Rank 1 stops at its first dispatch, rank 2 at its first combine, rank 3 between its first two
    combines: the survivors mask them there (DeepEP's query after each call), and each combine of a handle,
    the one after a rank was masked included, equals the reference with the routes to the ranks masked by
    then dropped; the dispatch's recv_x, count and handle are as the dispatch returned them after both
    combines."""
    L = E // W
    first = [_inputs(s, 0)[1] for s in range(W)]
    assert any(bool((first[4] == e).any()) and any(bool((first[s] == e).any()) for s in (2, 3))
               for r in SURVIVORS for e in range(r * L, (r + 1) * L)), \
        "the inputs must give a survivor's expert rows of rank 2 or 3 and, after them, of rank 4 (rows that move)"
    got = run_peers(W, _rank, str(tmp_path / "store"), use_fp8, zero_copy_first, TEST_DEVICE, timeout_s=150)
    for r in STOPS:
        assert got[r] == [], (r, got[r])
    problems = []
    for r in SURVIVORS:
        assert len(got[r]) == ROUNDS, (r, len(got[r]))
        for rnd, g in enumerate(got[r]):
            assert g["mask_dispatch"] == ([1] if rnd == 0 else [1, 2, 3]), (r, rnd, g)
            assert g["mask_combine0"] == ([1, 2] if rnd == 0 else [1, 2, 3]), (r, rnd, g)
            assert g["mask_combine1"] == g["mask_clean"] == [1, 2, 3], (r, rnd, g)
            for n in (0, 1):
                want = _expected(r, rnd, g[f"mask_combine{n}"], use_fp8)
                have = torch.tensor(g[f"combined{n}"]).to(torch.bfloat16)  # exact: it was bf16
                problems += combine_problems(have, want, default_max_ulps(TEST_DEVICE),
                                             f"rank {r} round {rnd} combine {n}")
            if not g["unchanged"]:
                problems.append(f"rank {r} round {rnd}: the combines changed the dispatch's recv_x or handle")
    assert problems == [], "\n".join(problems)


def test_moved_rows_ignores_the_callers_default_device():
    """DeepEP's tests set a default device (cuda): the facade's host-side row bookkeeping of a repeated
    combine must not create tensors there (it once raised index_select's device mismatch on the H200)."""
    from moe_a2a.compat.deep_ep import _moved_rows

    old = torch.tensor([[(0 << 32) | 2, (2 << 32) | 1], [(0 << 32) | 0, (0 << 32) | 3]], dtype=torch.int64)
    new = torch.tensor([[(0 << 32) | 2, (2 << 32) | 0], [(0 << 32) | 0, (0 << 32) | 3]], dtype=torch.int64)
    want = _moved_rows(old, new, 8)
    with torch.device("meta"):
        got = _moved_rows(old, new, 8)
    assert [t.tolist() for t in got] == [t.tolist() for t in want] == [[0, 1, 8, 9, 10], [0, 1, 8, 9, 10]]
