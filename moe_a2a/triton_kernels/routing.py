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
- two launches (everything else): `_route_tokens_block_kernel` writes a histogram row per block of routes
  and the in-block position of each route; `_route_tokens_fixup_kernel` turns the histograms into
  per-(block, expert) offsets (every program re-reads the small [num_blocks, E] histogram, which saves a
  third launch for a separate scan) and adds them. No program waits on another program of the same launch, so this also
  runs under `TRITON_INTERPRET=1`, which runs programs one after the other.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import Layout, ceil_div, next_power_of_2
from . import _checks as check
from . import _launch as launch
from ._routing_kernels import _route_tokens_block_kernel, _route_tokens_fixup_kernel

# One program sorts all routes only for tiny inputs: tl.sort is a bitonic network (~log2(N)^2/2 layout
# shuffles), so one program sorting 1024 keys is slower than two launches over small blocks
# (docs/perf-notes.md, "Routing").
SINGLE_PROGRAM_MAX_ROUTES = 128
# `route_tokens(ranks=)` routes the ranks in the experts' two launches; False: a call of its own after them
# (the A/B of `benchmarks/gpu/wire_kernels.py --set triton_kernels.routing.FUSE_RANK_ROUTING=0`).
FUSE_RANK_ROUTING = True


def _block_routes_for(num_routes: int) -> int:
    """Routes per program on the two-launch path: ~16 blocks, within [64, 512] (1024 -> 64, 2048 -> 128,
    4096 -> 256, >= 8192 -> 512; the E=256 histogram each program re-reads from L2 stays <= 64 KB)."""
    return min(512, max(64, next_power_of_2(max(1, num_routes // 16))))


@dataclasses.dataclass(frozen=True)
class RankRoutes:
    """The per-rank routing (`route_tokens(rank_keys=)`: rows per destination rank and the row each route opens)
    made in the same launches as the experts' routing (`route_tokens(ranks=)`). Its fields are the arguments the
    standalone call (`rank_rows.route_tokens_by_rank`) takes, with the same meaning; `node_ranks` is that call's
    `node_experts` (this node's ranks), `out_send_row` / `private_stage` apply to the rows it opens."""
    layout: Layout
    out_counts: torch.Tensor
    out_slot: torch.Tensor
    rank: int | None = None
    out_node_slots: torch.Tensor | None = None
    node_ranks: tuple[int, int] = (0, 0)
    out_send_row: torch.Tensor | None = None
    private_stage: tuple[Layout, int] | None = None

    def routing_args(self) -> dict:
        """`route_tokens`' arguments for the same routing as a call of its own."""
        return dict(out_counts=self.out_counts, out_route_slot=self.out_slot, rank_keys=(self.layout, self.rank),
                    out_node_slots=self.out_node_slots, node_experts=self.node_ranks,
                    out_send_row=self.out_send_row, private_stage=self.private_stage)

    def key(self) -> tuple:
        """Its part of a remembered launch's key: tensors by address, dtype, shape and strides (`launch.key`), so
        a new view of the same rows (a call's `opened[:T]`) hits again."""
        return launch.key(self.layout, self.out_counts, self.out_slot, self.rank, self.out_node_slots,
                          self.node_ranks, self.out_send_row, self.private_stage)


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
    rank_keys: tuple[Layout, int | None] | None = None,
    ranks: RankRoutes | None = None,
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
            of the send buffer's private staging region (`plan.private_stage_rows`), -1 for dead routes. With
            per-rank rows (`layout.rank_rows`) `indices` may hold ranks (`num_experts = layout.world_size`).
        rank_keys: optional `(layout, rank)`, with `num_experts = layout.world_size`: per-rank rows routed
            straight from the experts in `indices` (values in [0, layout.num_experts)): a route's key is the rank
            its token's row goes to (its expert's rank, or with `layout.relay` for a rank of another node this
            `rank`'s relay there) when no live route k' < k of the token goes there, else the route is dead. So
            the counts are rows per destination rank and each live route's slot the row it opens.
        ranks: optional `RankRoutes`, with experts in `indices`: also the per-rank routing (`rank_keys`), made in
            the same two launches (its own sort of each block, its histogram beside the experts'; `ready` is
            published once both counts are written; a bad `bound_m` writes -1 in both). Inputs of one program,
            or `out_send_row` given here (send rows of the routes), make it a call of its own after this one.

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
    if ranks is not None:
        if rank_keys is not None:
            check.fail("ranks", "None with rank_keys (indices of experts, not ranks)", "both")
        if not isinstance(ranks.layout, Layout) or ranks.layout.num_experts != num_experts:
            check.fail("ranks", f"the RankRoutes of a layout of {num_experts} experts",
                       f"{getattr(ranks.layout, 'num_experts', ranks.layout)}")
    if ranks is not None and (not FUSE_RANK_ROUTING or out_send_row is not None
                              or not isinstance(indices, torch.Tensor) or indices.dim() != 2
                              or indices.numel() <= _single_max_routes):
        # Not fused: the experts' routing, then the ranks' as a call of its own (its arguments checked first).
        if isinstance(indices, torch.Tensor) and indices.dim() == 2:
            _check_rank_routes(ranks, *indices.shape, indices.device)
        route_tokens(indices, num_experts, out_counts, out_route_slot, bound_m, epoch=epoch, bad_index=bad_index,
                     ready=ready, abort=abort, bad_bound_m=bad_bound_m, out_node_slots=out_node_slots,
                     node_experts=node_experts, out_send_row=out_send_row, private_stage=private_stage,
                     _single_max_routes=_single_max_routes, _block_routes=_block_routes)
        route_tokens(indices, ranks.layout.world_size, bound_m=bound_m, abort=abort, bad_bound_m=bad_bound_m,
                     **ranks.routing_args(), _single_max_routes=_single_max_routes, _block_routes=_block_routes)
        return out_counts, out_route_slot
    key = None
    if isinstance(indices, torch.Tensor) and indices.is_cuda and out_counts is not None and out_route_slot is not None:
        key = launch.key(indices, num_experts, out_counts, out_route_slot, bound_m, epoch, bad_index, ready,
                         _single_max_routes, _block_routes, bool(abort), out_node_slots, tuple(node_experts), bad_bound_m,
                         out_send_row, private_stage, rank_keys, None if ranks is None else ranks.key())
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
        _check_node_slots(out_node_slots, node_experts, num_experts, device)
    slots_args = _send_row_args(out_send_row, private_stage, num_experts, T, K, device)
    rank_args, block_rank_args, fixup_rank_args, hist_stride = {}, {}, {}, num_experts
    if rank_keys is not None:
        rank_args, block_rank_args = _rank_key_args(rank_keys, num_experts, K, "rank_keys")
        rank_args["RANK_KEYS"] = True
    if ranks is not None:  # the ranks' routing beside the experts' (see `ranks`)
        lay = ranks.layout
        W = lay.world_size
        rank_args, block_rank_args = _rank_key_args((lay, ranks.rank), W, K, "ranks")
        block_rank_args.update(rk_experts=num_experts)
        slots_args = _check_rank_routes(ranks, T, K, device)
        if ranks.out_node_slots is not None:
            fixup_rank_args.update(rank_node_slots_ptr=ranks.out_node_slots, rnode_lo=ranks.node_ranks[0],
                                   rnode_hi=ranks.node_ranks[1], RHAS_NODE_SLOTS=True)
        rank_args.update(rank_slot_ptr=ranks.out_slot, rk_ranks=W, RANK_ALSO=True)
        block_rank_args.update(W_BINS=next_power_of_2(W + 1))
        w_pad = next_power_of_2(W)
        # blocks a step of the ranks' histogram pass: ~16 at decode, so 64 rows, not 4096 // W_PAD mostly masked
        fixup_rank_args.update(rank_counts_ptr=ranks.out_counts, stride_rank_counts=ranks.out_counts.stride(0),
                               W_PAD=w_pad, CHUNK_BW=max(1, min(64, 4096 // w_pad)))
        hist_stride = num_experts + W
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
            T, num_experts, out_counts.stride(0), hist_stride,
            K=K, BLOCK_R=block_r, E_BINS=e_bins, HAS_BOUND_M=bound_m is not None, SINGLE=True,
            num_warps=4 if block_r <= 1024 else 8, abort=int(bool(abort)), **extra, **slots_args, **rank_args,
            **block_rank_args,
        )
        return out_counts, out_route_slot

    num_blocks = ceil_div(num_routes, block_r)
    if key is not None:  # a remembered launch keeps its scratch address: one per shape, kept here
        hist = _HIST.setdefault((device, num_blocks, hist_stride), torch.empty(
            num_blocks, hist_stride, dtype=torch.int32, device=device))
        if len(_FIXUP_KEYS) > 4096:  # forget all three together: a key must never lose its second half
            _FIXUP_KEYS.clear()
            _BLOCK.clear()
            _FIXUP.clear()
        _FIXUP_KEYS.add(key)
    else:
        hist = torch.empty(num_blocks, hist_stride, dtype=torch.int32, device=device)
    _BLOCK.launch(
        key, (num_blocks,), indices, bound_arg, out_route_slot, out_counts, hist,
        T, num_experts, out_counts.stride(0), hist_stride,
        K=K, BLOCK_R=block_r, E_BINS=e_bins, HAS_BOUND_M=bound_m is not None, SINGLE=False,
        num_warps=4, **extra, **rank_args, **block_rank_args,
    )
    e_pad = next_power_of_2(num_experts)
    _FIXUP.launch(
        key, (num_blocks,), indices, out_route_slot, out_counts, hist,
        T, num_experts, num_blocks, out_counts.stride(0), hist_stride,
        K=K, BLOCK_R=block_r, E_PAD=e_pad, CHUNK_B=max(1, 4096 // e_pad),
        epoch_ptr=epoch, ready_ptr=ready, HAS_READY=ready is not None, USE_PTX=use_ptx,
        bound_m_ptr=bound_arg, CHECK_BOUND=check_bound, num_warps=4, **slots_args, **rank_args, **fixup_rank_args,
    )
    return out_counts, out_route_slot


def _check_node_slots(out_node_slots, node_experts, num_experts: int, device, prefix: str = "") -> None:
    check.tensor(prefix + "out_node_slots", out_node_slots, dtypes=(torch.int32,), shape=(2,), device=device)
    lo_e, hi_e = node_experts
    if not 0 <= lo_e <= hi_e <= num_experts:
        check.fail(prefix + ("node_ranks" if prefix else "node_experts"), f"0 <= lo <= hi <= {num_experts}",
                   str(node_experts))


def _send_row_args(out_send_row, private_stage, num_experts: int, T: int, K: int, device, prefix: str = "") -> dict:
    """The kernels' send-row arguments (`out_send_row`, `private_stage`), checked; {} without them."""
    if (out_send_row is None) != (private_stage is None):
        check.fail(prefix + "out_send_row", "together with private_stage=(layout, rank)", "only one of them")
    if out_send_row is None:
        return {}
    check.tensor(prefix + "out_send_row", out_send_row, dtypes=(torch.int32,), shape=(T, K), device=device,
                 strides="contiguous")
    lay, rank = private_stage
    # Per-rank rows route over ranks (num_experts = W "experts", one per rank): a rank's run is its one bin.
    by_rank = lay.rank_rows and num_experts == lay.world_size
    if (lay.num_experts != num_experts and not by_rank) or not 0 <= rank < lay.world_size:
        check.fail(prefix + "private_stage", f"a layout of {num_experts} experts (or ranks, with per-rank rows) and "
                   f"one of its ranks", str(private_stage))
    return dict(send_row_ptr=out_send_row, sr_node_first=lay.node_of(rank) * lay.node_size,
                SR_L=1 if by_rank else lay.num_local_experts, SR_NODE=lay.node_size, SR_P=lay.private_rows,
                SR_HR=lay.header_rows, SR_FIRST=lay.send_rows, SEND_ROWS=True)


def _check_rank_routes(ranks: RankRoutes, T: int, K: int, device) -> dict:
    """`RankRoutes`' tensors checked (named `ranks.<field>`); returns its send-row arguments (`_send_row_args`)."""
    W = ranks.layout.world_size
    check.tensor("ranks.out_counts", ranks.out_counts, dtypes=(torch.int32,), shape=(W,), device=device,
                 host_ok=True, strides="any")
    check.tensor("ranks.out_slot", ranks.out_slot, dtypes=(torch.int32,), shape=(T, K), device=device,
                 strides="contiguous")
    if ranks.out_node_slots is not None:
        _check_node_slots(ranks.out_node_slots, ranks.node_ranks, W, device, "ranks.")
    return _send_row_args(ranks.out_send_row, ranks.private_stage, W, T, K, device, "ranks.")


def _rank_key_args(rank_keys, num_ranks: int, K: int, name: str) -> tuple[dict, dict]:
    """Both kernels' and the block kernel's arguments of the per-rank keys (`rank_keys` or `ranks`), checked."""
    lay, rank = rank_keys
    if not isinstance(lay, Layout) or num_ranks != lay.world_size:
        check.fail(name, f"(layout, rank) of a layout of {num_ranks} ranks", str(rank_keys))
    relay = lay.relay
    if relay:
        check.integer(f"{name}[1]", rank, 0, lay.world_size)
    return (dict(rk_sender=rank if relay else 0, RK_L=lay.num_local_experts, RK_RELAY=relay, RK_NODE=lay.node_size),
            dict(rk_experts=lay.num_experts, K_PAD=next_power_of_2(K)))


_BLOCK = launch.LaunchCache(_route_tokens_block_kernel)
_FIXUP = launch.LaunchCache(_route_tokens_fixup_kernel)
_FIXUP_KEYS: set = set()  # keys whose launch has the second kernel
_HIST: dict = {}

__all__ = ["route_tokens", "validate_indices", "RankRoutes", "SINGLE_PROGRAM_MAX_ROUTES"]
