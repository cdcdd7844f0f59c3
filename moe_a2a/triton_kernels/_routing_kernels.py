"""The `@triton.jit` bodies of `routing.py` (private: launched only by `route_tokens`, which holds the
overview, the checks and the block sizes).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..protocol import device as protocol_device
from . import _details as d


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
def _store_counts(counts_ptr, stride_counts, total, bins, num_bins, bound_m_ptr, num_tokens, CHECK_BOUND: tl.constexpr,
                  node_slots_ptr, node_lo, node_hi, HAS_NODE_SLOTS: tl.constexpr):
    """The fix-up's count row (-1 in every count when CHECK_BOUND finds bound_m outside [0, T]: the call aborts)
    and its node run (`_store_node_slots`)."""
    if CHECK_BOUND:
        bound = tl.load(bound_m_ptr)
        total = tl.where((bound < 0) | (bound > num_tokens), -1, total)
    tl.store(counts_ptr + bins.to(tl.int64) * stride_counts, total, mask=bins < num_bins)
    if HAS_NODE_SLOTS:
        _store_node_slots(node_slots_ptr, total, bins, node_lo, node_hi)


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


@triton.jit
def _store_block_positions(dest, num_bins, local, pid, slot_ptr, num_routes, BLOCK_R: tl.constexpr):
    """Sort a block's routes by bin (`dest`, num_bins = dead) and store each route's position in the block's
    bin-major order (-1 for dead routes) at slot_ptr. Keys `bin * BLOCK_R + local` are unique, so any correct sort
    gives the same order. Returns (sorted_key, sorted_is_live, slot, sorted_route): position `local` in sorted
    order holds route `sorted_route`, a permutation, so each route's slot is written once and the store needs no
    ordering."""
    sorted_key = tl.sort(dest * BLOCK_R + local)
    sorted_local = sorted_key % BLOCK_R
    sorted_is_live = sorted_key < num_bins * BLOCK_R
    slot = tl.where(sorted_is_live, local, -1)
    sorted_route = pid.to(tl.int64) * BLOCK_R + sorted_local
    tl.store(slot_ptr + sorted_route, slot, mask=sorted_route < num_routes)
    return sorted_key, sorted_is_live, slot, sorted_route


@triton.jit
def _hist_totals(hist_ptr, hist_stride, col0, num_cols, num_blocks, pid, N_PAD: tl.constexpr, CHUNK_B: tl.constexpr):
    """Columns [col0, col0 + num_cols) of the blocks' histogram rows: (total over all blocks, total over blocks
    < pid, this block's row), each [N_PAD]."""
    cols = tl.arange(0, N_PAD)
    rows = tl.arange(0, CHUNK_B)
    total = tl.zeros([N_PAD], dtype=tl.int32)
    before = tl.zeros([N_PAD], dtype=tl.int32)
    for start in range(0, num_blocks, CHUNK_B):
        row = start + rows
        tile = tl.load(hist_ptr + row[:, None].to(tl.int64) * hist_stride + col0 + cols[None, :],
                       mask=(row[:, None] < num_blocks) & (cols[None, :] < num_cols), other=0)
        total += tl.sum(tile, axis=0)
        before += tl.sum(tl.where(row[:, None] < pid, tile, 0), axis=0)
    mine = tl.load(hist_ptr + pid.to(tl.int64) * hist_stride + col0 + cols, mask=cols < num_cols, other=0)
    return total, before, mine


# num_tokens is not specialised: T=1 would make it a constexpr int (no .to()) and every T a recompile;
# nor is `abort` (an aborted call must not wait for a compile while its peers wait for it).
@triton.jit(do_not_specialize=["num_tokens", "abort", "sr_node_first"])
def _route_tokens_block_kernel(
    indices_ptr,      # (T, K) int32/int64, contiguous; -1 = not routed
    bound_m_ptr,      # (1,) int32 live token count; read only when HAS_BOUND_M
    route_slot_ptr,   # (T, K) int32, contiguous: out, final slot (SINGLE) or in-block position
    counts_ptr,       # (E,) int32, element stride `stride_counts`: out, written only when SINGLE
    hist_ptr,         # (num_blocks, hist_stride) int32 scratch: out, written only when not SINGLE
    num_tokens,       # T
    num_experts,      # E
    stride_counts,    # elements between consecutive counts (a column of a [W, E] matrix view too)
    hist_stride,      # E, or E + W with RANK_ALSO (the ranks' histogram after the experts')
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
    # RANK_KEYS: indices hold experts (rk_experts of them, RK_L a rank); a route's key is the rank its token's row
    # goes to when it is the token's first route there, else it is dead (`_details.first_route_rank`)
    rk_experts=1, rk_sender=0, K_PAD: tl.constexpr = 1, RK_L: tl.constexpr = 1, RK_RELAY: tl.constexpr = False,
    RK_NODE: tl.constexpr = 1, RANK_KEYS: tl.constexpr = False,
    # RANK_ALSO (not SINGLE): indices hold experts and the per-rank routing (as RANK_KEYS, over rk_ranks ranks) is
    # made beside theirs: in-block positions into rank_slot_ptr, the ranks' histogram at column E of the hist row
    rank_slot_ptr=None, rk_ranks=1, W_BINS: tl.constexpr = 1, RANK_ALSO: tl.constexpr = False,
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
    if RANK_KEYS:
        raw = d.first_route_rank(indices_ptr, route, in_range, rk_experts, K, K_PAD, RK_L, rk_sender, RK_RELAY,
                                 RK_NODE)
    else:
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

    # Dead routes go last.
    sorted_key, sorted_is_live, slot, sorted_route = _store_block_positions(expert, num_experts, local, pid,
                                                                            route_slot_ptr, num_routes, BLOCK_R)
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
        tl.store(hist_ptr + pid.to(tl.int64) * hist_stride + bins, hist, mask=bins < num_experts)
        if RANK_ALSO:  # the token's first route to each rank, ranked in a second sort of the same block
            dest = d.first_route_rank(indices_ptr, route, in_range, num_experts, K, K_PAD, RK_L, rk_sender, RK_RELAY,
                                      RK_NODE)
            dest = tl.where(in_range & (route // K < num_live_tokens) & (dest >= 0), dest, rk_ranks).to(tl.int32)
            _store_block_positions(dest, rk_ranks, local, pid, rank_slot_ptr, num_routes, BLOCK_R)
            rbins = tl.arange(0, W_BINS)
            tl.store(hist_ptr + pid.to(tl.int64) * hist_stride + num_experts + rbins, tl.histogram(dest, W_BINS),
                     mask=rbins < rk_ranks)


@triton.jit(do_not_specialize=["num_tokens", "sr_node_first"])
def _route_tokens_fixup_kernel(
    indices_ptr,      # (T, K) int32/int64, contiguous
    route_slot_ptr,   # (T, K) int32: in: in-block position or -1; out: final slot or -1
    counts_ptr,       # (E,) int32, element stride `stride_counts`: out (program 0 writes it)
    hist_ptr,         # (num_blocks, hist_stride) int32 from _route_tokens_block_kernel
    num_tokens,       # T
    num_experts,      # E
    num_blocks,       # programs of _route_tokens_block_kernel (= this grid)
    stride_counts,
    hist_stride,      # as in _route_tokens_block_kernel
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,       # same as _route_tokens_block_kernel
    E_PAD: tl.constexpr,         # next_pow2(E)
    CHUNK_B: tl.constexpr,       # histogram rows read per step (CHUNK_B * E_PAD <= 4096 elements)
    epoch_ptr=None, ready_ptr=None,  # as in _route_tokens_block_kernel: program 0 releases the epoch when HAS_READY
    HAS_READY: tl.constexpr = False,
    USE_PTX: tl.constexpr = False,
    node_slots_ptr=None, node_lo=0, node_hi=0, HAS_NODE_SLOTS: tl.constexpr = False,  # as in _route_tokens_block_kernel
    bound_m_ptr=None, CHECK_BOUND: tl.constexpr = False,  # as in _route_tokens_block_kernel: a bad bound writes -1
    send_row_ptr=None, sr_node_first=0, SR_L: tl.constexpr = 1, SR_NODE: tl.constexpr = 1,  # as in
    SR_P: tl.constexpr = 0, SR_HR: tl.constexpr = 0, SR_FIRST: tl.constexpr = 0,         # _route_tokens_block_kernel
    SEND_ROWS: tl.constexpr = False,
    rk_sender=0, RK_L: tl.constexpr = 1, RK_RELAY: tl.constexpr = False, RK_NODE: tl.constexpr = 1,  # as in
    RANK_KEYS: tl.constexpr = False,                                                                 # the block
    # RANK_ALSO: the per-rank routing made beside the experts' (as in the block): rows per rank into
    # rank_counts_ptr (stride stride_rank_counts), each opened row into rank_slot_ptr, this node's run of them into
    # rank_node_slots_ptr (RHAS_NODE_SLOTS, ranks [rnode_lo, rnode_hi)); SEND_ROWS then applies to these rows
    rank_counts_ptr=None, rank_slot_ptr=None, stride_rank_counts=1, rk_ranks=1, W_PAD: tl.constexpr = 1,
    CHUNK_BW: tl.constexpr = 1, rank_node_slots_ptr=None, rnode_lo=0, rnode_hi=0,
    RHAS_NODE_SLOTS: tl.constexpr = False, RANK_ALSO: tl.constexpr = False,
):
    """Grid: one program per block of _route_tokens_block_kernel. Each re-reads the whole histogram:
    total[e] over all blocks, before[e] over blocks < pid, and adds
    delta[e] = psum_excl(total)[e] + before[e] - psum_excl(hist[pid])[e] to its routes' positions."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    total, before, mine = _hist_totals(hist_ptr, hist_stride, 0, num_experts, num_blocks, pid, E_PAD, CHUNK_B)
    run_start = tl.cumsum(total, axis=0) - total
    delta = run_start + before - (tl.cumsum(mine, axis=0) - mine)
    if RANK_ALSO:
        ranks = tl.arange(0, W_PAD)
        rtotal, rbefore, rmine = _hist_totals(hist_ptr, hist_stride, num_experts, rk_ranks, num_blocks, pid, W_PAD,
                                              CHUNK_BW)
        rrun_start = tl.cumsum(rtotal, axis=0) - rtotal
        rdelta = rrun_start + rbefore - (tl.cumsum(rmine, axis=0) - rmine)
    if pid == 0:
        _store_counts(counts_ptr, stride_counts, total, experts, num_experts, bound_m_ptr, num_tokens, CHECK_BOUND,
                      node_slots_ptr, node_lo, node_hi, HAS_NODE_SLOTS)
        if RANK_ALSO:
            _store_counts(rank_counts_ptr, stride_rank_counts, rtotal, ranks, rk_ranks, bound_m_ptr, num_tokens,
                          CHECK_BOUND, rank_node_slots_ptr, rnode_lo, rnode_hi, RHAS_NODE_SLOTS)
        if HAS_READY:  # after every count it publishes
            d.publish_epoch(ready_ptr, epoch_ptr, USE_PTX)

    route = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = route < num_tokens.to(tl.int64) * K
    position = tl.load(route_slot_ptr + route, mask=in_range, other=-1)
    is_live = position >= 0
    expert = tl.load(indices_ptr + route, mask=in_range & is_live, other=0).to(tl.int32)
    if RANK_KEYS:  # a live route is its token's first to that rank: its key is that rank
        expert = d.row_destination(expert // RK_L, rk_sender, RK_RELAY, RK_NODE)
    slot = position + tl.gather(delta, expert, 0)
    tl.store(route_slot_ptr + route, tl.where(is_live, slot, -1), mask=in_range)
    if SEND_ROWS and not RANK_ALSO:
        rows = _send_rows(slot, expert, run_start, is_live, sr_node_first, SR_L, SR_NODE, SR_P, SR_HR, SR_FIRST)
        tl.store(send_row_ptr + route, tl.where(is_live, rows, -1), mask=in_range)
    if RANK_ALSO:  # a route that opens a row is live above too, so `expert` holds its expert
        rposition = tl.load(rank_slot_ptr + route, mask=in_range, other=-1)
        r_live = rposition >= 0
        dest = tl.where(r_live, d.row_destination(expert // RK_L, rk_sender, RK_RELAY, RK_NODE), 0)
        rslot = rposition + tl.gather(rdelta, dest, 0)
        tl.store(rank_slot_ptr + route, tl.where(r_live, rslot, -1), mask=in_range)
        if SEND_ROWS:
            rows = _send_rows(rslot, dest, rrun_start, r_live, sr_node_first, SR_L, SR_NODE, SR_P, SR_HR, SR_FIRST)
            tl.store(send_row_ptr + route, tl.where(r_live, rows, -1), mask=in_range)

