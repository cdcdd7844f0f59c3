"""Synchronisation inside the data kernels: with same-node peers always, with the proxy for remote ones.

Ranks of one node reach each other's memory through mappings (CUDA IPC or registered shared memory on
a GPU, shared memory on CPU). Each rank has a *sync area* (`Layout.*_offset_bytes`, docs/protocol.md):

    dispatch_ready [W] int64     word s: last epoch whose count row and dispatch rows node peer s published
    combine_ready  [W] int64     word s: last epoch whose expert outputs node peer s pushed into this rank
    counts         [W, E] int32  row s: source s's per-expert counts (this rank's own row: route kernel;
                                 a node peer's: its pack epilogue; a remote peer's: its proxy)

It is at the end of the recv buffer when every rank is on one node and waits in kernels
(`AllToAll.device_sync`: device memory), else in the shared segment, where its count rows are the
routing area the proxy writes into and the host and the proxy can read it. Every word and row has one
writer; epochs only grow and a wait passes at `>= e`, so nothing is cleared.

Producers (dispatch pack, combine pack) end with an *epilogue*: every program fences (`fence.acq_rel.sys`)
and arrives on a counter (`node_arrive`); the last one copies the count row to the node peers (dispatch
only, `node_copy_count_row`), then release-stores the epoch into its word of every node rank's area and,
with remote peers, into the proxy's flag (SEND_READY / COMBINE_SEND_READY, `node_publish`). Consumers
(unpack, reduce) start with a *prologue* (`node_wait`): spin with system-scope acquire loads until every
node rank's word reaches the epoch and, with remote peers, the proxy's flag does (DISPATCH_RECV_READY /
COMBINE_RECV_READY). With remote peers the producers' prologues also wait until the proxy's writes out of
their region for the previous call completed (DISPATCH/COMBINE_WRITES_DONE >= e-1); `HALF_FLAGS` lists
each half's flags. No barrier: why each reuse of a region is safe is in docs/protocol.md, section 4.
With only remote rows staged (`"staged"`) and remote peers, the dispatch pack has two halves of programs,
each arriving on its own counter word (`node_arrive_of`): the remote half's last program raises SEND_READY
only, the node half's last program copies the count row and publishes to the node (docs/protocol.md, 3.6).

Failure: a wait that times out (`%globaltimer`, `timeout_s`), or sees the proxy's ERROR flag, stores
which node ranks (and whether the proxy) were late in its `Flag.STATUS_*` word
(`protocol.words.encode_wait_status`) and sets a sticky device word; every later synchronised kernel of the rank then
moves nothing and publishes nothing, so peers time out too instead of computing on stale data. The host
raises a TimeoutError naming them at its next call (`protocol.words.decode_wait_status`); no sync.

Host waits (CPU; GPU ranks sharing a GPU): the host polls the same words and flags before each launch,
so the kernel's own wait passes at its first poll. Under `TRITON_INTERPRET=1` loads and stores are plain
(x86 keeps stores in order), fences are skipped and a spin is capped by a count, not a clock.

The prologue and epilogue are `@triton.jit` helpers of `_details.py` (`node_wait`, `node_arrive`,
`node_copy_count_row`, `node_publish`); this module holds what a launcher needs: `NodeSync` (the
arguments) and the launcher of the separate wait (`launch_wait_apart`; its kernel is in `_node_sync_kernels.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import next_power_of_2
from ..protocol.words import HALF_FLAGS, Flag, flag_word
from . import _launch as launch
from ._node_sync_kernels import _wait_apart_kernel

# Polls of a prologue spin under the interpreter (it has no clock; the host already waited).
INTERPRETER_MAX_SPINS = 1 << 16
# Between two polls of host memory by the separate wait: a flag hand-off through the proxy takes a few
# µs and each poll is a PCIe read of ~1 µs, so a short sleep costs nothing and frees the bus.
WAIT_APART_BACKOFF_NS = 200


@dataclass(frozen=True, eq=False)  # identity: it is a key of remembered launches, and holds tensors
class NodeSync:
    """What the kernels of one rank need to synchronise with its same-node peers and its proxy.

    Attributes:
        epoch: `[1]` int64 on the device, this call's epoch (advanced on the stream by `route_tokens`,
            so a CUDA graph replay publishes and awaits the replay's epoch).
        failed: `[1]` int64 on the device, sticky: nonzero after any failed wait of this rank.
        counter: `[2]` int32 on the device, zero between launches: programs arrived in an epilogue (the
            second word: the node half of a pack that packs remote rows first, `dispatch.py`).
        flags: `[N]` int64, this rank's flags area (`protocol.words.Flag`) as the kernels reach it (pinned host
            memory seen through UVA on a GPU): the proxy flags and the status words of failed waits.
        peer_sync_bytes: `[W]` int64, each same-node rank's sync area as an offset from `base` (-1 for
            other ranks); `sync_bytes`: this rank's.
        rank, node_first, node_size: this rank and its node's ranks `[node_first, node_first + node_size)`.
        dispatch_ready_bytes, combine_ready_bytes, counts_bytes: offsets of the area's parts in a sync area.
        num_experts: ints per count row (`Layout.count_row_ints`: E, + W with per-rank rows).
        timeout_s: how long a prologue spins before giving up (GPU).
        with_proxy: remote peers exist: the kernels also wait for / raise the proxy's flags.
        kernel_waits: False when the host polls every word before it launches a kernel (CPU, or ranks
            sharing one GPU, which must not spin in a kernel): the prologues then only check `failed`.
        wait_apart: the words live in pinned host memory (with remote peers, or host-staged buffers),
            or ranks share a GPU (MPS): one single-warp kernel (`launch_wait_apart`) spins before each
            data kernel, whose prologue then only checks `failed`: every program of a data kernel polling
            host memory would keep hundreds of PCIe reads in flight and slow everything else on the bus
            (docs/perf-notes.md); under MPS a waiting grid of one program per SM can hold every SM while
            the peer's producer waits for one (MPS does not preempt).
        interpreter_spins: how many polls before giving up under the interpreter (no clock there).
        aborted: `[1]` int64 on the device, the last epoch this rank aborts at its combine (bad combine
            input: the host; an expert over capacity: the unpack kernel), or None (not told: tests);
            `combine_aborted_bytes`: where node peers' aborts are in a sync area.
        rank_mask: shrink mode with kernel waits (`runtime.shrink`): `[W]` int32 on the device, 1 = masked.
            The consumers' separate waits (`wait_apart` must be set) skip masked node peers, mask those
            still late at `timeout_s`, and zero masked peers' count rows before the unpack reads them.
    """

    epoch: torch.Tensor
    failed: torch.Tensor
    counter: torch.Tensor
    flags: torch.Tensor
    peer_sync_bytes: torch.Tensor
    sync_bytes: int
    rank: int
    node_first: int
    node_size: int
    dispatch_ready_bytes: int
    combine_ready_bytes: int
    counts_bytes: int
    num_experts: int
    timeout_s: float
    with_proxy: bool = False
    kernel_waits: bool = True
    wait_apart: bool = False
    interpreter_spins: int = INTERPRETER_MAX_SPINS
    aborted: torch.Tensor | None = None
    combine_aborted_bytes: int = 0
    rank_mask: torch.Tensor | None = None

    def kernel_args(self, half: str, device: torch.device) -> dict:
        """Keyword arguments of the synchronising prologue/epilogue of one half's kernel."""
        on_gpu = device.type == "cuda"
        wait_flag, delta, signal_flag, status, _ = HALF_FLAGS[half]
        ready = self.dispatch_ready_bytes if half.startswith("dispatch") else self.combine_ready_bytes
        args = dict(failed_ptr=self.failed, epoch_ptr=self.epoch, flags_ptr=self.flags,
                    peer_sync_bytes_ptr=self.peer_sync_bytes, sync_bytes=self.sync_bytes, node_first=self.node_first,
                    READY_BYTES=ready, NODE=self.node_size, NODE_SYNC=True, HAS_PROXY=self.with_proxy,
                    USE_PTX=on_gpu, STATUS_WORD=flag_word(status), PROXY_WAIT_WORD=flag_word(wait_flag),
                    PROXY_DELTA=delta, ERROR_WORD=flag_word(Flag.ERROR),
                    KERNEL_WAIT=self.kernel_waits and not self.wait_apart,
                    timeout_ns=int(self.timeout_s * 1e9) if on_gpu else 0,
                    max_spins=0 if on_gpu else self.interpreter_spins)
        if signal_flag is not None:
            args.update(counter_ptr=self.counter, PROXY_SIGNAL_WORD=flag_word(signal_flag))
        if half == "dispatch_send":
            args.update(rank=self.rank, COUNTS_BYTES=self.counts_bytes, E=self.num_experts, E_PAD=next_power_of_2(self.num_experts))
        if half in ("dispatch_recv", "combine_recv", "combine_relay"):
            args.update(NODE_PAD=next_power_of_2(self.node_size))
        if self.aborted is not None:  # aborts at combine: raised by unpack, told by pack, read by reduce
            if half == "dispatch_recv":
                args.update(aborted_ptr=self.aborted, CALL_ABORTED_WORD=flag_word(Flag.CALL_ABORTED),
                            ABORT_AT_COMBINE=True)
            elif half == "combine_send":
                args.update(aborted_ptr=self.aborted, ABORT_BYTES=self.combine_aborted_bytes)
            elif half == "combine_relay":  # the relay forwards a node peer's abort to its homes
                args.update(ABORT_BYTES=self.combine_aborted_bytes, CALL_ABORTED_WORD=flag_word(Flag.CALL_ABORTED))
            elif half == "combine_recv":
                args.update(rank=self.rank, ABORT_BYTES=self.combine_aborted_bytes,
                            ABORTED_WORD=flag_word(Flag.ABORTED))
        return args


def launch_wait_apart(node: NodeSync | None, half: str, base: torch.Tensor) -> None:
    """Launch the separate wait of `half` when `node.wait_apart` (else nothing): consumers wait for their
    node peers' words and the proxy's flag; producers, with remote peers, for the proxy's previous writes."""
    if node is None or not node.wait_apart:
        return
    consumer = half.endswith(("recv", "relay"))  # the relay's reduce consumes its node peers' partials
    if not consumer and not node.with_proxy:
        return
    key = (node, half, base.data_ptr())
    if _WAIT_APART.hit(key):
        return
    a = node.kernel_args(half, base.device)
    shrink = consumer and node.rank_mask is not None
    _WAIT_APART.launch(
        key, (1,), base, a["failed_ptr"], a["epoch_ptr"], a["flags_ptr"], node.sync_bytes if consumer else 0,
        node.node_first if consumer else 0, a["timeout_ns"], a["max_spins"],
        READY_BYTES=a["READY_BYTES"] if consumer else 0, NODE=node.node_size if consumer else 0,
        NODE_PAD=next_power_of_2(node.node_size) if consumer else 1, HAS_PROXY=node.with_proxy,
        PROXY_WAIT_WORD=a["PROXY_WAIT_WORD"], PROXY_DELTA=a["PROXY_DELTA"], ERROR_WORD=a["ERROR_WORD"],
        STATUS_WORD=a["STATUS_WORD"], USE_PTX=a["USE_PTX"], BACKOFF_NS=WAIT_APART_BACKOFF_NS,
        mask_ptr=node.rank_mask if shrink else node.failed,
        counts_bytes=node.sync_bytes + node.counts_bytes if shrink and half == "dispatch_recv" else 0,
        E=node.num_experts if shrink else 1, E_PAD=next_power_of_2(node.num_experts) if shrink else 1,
        SHRINK=shrink, num_warps=1)


_WAIT_APART = launch.LaunchCache(_wait_apart_kernel)

__all__ = ["NodeSync", "launch_wait_apart"]
