"""Routing: per-expert route counts and each route's expert-major send slot.

A *route* is one (token t, slot k) of `indices [T, K]`; routes are numbered row-major, r = t*K + k.
For every expert e, `counts[e]` is the number of live routes to e, and a live route's send slot is

    route_slot[t, k] = psum_excl(counts)[e] + #(earlier live routes r' < r with the same expert e)

i.e. its position when the live routes are sorted stably by expert. Dead routes (index -1, or token
t >= bound_m) get -1 and are not counted.

Deterministic by construction: no atomics decide any position. A block of routes is sorted on the key
`expert * BLOCK_R + local_index` (unique keys, so any correct sort gives the same order), and the sorted
position of a live route *is* its rank within the block's expert-major order.

Two paths, chosen by the launcher from T*K:
- one launch, one program (T*K <= 128): the block is the whole input, so the sorted position is the
  final slot and the block histogram is `counts`.
- two launches (everything else): `_route_block_kernel` writes a histogram row per block of routes and
  the in-block position of each route; `_route_fixup_kernel` turns the histograms into per-(block, expert)
  offsets (every program re-reads the small [num_blocks, E] histogram, which saves a third launch for a
  separate scan) and adds them. No program waits on another program of the same launch, so this also
  runs under `TRITON_INTERPRET=1`, which runs programs one after the other.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import Layout, ceil_div, next_power_of_2
from ..protocol import device as protocol_device
from . import _checks as check
from . import _details as d
from . import _launch as launch

# One program sorts all routes only for tiny inputs: tl.sort is a bitonic network (~log2(N)^2/2 layout
# shuffles), so one program sorting 1024 keys is slower than two launches over small blocks
# (docs/perf-notes.md, "Routing").
SINGLE_PROGRAM_MAX_ROUTES = 128


@triton.jit
def _store_node_slots(node_slots_ptr, counts, experts, node_lo, node_hi):
    """Slots are expert-major, so the routes to one node's experts hold one contiguous run of slots:
    [sum of counts before node_lo, + sum of counts in [node_lo, node_hi)). Kernels that keep a node's
    rows apart from the rest (staging only remote rows) tell them apart by it."""
    first = tl.sum(tl.where(experts < node_lo, counts, 0), axis=0)
    n = tl.sum(tl.where((experts >= node_lo) & (experts < node_hi), counts, 0), axis=0)
    tl.store(node_slots_ptr, first)
    tl.store(node_slots_ptr + 1, first + n)


@triton.jit
def _send_rows(slot, expert, run_start, is_live, sr_node_first, SR_L: tl.constexpr, SR_NODE: tl.constexpr,
               SR_P: tl.constexpr, SR_HR: tl.constexpr, SR_FIRST: tl.constexpr):
    """Each route's send row: its slot, or for the first SR_P routes to a remote rank their row in that rank's
    private staging slot (`Layout.private_stage_index`, `plan.private_stage_rows`), so a private write reads
    one range. `run_start[e]`: the exclusive prefix sum of the counts (the first slot of expert e)."""
    dest = expert // SR_L
    pos = slot - tl.gather(run_start, tl.where(is_live, dest * SR_L, 0), 0)
    after = dest >= sr_node_first + SR_NODE
    staged = is_live & ((dest < sr_node_first) | after) & (pos < SR_P)
    index = tl.where(after, dest - SR_NODE, dest)
    return tl.where(staged, SR_FIRST + index * (SR_HR + SR_P) + SR_HR + pos, slot)


# num_tokens is not specialised: T=1 would make it a constexpr int (no .to()) and every T a recompile;
# nor is `abort` (an aborted call must not wait for a compile while its peers wait for it).
@triton.jit(do_not_specialize=["num_tokens", "abort", "sr_node_first"])
def _route_block_kernel(
    indices_ptr,      # (T, K) int32/int64, contiguous; -1 = not routed
    bound_m_ptr,      # (1,) int32 live token count; read only when HAS_BOUND_M
    route_slot_ptr,   # (T, K) int32, contiguous: out, final slot (SINGLE) or in-block position
    counts_ptr,       # (E,) int32, element stride `stride_counts`: out, written only when SINGLE
    hist_ptr,         # (num_blocks, E) int32 contiguous scratch: out, written only when not SINGLE
    num_tokens,       # T
    num_experts,      # E
    stride_counts,    # elements between consecutive counts (a column of a [W, E] matrix view too)
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,       # routes per program, a power of two
    E_BINS: tl.constexpr,        # next_pow2(E + 1): bin E collects dead routes
    HAS_BOUND_M: tl.constexpr,
    SINGLE: tl.constexpr,        # one program covers every route: write final slots and counts
    epoch_ptr=None,              # (1,) int64: incremented once (program 0) when HAS_EPOCH
    bad_index_ptr=None,          # (1,) int64: 1 + a route with an out-of-range expert, when CHECK
    ready_ptr=None,              # (1,) int64: the epoch, released once counts are written (SINGLE, HAS_READY)
    HAS_EPOCH: tl.constexpr = False,
    CHECK: tl.constexpr = False,
    HAS_READY: tl.constexpr = False,
    USE_PTX: tl.constexpr = False,
    abort=0,                      # SINGLE only, nonzero: write -1 in every count (this rank aborts the call)
    node_slots_ptr=None,          # (2,) int32: out, [first, end) of the slots of experts [node_lo, node_hi)
    node_lo=0, node_hi=0,         # the experts of this rank's node (HAS_NODE_SLOTS)
    HAS_NODE_SLOTS: tl.constexpr = False,
    bad_bound_ptr=None,           # (1,) int64: Flag.BAD_BOUND_M, when CHECK_BOUND and bound_m is outside [0, T]
    CHECK_BOUND: tl.constexpr = False,
    # SINGLE and SEND_ROWS: each route's send row (`_send_rows`) into send_row_ptr ((T, K) int32, contiguous)
    send_row_ptr=None, sr_node_first=0, SR_L: tl.constexpr = 1, SR_NODE: tl.constexpr = 1, SR_P: tl.constexpr = 0,
    SR_HR: tl.constexpr = 0, SR_FIRST: tl.constexpr = 0, SEND_ROWS: tl.constexpr = False,
):
    """Grid: one program per BLOCK_R consecutive routes (one program in total when SINGLE).

    With CHECK_BOUND a bound_m outside [0, T] aborts the call (every route dead, the count row -1, as
    `abort`) and is recorded, so a CUDA graph replayed with a bad count is never a silent result."""
    pid = tl.program_id(0)
    if HAS_EPOCH:
        # The call's epoch advances on the stream, so a CUDA graph replay advances it too.
        if pid == 0:
            tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)
    # int64 before the multiply: T*K*... stays small today, but route offsets feed pointer math.
    local = tl.arange(0, BLOCK_R)
    route = pid.to(tl.int64) * BLOCK_R + local
    num_routes = num_tokens.to(tl.int64) * K
    num_live_tokens = num_tokens
    bad_bound = num_tokens < 0  # False, as a scalar of the type the check gives
    if HAS_BOUND_M:
        bound = tl.load(bound_m_ptr)
        num_live_tokens = tl.minimum(bound, num_tokens)
        if CHECK_BOUND:
            bad_bound = (bound < 0) | (bound > num_tokens)
            num_live_tokens = tl.where(bad_bound, 0, num_live_tokens)
            tl.store(bad_bound_ptr, protocol_device.encode_bad_bound_m(bound), mask=bad_bound & (pid == 0))
    in_range = route < num_routes
    raw = tl.load(indices_ptr + route, mask=in_range, other=-1)
    # Out-of-range experts are refused on the host (validate_indices) or reported through
    # bad_index_ptr (CHECK); either way they are dead here, so a bad index never reaches memory.
    # Compared before the int32 cast: an int64 index past 2**31 must not wrap into range.
    is_live = in_range & (route // K < num_live_tokens) & (raw >= 0) & (raw < num_experts)
    if CHECK:
        is_bad = in_range & (route // K < num_live_tokens) & ((raw < -1) | (raw >= num_experts))
        first_bad = tl.min(tl.where(is_bad, route, num_routes), axis=0)
        tl.store(bad_index_ptr, protocol_device.encode_bad_index(first_bad), mask=first_bad < num_routes)
    expert = raw.to(tl.int32)
    expert = tl.where(is_live, expert, num_experts)

    # Unique keys: the sort order is fully determined, dead routes go last.
    key = expert * BLOCK_R + local
    sorted_key = tl.sort(key)
    sorted_local = sorted_key % BLOCK_R
    sorted_is_live = sorted_key < num_experts * BLOCK_R
    # Position `local` in sorted order holds route `sorted_local`: a permutation, so each route's
    # slot is written by exactly one element and the store needs no ordering.
    slot = tl.where(sorted_is_live, local, -1)
    sorted_route = pid.to(tl.int64) * BLOCK_R + sorted_local
    tl.store(route_slot_ptr + sorted_route, slot, mask=sorted_route < num_routes)

    hist = tl.histogram(expert, E_BINS)  # integer counts: order-independent, hence deterministic
    bins = tl.arange(0, E_BINS)
    if SINGLE:
        if SEND_ROWS:  # sorted position `local` holds expert sorted_key // BLOCK_R: its slot is `local`
            rows = _send_rows(slot, sorted_key // BLOCK_R, tl.cumsum(hist, axis=0) - hist, sorted_is_live,
                              sr_node_first, SR_L, SR_NODE, SR_P, SR_HR, SR_FIRST)
            tl.store(send_row_ptr + sorted_route, rows, mask=sorted_route < num_routes)
        tl.store(counts_ptr + bins.to(tl.int64) * stride_counts, tl.where((abort != 0) | bad_bound, -1, hist),
                 mask=bins < num_experts)
        if HAS_NODE_SLOTS:
            _store_node_slots(node_slots_ptr, hist, bins, node_lo, node_hi)
        if HAS_READY:  # the proxy sends the counts once it sees the epoch
            d.publish_epoch(ready_ptr, epoch_ptr, USE_PTX)
    else:
        tl.store(hist_ptr + pid.to(tl.int64) * num_experts + bins, hist, mask=bins < num_experts)


@triton.jit(do_not_specialize=["num_tokens", "sr_node_first"])
def _route_fixup_kernel(
    indices_ptr,      # (T, K) int32/int64, contiguous
    route_slot_ptr,   # (T, K) int32: in: in-block position or -1; out: final slot or -1
    counts_ptr,       # (E,) int32, element stride `stride_counts`: out (program 0 writes it)
    hist_ptr,         # (num_blocks, E) int32 from _route_block_kernel
    num_tokens,       # T
    num_experts,      # E
    num_blocks,       # programs of _route_block_kernel (= this grid)
    stride_counts,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,       # same as _route_block_kernel
    E_PAD: tl.constexpr,         # next_pow2(E)
    CHUNK_B: tl.constexpr,       # histogram rows read per step (CHUNK_B * E_PAD <= 4096 elements)
    epoch_ptr=None, ready_ptr=None,  # as in _route_block_kernel: program 0 releases the epoch when HAS_READY
    HAS_READY: tl.constexpr = False,
    USE_PTX: tl.constexpr = False,
    node_slots_ptr=None, node_lo=0, node_hi=0, HAS_NODE_SLOTS: tl.constexpr = False,  # as in _route_block_kernel
    bound_m_ptr=None, CHECK_BOUND: tl.constexpr = False,  # as in _route_block_kernel: a bad bound writes -1
    send_row_ptr=None, sr_node_first=0, SR_L: tl.constexpr = 1, SR_NODE: tl.constexpr = 1,  # as in
    SR_P: tl.constexpr = 0, SR_HR: tl.constexpr = 0, SR_FIRST: tl.constexpr = 0,         # _route_block_kernel
    SEND_ROWS: tl.constexpr = False,
):
    """Grid: one program per block of _route_block_kernel. Each re-reads the whole histogram:
    total[e] over all blocks, before[e] over blocks < pid, and adds
    delta[e] = psum_excl(total)[e] + before[e] - psum_excl(hist[pid])[e] to its routes' positions."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    rows = tl.arange(0, CHUNK_B)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_blocks, CHUNK_B):
        row = start + rows
        tile = tl.load(hist_ptr + row[:, None].to(tl.int64) * num_experts + experts[None, :],
                       mask=(row[:, None] < num_blocks) & (experts[None, :] < num_experts), other=0)
        total += tl.sum(tile, axis=0)
        before += tl.sum(tl.where(row[:, None] < pid, tile, 0), axis=0)
    mine = tl.load(hist_ptr + pid.to(tl.int64) * num_experts + experts, mask=experts < num_experts, other=0)
    run_start = tl.cumsum(total, axis=0) - total
    delta = run_start + before - (tl.cumsum(mine, axis=0) - mine)
    if pid == 0:
        if CHECK_BOUND:
            bound = tl.load(bound_m_ptr)
            total = tl.where((bound < 0) | (bound > num_tokens), -1, total)
        tl.store(counts_ptr + experts.to(tl.int64) * stride_counts, total, mask=experts < num_experts)
        if HAS_NODE_SLOTS:
            _store_node_slots(node_slots_ptr, total, experts, node_lo, node_hi)
        if HAS_READY:
            d.publish_epoch(ready_ptr, epoch_ptr, USE_PTX)

    route = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = route < num_tokens.to(tl.int64) * K
    position = tl.load(route_slot_ptr + route, mask=in_range, other=-1)
    is_live = position >= 0
    expert = tl.load(indices_ptr + route, mask=in_range & is_live, other=0).to(tl.int32)
    slot = position + tl.gather(delta, expert, 0)
    tl.store(route_slot_ptr + route, tl.where(is_live, slot, -1), mask=in_range)
    if SEND_ROWS:
        rows = _send_rows(slot, expert, run_start, is_live, sr_node_first, SR_L, SR_NODE, SR_P, SR_HR, SR_FIRST)
        tl.store(send_row_ptr + route, tl.where(is_live, rows, -1), mask=in_range)


def _block_routes_for(num_routes: int) -> int:
    """Routes per program on the two-launch path: ~16 blocks, within [64, 512] (1024 -> 64, 2048 -> 128,
    4096 -> 256, >= 8192 -> 512; the E=256 histogram each program re-reads from L2 stays <= 64 KB)."""
    return min(512, max(64, next_power_of_2(max(1, num_routes // 16))))


def validate_indices(indices: torch.Tensor, num_experts: int) -> None:
    """Host check that every value of `indices` is -1 or in [0, num_experts). Syncs the device.

    Raises ValueError naming the first bad value and its (token, slot)."""
    if indices.numel() == 0:
        return
    bad = (indices < -1) | (indices >= num_experts)
    if bool(bad.any()):
        t, k = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"indices[{t}, {k}] = {int(indices[t, k])}: expected -1 (not routed) or a value "
                         f"in [0, {num_experts})")


def route_tokens(
    indices: torch.Tensor,
    num_experts: int,
    out_counts: torch.Tensor | None = None,
    out_route_slot: torch.Tensor | None = None,
    bound_m: torch.Tensor | None = None,
    *,
    epoch: torch.Tensor | None = None,
    bad_index: torch.Tensor | None = None,
    ready: torch.Tensor | None = None,
    abort: bool = False,
    bad_bound_m: torch.Tensor | None = None,
    out_node_slots: torch.Tensor | None = None,
    node_experts: tuple[int, int] = (0, 0),
    out_send_row: torch.Tensor | None = None,
    private_stage: tuple[Layout, int] | None = None,
    _single_max_routes: int = SINGLE_PROGRAM_MAX_ROUTES,
    _block_routes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Count routes per expert and give every route its expert-major send slot.

    Args:
        indices: `[num_tokens, num_topk]` int32/int64, contiguous, `-1` = not routed. Values must be
            -1 or in [0, num_experts) (check with `validate_indices`; others are treated as -1).
        num_experts: E.
        out_counts: optional `[E]` int32 on the device of `indices` or, for a CUDA `indices`, in
            pinned/registered host memory; any stride (e.g. this rank's row of the `[W, E]` routing
            matrix in the shared segment, or a column of a transposed view).
        out_route_slot: optional `[num_tokens, num_topk]` int32, contiguous.
        bound_m: optional `[1]` int32 device tensor; tokens >= min(bound_m, T) are dead.
        epoch: optional `[1]` int64 tensor on the device, incremented once on the stream (the call's
            epoch, for the same-node synchronisation of the kernels that follow; CUDA-graph safe).
        bad_index: optional `[1]` int64 tensor (device or pinned host memory): when a live route has an
            expert outside [-1, num_experts), `1 + t*K + k` of one such route is stored there (the
            device-side replacement of `validate_indices`, which syncs); the route is treated as -1.
        ready: optional `[1]` int64 tensor (needs `epoch`): the epoch is stored there with a system-scope
            release once `out_counts` is written (the proxy's ROUTE_READY flag).
        bad_bound_m: optional `[1]` int64 tensor (device or pinned host memory), with `bound_m`: a bound_m
            outside [0, T] aborts the call on the device (as `abort`) and is recorded there
            (`protocol.words.encode_bad_bound_m`).
        abort: needs T == 0: every count is written as -1, the mark of a call this rank aborts (its
            peers see the row, move nothing from it and report the abort; docs/protocol.md).
        out_node_slots: optional `[2]` int32 on the device of `indices`: `[first, end)` of the slots of
            the routes to experts `node_experts = (lo, hi)` (one contiguous run: slots are expert-major).
            The kernels that stage only remote rows use it to tell this node's rows from the others.
        out_send_row: optional `[num_tokens, num_topk]` int32, contiguous, with `private_stage = (layout,
            rank)`: the row each route is packed into (`pack_tokens_by_expert(max_slots=)`): its slot, but
            for the first `layout.private_rows` routes to each remote rank their row in that rank's slot
            of the send buffer's private staging region (`plan.private_stage_rows`), -1 for dead routes.

    Returns:
        `(counts [E] int32, route_slot [T, K] int32)`: counts of live routes per expert; each live
        route's position in the stable expert-major order (`psum_excl(counts)[e]` + earlier routes to
        e), -1 for dead routes. Per-rank send offsets follow from counts (`plan.send_offsets`).

    One launch when T*K <= SINGLE_PROGRAM_MAX_ROUTES, two otherwise (plus a [blocks, E] int32 scratch
    allocation from the caching allocator).
    Does not sync the CPU; safe in a CUDA graph when the outputs are given. `_single_max_routes` and
    `_block_routes` (a power of two) exist so tests can reach the two-launch path with small inputs
    (the interpreter's tl.sort costs seconds per 1024 keys).
    """
    key = None
    if isinstance(indices, torch.Tensor) and indices.is_cuda and out_counts is not None and out_route_slot is not None:
        key = launch.key(indices, num_experts, out_counts, out_route_slot, bound_m, epoch, bad_index, ready,
                         _single_max_routes, _block_routes, bool(abort), out_node_slots, tuple(node_experts), bad_bound_m,
                         out_send_row, private_stage)
        two = key in _FIXUP_KEYS
        if _BLOCK.has(key) and (not two or _FIXUP.has(key)) and _BLOCK.hit(key):
            if two and not _FIXUP.hit(key):
                raise RuntimeError("route_tokens: the remembered second launch failed after the first ran")
            return out_counts, out_route_slot
    check.tensor("indices", indices, dtypes=(torch.int32, torch.int64), shape=("T", "K"), strides="contiguous")
    check.integer("num_experts", num_experts, lo=1)
    T, K = indices.shape
    if K < 1:
        check.fail("indices", "at least one column (K >= 1)", f"shape {[T, K]}")
    device = indices.device
    if out_counts is None:
        out_counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    else:  # any stride: a column of the [W, E] routing matrix, or its row in pinned host memory
        check.tensor("out_counts", out_counts, dtypes=(torch.int32,), shape=(num_experts,), device=device,
                     host_ok=True, strides="any")
    if out_route_slot is None:
        out_route_slot = torch.empty(T, K, dtype=torch.int32, device=device)
    else:
        check.tensor("out_route_slot", out_route_slot, dtypes=(torch.int32,), shape=(T, K), device=device,
                     strides="contiguous")
    check.bound_m(bound_m, device)
    if ready is not None and epoch is None:
        check.fail("ready", "together with epoch (the value it publishes)", "epoch=None")
    for name, t in (("epoch", epoch), ("bad_index", bad_index), ("ready", ready), ("bad_bound_m", bad_bound_m)):
        if t is not None:
            check.scalar(name, t, torch.int64, device, host_ok=True)
    if abort and T != 0:
        check.fail("abort", "T == 0 (an aborting rank sends no tokens)", f"T = {T}")
    if out_node_slots is not None:
        check.tensor("out_node_slots", out_node_slots, dtypes=(torch.int32,), shape=(2,), device=device)
        lo_e, hi_e = node_experts
        if not 0 <= lo_e <= hi_e <= num_experts:
            check.fail("node_experts", f"0 <= lo <= hi <= {num_experts}", str(node_experts))
    if (out_send_row is None) != (private_stage is None):
        check.fail("out_send_row", "together with private_stage=(layout, rank)", "only one of them")
    if out_send_row is not None:
        check.tensor("out_send_row", out_send_row, dtypes=(torch.int32,), shape=(T, K), device=device,
                     strides="contiguous")
        lay, rank = private_stage
        if lay.num_experts != num_experts or not 0 <= rank < lay.world_size:
            check.fail("private_stage", f"a layout of {num_experts} experts and one of its ranks", str(private_stage))
        slots_args = dict(send_row_ptr=out_send_row, sr_node_first=lay.node_of(rank) * lay.node_size,
                          SR_L=lay.num_local_experts, SR_NODE=lay.node_size, SR_P=lay.private_rows,
                          SR_HR=lay.header_rows, SR_FIRST=lay.max_routes, SEND_ROWS=True)
    else:
        slots_args = {}
    use_ptx = device.type == "cuda"
    extra = dict(epoch_ptr=epoch, bad_index_ptr=bad_index, ready_ptr=ready, HAS_EPOCH=epoch is not None,
                 CHECK=bad_index is not None, HAS_READY=ready is not None, USE_PTX=use_ptx)
    check_bound = bound_m is not None and bad_bound_m is not None
    if check_bound:
        extra.update(bad_bound_ptr=bad_bound_m, CHECK_BOUND=True)
    if out_node_slots is not None:
        slots_args.update(node_slots_ptr=out_node_slots, node_lo=node_experts[0], node_hi=node_experts[1],
                          HAS_NODE_SLOTS=True)
    num_routes = T * K
    e_bins = next_power_of_2(num_experts + 1)
    bound_arg = bound_m if bound_m is not None else out_counts  # never read without HAS_BOUND_M
    single = num_routes <= _single_max_routes
    if single:
        block_r = max(16, next_power_of_2(num_routes))
    else:
        block_r = _block_routes_for(num_routes) if _block_routes is None else _block_routes
        if block_r < 16 or block_r & (block_r - 1):
            check.fail("_block_routes", "a power of two >= 16", str(block_r))
    if (num_experts + 1) * block_r >= 2**31:  # sort keys are int32: expert * BLOCK_R + position
        check.fail("num_experts", f"(num_experts + 1) * {block_r} < 2**31 (int32 sort keys)", str(num_experts))
    if single:
        _BLOCK.launch(
            key, (1,), indices, bound_arg, out_route_slot, out_counts, out_counts,
            T, num_experts, out_counts.stride(0),
            K=K, BLOCK_R=block_r, E_BINS=e_bins, HAS_BOUND_M=bound_m is not None, SINGLE=True,
            num_warps=4 if block_r <= 1024 else 8, abort=int(bool(abort)), **extra, **slots_args,
        )
        return out_counts, out_route_slot

    num_blocks = ceil_div(num_routes, block_r)
    if key is not None:  # a remembered launch keeps its scratch address: one per shape, kept here
        hist = _HIST.setdefault((device, num_blocks, num_experts), torch.empty(
            num_blocks, num_experts, dtype=torch.int32, device=device))
        if len(_FIXUP_KEYS) > 4096:  # forget all three together: a key must never lose its second half
            _FIXUP_KEYS.clear()
            _BLOCK.clear()
            _FIXUP.clear()
        _FIXUP_KEYS.add(key)
    else:
        hist = torch.empty(num_blocks, num_experts, dtype=torch.int32, device=device)
    _BLOCK.launch(
        key, (num_blocks,), indices, bound_arg, out_route_slot, out_counts, hist,
        T, num_experts, out_counts.stride(0),
        K=K, BLOCK_R=block_r, E_BINS=e_bins, HAS_BOUND_M=bound_m is not None, SINGLE=False,
        num_warps=4, **extra,
    )
    e_pad = next_power_of_2(num_experts)
    _FIXUP.launch(
        key, (num_blocks,), indices, out_route_slot, out_counts, hist,
        T, num_experts, num_blocks, out_counts.stride(0),
        K=K, BLOCK_R=block_r, E_PAD=e_pad, CHUNK_B=max(1, 4096 // e_pad),
        epoch_ptr=epoch, ready_ptr=ready, HAS_READY=ready is not None, USE_PTX=use_ptx,
        bound_m_ptr=bound_arg, CHECK_BOUND=check_bound, num_warps=4, **slots_args,
    )
    return out_counts, out_route_slot


_BLOCK = launch.LaunchCache(_route_block_kernel)
_FIXUP = launch.LaunchCache(_route_fixup_kernel)
_FIXUP_KEYS: set = set()  # keys whose launch has the second kernel
_HIST: dict = {}

__all__ = ["route_tokens", "validate_indices", "SINGLE_PROGRAM_MAX_ROUTES"]
