"""Write planning: the kernels turn count rows into the proxy's write tables.

The proxy posts one RDMA write per remote peer and phase; *where* each write goes is the protocol's
arithmetic on the exchanged count rows (`protocol/plan.py`, the readable reference). Done in Python in
the proxy it cost 155 µs per call at 64 ranks (numpy), more than the wire. So the GPU, which holds the
counts anyway, writes each write's descriptor into the rank's shared segment (`protocol.words.WriteTable`:
per peer `(src_offset_bytes, length_bytes, dst_offset_bytes, imm)`, int64) and the proxy only reads
and posts (docs/protocol.md, "Write tables"). Two one-program kernels, launched only with remote peers:

- `plan_private_writes`, between the route and pack kernels of the dispatch send half: from this
  rank's own count row, the private write to every remote peer (count row + first min(n, P) routes into
  this rank's private slot there, read as one range from the peer's slot of the send buffer's private
  staging region, whose header it fills with the count row); its immediate says whether a remainder
  write follows (`Imm.DISPATCH_MORE`), so no receiver computes that from the counts.
- `plan_remainder_and_combine_writes`, at the head of the dispatch recv half: it waits for
  `Flag.COUNT_ROWS_READY` (every private write has landed, the node peers' rows are in), copies the
  remote count rows from the private slots' headers into the routing area, checks every row, writes the
  remainder writes (pairs with more than P routes) and the combine writes, then raises
  `Flag.REMAINDER_PLANNED`.

Both read each count at most once (W*E int32: 64 KB at W=64, E=256) and write 3*W*4 int64 (times
`Layout.wire_pieces`: under the relay with k proxies a rank, each write as k pieces, one per proxy).
The rows equal `plan.private_writes / remainder_writes / combine_writes` for every remote peer
(tests/triton_kernels/test_write_plan.py); rows of same-node peers and of this rank are zero.
"""
from __future__ import annotations

import torch

from ..config import Layout, next_power_of_2
from ..protocol.words import HALF_FLAGS, WRITE_TABLE_COLUMNS, Flag, WriteTable, flag_word
from . import _checks as check
from . import _launch as launch
from .node_sync import WAIT_APART_BACKOFF_NS, NodeSync
from ._write_plan_kernels import _plan_private_writes_kernel, _plan_remainder_and_combine_writes_kernel

# Count rows per step of the plan kernel's pass (a [BLOCK_S, W, L] tile: 4096 counts at E=256).
BLOCK_S = 16


def _check(counts: torch.Tensor, write_tables: torch.Tensor, lay: Layout) -> None:
    check.tensor("counts", counts, dtypes=(torch.int32,), shape=(lay.world_size, lay.num_experts))
    check.tensor("write_tables", write_tables, dtypes=(torch.int64,),
                 shape=(int(WriteTable.NUM_TABLES), lay.wire_pieces, lay.world_size, WRITE_TABLE_COLUMNS),
                 strides="contiguous")


def plan_private_writes(counts: torch.Tensor, write_tables: torch.Tensor, epoch: torch.Tensor,
                        flags: torch.Tensor, rank: int, lay: Layout, base: torch.Tensor | None = None,
                        send_bytes: int = 0) -> None:
    """Write the PRIVATE table of `write_tables` from `counts[rank]` (final: after `route_tokens`),
    `flags[Flag.REMAINDER_WRITES]` and, with `base`, the count row at the head of every remote peer's slot
    of the send buffer's private staging region (the first bytes each private write sends).

    Args:
        counts: `[W, E]` int32, this rank's routing area (row `rank` is read).
        write_tables: `[WriteTable.NUM_TABLES, lay.wire_pieces, W, 4]` int64, the segment's write tables (host
            memory seen by the device on a GPU): with several pieces, piece j of each write in `[:, j]`
            (`plan.split_writes`), its immediate saying "more" only when piece j of the remainder is not empty.
        epoch: `[1]` int64 on the device: this call's epoch (the immediates carry it).
        flags: this rank's flags area (`protocol.words.Flag`), int64.
        base, send_bytes: 1-D uint8 tensor and the offset in it of the send buffer the proxy posts from (the
            staging one where rows to other nodes are staged). None: the tables only (tests, benchmarks).
    Asynchronous on a GPU and safe in a CUDA graph; one program. Its headers are written before the pack's
    wait for the proxy's previous writes, and safely so: those completed before the proxy raised
    COMBINE_RECV_READY, which the previous call's combine waited for (stream order)."""
    key = (launch.tensor_key(counts), launch.tensor_key(write_tables), launch.tensor_key(epoch),
           launch.tensor_key(flags), rank, lay, None if base is None else base.data_ptr(), send_bytes)
    if _PRIVATE.hit(key):
        return
    _check(counts, write_tables, lay)
    W, L, E = lay.world_size, lay.num_local_experts, lay.count_row_ints  # the whole count row travels
    if base is not None:
        check.tensor("base", base, dtypes=(torch.uint8,), shape=(None,), device=counts.device, host_ok=True)
        check.integer("send_bytes", send_bytes, 0)
    e_pad = next_power_of_2(E)
    _PRIVATE.launch(
        key, (1,), counts, epoch, counts.stride(0), rank, lay.node_of(rank) * lay.node_size,
        lay.private_header_offset_bytes(rank), write_tables[int(WriteTable.PRIVATE)],
        flags[flag_word(Flag.REMAINDER_WRITES):], counts if base is None else base, send_bytes,
        NODE=lay.node_size, P=lay.private_rows, STRIDE_BYTES=lay.dispatch_stride_bytes,
        W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L),
        STAGE_HEADER_BYTES=lay.private_stage_header_offset_bytes(0), SLOT_BYTES=lay.private_slot_bytes,
        E=E, E_PAD=e_pad, BLOCK_P=max(1, min(next_power_of_2(max(W - lay.node_size, 1)), 4096 // e_pad)),
        HEADERS=base is not None, RANK_ROWS=lay.rank_rows, RELAY=lay.relay, PIECES=lay.wire_pieces, num_warps=4)


def plan_remainder_and_combine_writes(counts: torch.Tensor, write_tables: torch.Tensor, node: NodeSync,
                                      base: torch.Tensor, recv_bytes: int, rank: int, lay: Layout,
                                      combine_rank: bool = False, relay_recv_bytes: torch.Tensor | None = None) -> None:
    """Wait (on the device, unless the host waited: `node.kernel_waits`) until `Flag.COUNT_ROWS_READY`
    reaches this call's epoch; copy the remote sources' count rows from their private-slot headers (in the
    recv buffer at `base[recv_bytes:]`) into `counts`; check every row; write the REMAINDER and COMBINE
    tables of `write_tables`; raise `Flag.REMAINDER_PLANNED` (release). A failed wait records its status
    word and the sticky `node.failed` (as every synchronised kernel) and plans nothing; so does a corrupt
    count row (`Flag.BAD_COUNTS`: the host raises at its next call).

    Args:
        counts: `[W, E]` int32, this rank's routing area: its own and its node peers' rows are final. With
            per-rank rows (`lay.rank_rows`) each row runs on with its W rows per rank (same row stride): they
            are copied and checked too, and the remainder writes count them.
        combine_rank: the combine sends one row per (token, rank) back (`A2AConfig.combine_rows="rank"`):
            the combine writes count rows per rank, not routes.
        write_tables: `[WriteTable.NUM_TABLES, lay.wire_pieces, W, 4]` int64 (each write in pieces, as above).
        base: 1-D uint8 tensor: the byte address space the recv buffer is in (`recv_bytes` from its start).
        relay_recv_bytes: with the relay (`lay.relay`, required then): `[node_size]` int64 on the counts' device,
            where each rank of this node (by local index) receives the network's rows, from `base`: a remote
            source's count row is read from its relay's private slot (`Layout.private_header_offset_bytes`),
            the remainder writes land after other nodes' sources only, and only rail peers get rows.
    Asynchronous on a GPU and safe in a CUDA graph; one program."""
    key = (launch.tensor_key(counts), launch.tensor_key(write_tables), node, base.data_ptr(), recv_bytes, rank, lay,
           combine_rank, launch.tensor_key(relay_recv_bytes))
    if _REST.hit(key):
        return
    _check(counts, write_tables, lay)
    relay = {}
    if lay.relay:
        check.tensor("relay_recv_bytes", relay_recv_bytes, dtypes=(torch.int64,), shape=(lay.node_size,),
                     device=counts.device)
        relay = dict(relay_recv_ptr=relay_recv_bytes, HEADER0_BYTES=lay.private_header_offset_bytes(0), RELAY=True)
    on_gpu = counts.device.type == "cuda"
    wait, _, signal, status, _ = HALF_FLAGS["dispatch_plan"]
    W, L = lay.world_size, lay.num_local_experts
    _REST.launch(
        key, (1,), counts, base, node.epoch, node.failed, node.flags, counts.stride(0),
        recv_bytes + lay.private_header_offset_bytes(0), rank, lay.node_of(rank) * lay.node_size,
        int(node.timeout_s * 1e9) if on_gpu else 0, 0 if on_gpu else node.interpreter_spins,
        write_tables[int(WriteTable.REMAINDER)], write_tables[int(WriteTable.COMBINE)],
        NODE=lay.node_size, P=lay.private_rows, PRIVATE_SLOT_ROWS=lay.private_slot_rows,
        SLOT_WORDS=lay.private_slot_bytes // 4,
        DISPATCH_STRIDE_BYTES=lay.dispatch_stride_bytes, COMBINE_STRIDE_BYTES=lay.combine_stride_bytes,
        COMBINE_STAGE_BYTES=lay.combine_stage_offset_bytes, COMBINE_RECV_BYTES=lay.combine_recv_offset_bytes,
        W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L), BLOCK_S=BLOCK_S, MAX_ROUTES=lay.max_routes,
        PROXY_WAIT_WORD=flag_word(wait), SIGNAL_WORD=flag_word(signal), ERROR_WORD=flag_word(Flag.ERROR),
        STATUS_WORD=flag_word(status), BAD_COUNTS_WORD=flag_word(Flag.BAD_COUNTS),
        SPIN=node.kernel_waits, USE_PTX=on_gpu, BACKOFF_NS=WAIT_APART_BACKOFF_NS,
        RANK_ROWS=lay.rank_rows, COMBINE_RANK=combine_rank, MAX_RANK_ROWS=lay.send_rows, PIECES=lay.wire_pieces,
        **relay, num_warps=4)  # more loads in flight: the count rows are read over PCIe from host memory


_PRIVATE = launch.LaunchCache(_plan_private_writes_kernel)
_REST = launch.LaunchCache(_plan_remainder_and_combine_writes_kernel)

__all__ = ["plan_private_writes", "plan_remainder_and_combine_writes"]
