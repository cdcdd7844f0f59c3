"""Shrink mode: the peers a rank has given up on (`RankMask`), and how a wait stops waiting for them.

A rank that stops calling (its process killed, or its code gone elsewhere) makes every wait on it time
out. Without a mask that timeout is an error; with one (`AllToAll(rank_mask=...)`) the waiting rank
*masks* the late peer instead and the call goes on without it: its tokens are dropped, no route is sent to
its experts, and no later wait includes it (docs/protocol.md, section 6, shrink mode). Each rank decides alone, as
DeepEP's shrink mode does; the survivors of a stopped rank all time out on it, so they agree.

Why masking needs no agreement on offsets: a masked source's count row is zero here, and the only
cross-rank offsets of the protocol, the remote remainder region's, are not used in shrink mode (its
private region takes every route of a pair: `A2AConfig.max_private_tokens = max_routes`).

How a wait skips a peer: the waiting host *forges* the peer's words in its own sync area (a peer's ready
words there have one writer, the peer, which has stopped): `dispatch_ready` and `combine_ready` become
`FORGED_EPOCH`, above any epoch, and its count row becomes zero. Every wait then passes for it, the
kernels' own waits included, and the unpack takes no row from it; nothing in a kernel changes.

With kernel waits (every rank on one node; CUDA-graph safe) the GPU decides instead, as DeepEP's kernels
do: the mask lives in device memory (`RankMask.tensor`), each consumer half's separate wait
(`triton_kernels.node_sync.launch_wait_apart`) skips masked node peers and masks those still late at its
deadline (`timeout_s`), and the dispatch wait zeroes masked peers' count rows in this rank's sync area
before the unpack reads them; the combine drops the route slots of masked ranks after its wait, by a
device operation. Nothing is forged by the host.
"""
from __future__ import annotations

import logging

import torch

# Above every epoch a call can reach (epochs count calls from 1): a forged ready word always passes.
FORGED_EPOCH = 1 << 62

log = logging.getLogger("moe_a2a")


class RankMask:
    """Which ranks this rank has masked, shared by the `AllToAll` instances of one user (the DeepEP
    facade's two alternating ones), so that a peer masked in one is skipped by the others at once.

    Who decides: the host's waits (host waits: `Forger`), or the kernels' own waits (kernel waits, every
    rank on one node: `decided_on_device`), which mask a late peer in `tensor` at their deadline, so a
    CUDA graph replay masks and skips as an eager call does; routes and slots are then dropped by device
    operations on every call (no host decision in the stream).

    Attributes:
        masked: the masked ranks (read from `tensor` when the device decides: a sync).
        tensor: `[W]` int32 on the device, 1 = masked (DeepEP's mask buffer), kept equal to `masked`.
    """

    def __init__(self, world_size: int, rank: int, device) -> None:
        self.world_size, self.rank = world_size, rank
        self.tensor = torch.zeros(world_size, dtype=torch.int32, device=device)
        self._masked: set[int] = set()
        self.on_device = False

    def decided_on_device(self) -> None:
        """The kernels' waits mask peers in `tensor` from now on (`AllToAll` with kernel waits)."""
        self.on_device = True

    @property
    def masked(self) -> set[int]:
        if self.on_device:
            return set(int(r) for r in torch.nonzero(self.tensor).flatten().tolist())
        return self._masked

    def mask(self, ranks, why: str) -> None:
        """Mask `ranks` (never this rank itself), saying why once in the log."""
        new = sorted(set(int(r) for r in ranks) - self.masked - {self.rank})
        for r in new:
            self._masked.add(r)
            self.tensor[r] = 1
        if new:
            log.warning("rank %d: masked rank(s) %s: %s; later calls go on without them", self.rank, new, why)

    def set(self, rank: int, masked: bool) -> None:
        """DeepEP's `low_latency_update_mask_buffer`: mask (True) or unmask (False) one rank."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank_to_mask: expected a rank in [0, {self.world_size}), got {rank!r}")
        if masked:
            if rank == self.rank:
                raise ValueError(f"rank_to_mask: rank {rank} is this rank, which cannot mask itself")
            self.mask([rank], "masked by the caller")
        elif rank in self.masked:
            self._masked.discard(rank)
            self.tensor[rank] = 0

    def clear(self) -> None:
        """DeepEP's `low_latency_clean_mask_buffer`: unmask every rank."""
        self._masked.clear()
        self.tensor.zero_()

    def drop_routes(self, indices: torch.Tensor, num_local_experts: int) -> torch.Tensor:
        """`indices` with the routes to masked ranks' experts set to -1 (a new tensor; the caller's is
        left as it is), or `indices` itself when nothing is masked (the host decides and masked none)."""
        if not self.on_device and not self._masked:
            return indices
        owner = torch.where(indices >= 0, indices // num_local_experts, 0)
        return torch.where((indices >= 0) & (self.tensor[owner] != 0), torch.full_like(indices, -1), indices)

    def drop_route_slots(self, route_slot: torch.Tensor, indices: torch.Tensor, num_local_experts: int) -> None:
        """In place: the route slots (`[T, K]`, -1 = no route) of routes to masked ranks' experts become -1,
        so the reduce skips the expert outputs that a rank masked during this call never sent."""
        if not self.on_device and not self._masked:
            return
        owner = torch.where(indices >= 0, indices // num_local_experts, 0)
        route_slot.masked_fill_((indices >= 0) & (self.tensor[owner] != 0), -1)


class Forger:
    """Keeps one rank's view of the masked peers in force (`w`: the rank's `Wiring`), before and after
    each host wait:
    - node peers: their words in this rank's sync area forged (ready words `FORGED_EPOCH`, count row 0);
      an unmasked one's ready words reset to 0 (its next word is awaited again);
    - remote peers: the mask words of the segment tell the proxies whom to skip (they add the peers they
      time out on, taken into the `RankMask` here), and a masked peer's count row in its private slot's
      header is zeroed (the plan kernel copies it from there every call).
    """

    def __init__(self, mask: RankMask, w) -> None:
        self.mask, self.w = mask, w
        lay = w.layout
        self.node = range(w.node.node_first, w.node.node_first + w.node.node_size)
        self.remote = lay.remote_peers(w.rank) if w.with_proxy else []
        # The proxy also waits for node peers' count rows, and masks those it times out on.
        self.proxy_peers = [p for p in range(lay.world_size) if p != w.rank] if w.with_proxy else []
        self.header = {p: w.stage_recv_offset_bytes + lay.private_header_offset_bytes(p) for p in self.remote}
        self.row_bytes = lay.routing_row_bytes
        self.forged: set[int] = set()

    def apply(self) -> None:
        w, mask = self.w, self.mask
        if self.proxy_peers:
            words = w.peer_mask_np
            taken = [p for p in self.proxy_peers if words[p] and p not in mask.masked]
            if taken:
                mask.mask(taken, "this rank's proxy timed out on them")
        masked = mask.masked
        for p in self.node:
            if p in masked:  # every time: a masked peer that is still alive may have written since
                for words in w.ready_words.values():
                    words[p] = FORGED_EPOCH
                w.counts_np[p] = 0
            elif p in self.forged:
                for words in w.ready_words.values():
                    words[p] = 0
        for p in self.proxy_peers:
            if p in masked:
                if p not in self.forged:
                    w.peer_mask_np[p] = 1
                    if p in self.header:
                        at = self.header[p]
                        w.base[at: at + self.row_bytes].zero_()  # stream-ordered before the plan kernel
            elif p in self.forged:
                w.peer_mask_np[p] = 0
        self.forged = set(masked)


__all__ = ["FORGED_EPOCH", "RankMask", "Forger"]
