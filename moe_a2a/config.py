"""Every size and offset of moe_a2a, in one place.

`A2AConfig` is what a user writes (docs/design.md, API); `A2AConfig.layout(world_size)` gives a
`Layout`, the derived sizes that depend on the number of ranks: local experts, private region,
worst-case receive rows and the byte offsets of everything in a rank's shared segment.

Units: names ending in `_bytes` are bytes; `*_rows` count token slots; everything else is elements.

Buffers of one rank (slots are rows of `dispatch_stride_bytes` or `combine_stride_bytes`):

    send buffer  dispatch: [S rows]    this rank's routes, expert-major (so each peer's run is contiguous)
                           [(W-N)*(h+P) rows] private staging (N = node_size, h = header_rows): per remote
                           peer its count row then its first min(n, P) routes, sent as one range
                 combine:  [W*C rows]  expert outputs staged per (remote) source rank, source-major
                 relay:    [(W-N)*T rows of round_up(4H, 16) bytes] fp32 partials for the node's relays
                           (`Layout.relay` only)
    recv buffer  dispatch: [W*P rows]  private region, slot s*P.. for source s
                           [W*S rows]  remainder region, source s at W*P + sum_{s'<s} max(0, n_s' - P)
                 combine:  [C rows]    expert outputs of this rank's routes, at their dispatch send slot
                 sync area (used when all ranks share one node and wait on the GPU; else in the segment)

The combine staging, private and remainder regions serve remote peers only: on one node they take no bytes.
S = `Layout.send_rows`: T*K routes, or T*min(K, W) with one row per (token, rank) (`dispatch_rows="rank"`);
C = `Layout.combine_rows`: T*K, or T*min(K, W) with rows reduced at the experts' rank (`combine_rows="rank"`).
The dispatch and combine regions never overlap, so no phase waits for every peer to finish the
previous one (docs/protocol.md). The worst case "every route of every rank lands on one rank" fits:
W*T*K expert rows (duplicates included) in the dispatch output.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING

from .protocol.words import (ERROR_MESSAGE_BYTES, FLAG_SLOT_BYTES, IMM_RANK_BITS, MAX_PROXY_SHARDS, MODEL_TRACE_EVENTS,
                             TRACE_EVENTS, WRITE_TABLE_COLUMNS, Flag, ShardWord, WriteTable)

if TYPE_CHECKING:  # torch is imported lazily (see _dtypes)
    import torch

PAGE_BYTES = 4096
ROW_ALIGN_BYTES = 16  # rows start on 16-byte boundaries so kernels can use 16-byte accesses
COMBINE_FP8_BLOCK = 128  # elements per fp32 scale of an fp8 combine row (A2AConfig.combine_fp8)



def _dtypes():
    """(fp8, payload, out) dtypes. torch is imported here, not at module import, so the proxy
    process (which only needs `Layout`) starts without it."""
    import torch

    fp8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
    return fp8, fp8 + (torch.bfloat16, torch.float16, torch.float32), (torch.bfloat16, torch.float16, torch.float32)


def _cached_hash(self) -> int:
    """The hash of a frozen config, computed once: configs key every remembered kernel launch, on every
    call, and hashing a tuple of a dozen fields costs ~1 µs. Equal configs hash alike (the compared
    fields, as dataclass's own hash)."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))
        self.__dict__["_hash"] = h  # not through the frozen __setattr__
    return h


def _state_without_hash(self) -> dict:
    """Pickled state without the cached hash: a str field hashes differently in another process."""
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1). Plain Python: launchers call it on every launch,
    and triton.next_power_of_2 / triton.cdiv cost ~5 µs each as ConstexprFunctions (triton 3.9)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()



# Upper bounds of A2AConfig's sizes: far above any model (DeepSeek-V3: H=7168, E=256, K=8), low enough
# that a typo (an extra zero or three) is refused at once with a message rather than as an allocation
# failure on some rank. Experts may repeat within a token's top-k, so K may exceed E; K <= 1024 still.
# Whether the buffers fit a machine is checked where they are allocated
# (`moe_a2a.protocol.memory.check_fits_in_memory`), not here: configs may be built on another machine.
MAX_CONFIG_VALUES = {"max_num_tokens": 1 << 20, "num_experts": 1 << 16, "experts_per_token": 1024,
                     "hidden_dim": 1 << 20, "expert_padding": 1 << 20}


@dataclass(frozen=True)
class A2AConfig:
    """Sizes of one expert-parallel all-to-all (docs/design.md, API).

    Args:
        max_num_tokens: upper bound on tokens per rank per call (T).
        num_experts: total experts over all ranks (E).
        experts_per_token: top-k (K).
        hidden_dim: elements per token (H).
        in_dtype: dispatch payload dtype (fp8 e4m3/e5m2, bf16, fp16 or fp32).
        scale_block: elements per fp32 scale; "auto" means 128 for fp8 payloads and None otherwise.
        out_dtype: combine payload dtype (bf16, fp16 or fp32).
        expert_padding: each expert's segment of the dispatch output is padded to this many rows.
        max_private_tokens: per-sender private region of each receiver in rows; None picks twice the
            average rows a sender sends to one rank (see `Layout`), 0 disables it.
        expert_capacity: None (default): the dispatch output is compact, expert l's rows start at
            `sum_{j<l} round_up(n_j, expert_padding)`. An int C: every local expert has C rows, expert
            l's start at `l * C`, so the output can be viewed as `[L, C, H]` without a copy (the layout
            DeepEP's low-latency kernels and vLLM's batched experts take). An expert that receives more
            than C rows is an error (reported at the next call; the rows past C are not written).
            Needs expert_padding == 1.
        payload_bytes: None (default): each dispatched token carries its `hidden_dim * in_dtype` bytes.
            An int (a multiple of 4, at most that): the bytes each dispatched row carries instead, for an
            instance whose every dispatch quantises in the pack (`AllToAll.dispatch(quantize=)`): its
            fp8 bytes and scales, about half a bf16 row, so rows are packed, sent and unpacked at half
            the stride. A dispatch without `quantize` is refused by such an instance.
        dispatch_rows: "route" (default): one dispatch row per live route (token, k). "rank": one row per
            (token, destination rank), carrying after its scales the token's K (local expert, position)
            pairs for that rank (`rank_meta_offset_bytes`); the receiver expands it into the slot of every
            local expert it was routed to, so the dispatch output is the same (`reference.dispatch_per_rank`).
            Not with shrink mode (`AllToAll(rank_mask=)`), for now.
        combine_rows: "route" (default): one expert-output row per route, summed at the token's home rank
            (`reference.combine`). "rank" (needs dispatch_rows="rank"): the expert's rank sums, in fp32 in k
            order, the weighted outputs of its experts for each token and sends one row per (token, rank);
            the home rank sums over ranks (`reference.combine_reduced_at_sender`). The weights travel with
            the dispatch (`AllToAll.dispatch(weights=)`).
        combine_fp8: False (default): combine rows (expert outputs going home) travel as `out_dtype`.
            True: the combine pack quantises every expert output row to fp8 e4m3 with one fp32 scale per
            COMBINE_FP8_BLOCK (128) elements, and the reduce dequantises it before the weighted sum
            (`reference.combine_fp8`, bitwise on CPU; its error: docs/accuracy.md). A combine slot then
            holds the fp8 bytes at [0, H) and the scales at `combine_scale_offset_bytes`, and
            `combine_stride_bytes` is `round_up(H, 16) + round_up(4 * ceil(H / 128), 16)`: about half a
            bf16 row on every path (node-local pushes, the proxy's writes, the emulated NIC). `expert_y`
            and the combined tokens stay `out_dtype`.
        relay: False (default): a token's rows go to each rank its experts are on, across nodes too. True
            (needs dispatch_rows="rank" and combine_rows="rank"): a token crosses the network once per
            destination node, to the rank with the sender's local index there (its relay: one rail), whose node
            peers read it over their mapped memory; the combine is reduced inside the experts' node (fp32
            partials summed by the relay in rank order) and one row per (token, node) goes home
            (`reference.dispatch_relay`, `combine_relay`; docs/protocol.md, 3.8). On one node it changes nothing.
    """

    __hash__, __getstate__ = _cached_hash, _state_without_hash

    max_num_tokens: int = 128
    num_experts: int = 256
    experts_per_token: int = 8
    hidden_dim: int = 7168
    in_dtype: "torch.dtype" = None  # type: ignore[assignment]  # default bf16
    scale_block: int | None | str = "auto"
    out_dtype: "torch.dtype" = None  # type: ignore[assignment]  # default bf16
    expert_padding: int = 1
    max_private_tokens: int | None = None
    expert_capacity: int | None = None
    payload_bytes: int | None = None
    dispatch_rows: str = "route"
    combine_rows: str = "route"
    combine_fp8: bool = False
    relay: bool = False
    _scale_block: int | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        import torch

        fp8_dtypes, payload_dtypes, out_dtypes = _dtypes()
        for name in ("in_dtype", "out_dtype"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, torch.bfloat16)
        for name in ("max_num_tokens", "num_experts", "experts_per_token", "hidden_dim", "expert_padding"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"A2AConfig.{name} must be a positive int, got {value!r}")
            if value > MAX_CONFIG_VALUES[name]:
                raise ValueError(f"A2AConfig.{name} must be <= {MAX_CONFIG_VALUES[name]:,}, got {value:,} "
                                 f"(bounds in moe_a2a.config.MAX_CONFIG_VALUES; whether the buffers fit a "
                                 f"machine is checked where they are allocated)")
        if self.in_dtype not in payload_dtypes:
            raise ValueError(
                f"A2AConfig.in_dtype must be one of {[str(d) for d in payload_dtypes]}, got {self.in_dtype!r}"
            )
        if self.out_dtype not in out_dtypes:
            raise ValueError(
                f"A2AConfig.out_dtype must be one of {[str(d) for d in out_dtypes]}, got {self.out_dtype!r}"
            )
        scale_block = self.scale_block
        if scale_block == "auto":
            scale_block = 128 if self.in_dtype in fp8_dtypes else None
        if scale_block is not None and (
            isinstance(scale_block, bool) or not isinstance(scale_block, int) or scale_block < 1
        ):
            raise ValueError(f"A2AConfig.scale_block must be a positive int, None or 'auto', got {scale_block!r}")
        object.__setattr__(self, "_scale_block", scale_block)
        mpt = self.max_private_tokens
        if mpt is not None and (isinstance(mpt, bool) or not isinstance(mpt, int) or mpt < 0):
            raise ValueError(f"A2AConfig.max_private_tokens must be None or an int >= 0, got {mpt!r}")
        cap = self.expert_capacity
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_CONFIG_VALUES["max_num_tokens"]:
                raise ValueError(f"A2AConfig.expert_capacity must be None or an int in [1, "
                                 f"{MAX_CONFIG_VALUES['max_num_tokens']:,}], got {cap!r}")
            if self.expert_padding != 1:
                raise ValueError(f"A2AConfig.expert_capacity: every expert starts at l * expert_capacity, so "
                                 f"expert_padding must be 1, got {self.expert_padding}")
        pb = self.payload_bytes
        if pb is not None and (isinstance(pb, bool) or not isinstance(pb, int) or pb % 4
                               or not 4 <= pb <= self.token_bytes):
            raise ValueError(f"A2AConfig.payload_bytes must be None or a multiple of 4 in [4, {self.token_bytes}] "
                             f"(hidden_dim x in_dtype's size), got {pb!r}")
        for name in ("dispatch_rows", "combine_rows"):
            if getattr(self, name) not in ("route", "rank"):
                raise ValueError(f"A2AConfig.{name} must be 'route' or 'rank', got {getattr(self, name)!r}")
        if self.combine_rows == "rank" and self.dispatch_rows != "rank":
            raise ValueError("A2AConfig.combine_rows='rank' needs dispatch_rows='rank' (the weights travel "
                             "with the dispatch rows)")
        if not isinstance(self.combine_fp8, bool):
            raise ValueError(f"A2AConfig.combine_fp8 must be a bool, got {self.combine_fp8!r}")
        if not isinstance(self.relay, bool):
            raise ValueError(f"A2AConfig.relay must be a bool, got {self.relay!r}")
        if self.relay and (self.dispatch_rows, self.combine_rows) != ("rank", "rank"):
            raise ValueError(f"A2AConfig.relay=True needs dispatch_rows='rank' and combine_rows='rank' (the relay "
                             f"forwards per-rank rows and reduces the combine in the node), got "
                             f"dispatch_rows={self.dispatch_rows!r}, combine_rows={self.combine_rows!r}")
        if scale_block is not None and scale_block > MAX_CONFIG_VALUES["hidden_dim"]:
            raise ValueError(f"A2AConfig.scale_block must be <= {MAX_CONFIG_VALUES['hidden_dim']:,}, "
                             f"got {scale_block:,}")

    # ---- per-token sizes -------------------------------------------------------------------
    @cached_property
    def block_size(self) -> int | None:
        """Elements per fp32 scale, or None when the payload carries no scales."""
        return self._scale_block

    @cached_property
    def has_scales(self) -> bool:
        return self._scale_block is not None

    @cached_property
    def num_scales(self) -> int:
        """Scale columns per token: ceil(H / scale_block), 0 without scales."""
        return ceil_div(self.hidden_dim, self._scale_block) if self._scale_block else 0

    @cached_property
    def in_itemsize(self) -> int:
        return self.in_dtype.itemsize

    @cached_property
    def out_itemsize(self) -> int:
        return self.out_dtype.itemsize

    @cached_property
    def token_bytes(self) -> int:
        """Bytes of one token of the dispatch input: hidden_dim x in_dtype's size."""
        return self.hidden_dim * self.in_itemsize

    @cached_property
    def x_bytes(self) -> int:
        """Payload bytes of one dispatched row: `payload_bytes`, by default a whole token."""
        return self.token_bytes if self.payload_bytes is None else self.payload_bytes

    @cached_property
    def scale_bytes(self) -> int:
        return self.num_scales * 4

    @cached_property
    def scale_row_words(self) -> int:
        """Row stride (fp32 words) of received scales as `AllToAll.empty_dispatch_outputs` allocates them:
        num_scales rounded up to 16, so that every row starts 64-byte aligned and the unpack's scale
        stores vectorise (docs/perf-notes.md)."""
        return round_up(self.num_scales, 16)

    @cached_property
    def dispatch_scale_offset_bytes(self) -> int:
        """Where a slot's fp32 scales start: right after the payload, 16-byte aligned."""
        return round_up(self.x_bytes, ROW_ALIGN_BYTES)

    @cached_property
    def rank_rows(self) -> bool:
        """True when dispatch sends one row per (token, destination rank) (`dispatch_rows="rank"`)."""
        return self.dispatch_rows == "rank"

    @cached_property
    def rank_meta_offset_bytes(self) -> int:
        """Where a per-rank row's metadata starts (after the scales): int32 [K] local expert (-1: this
        route is not for the row's rank), int32 [K] the route's position among the sender's routes to that
        expert, and with `combine_rows="rank"` float32 [K] the routes' weights."""
        return self.dispatch_scale_offset_bytes + round_up(self.scale_bytes, ROW_ALIGN_BYTES)

    @cached_property
    def rank_meta_bytes(self) -> int:
        """Bytes of that metadata (0 with route rows), padded to 16."""
        if not self.rank_rows:
            return 0
        words = 2 * self.experts_per_token + (self.experts_per_token if self.combine_rows == "rank" else 0)
        return round_up(4 * words, ROW_ALIGN_BYTES)

    @cached_property
    def dispatch_stride_bytes(self) -> int:
        """Bytes per dispatch slot: payload, then scales, then (per-rank rows) the metadata, each padded
        to 16 bytes."""
        return self.rank_meta_offset_bytes + self.rank_meta_bytes

    @cached_property
    def y_bytes(self) -> int:
        """Bytes of one expert output row as the experts write it (`expert_y`, out_dtype); a combine slot
        carries them as they are unless `combine_fp8` (then `combine_payload_bytes`)."""
        return self.hidden_dim * self.out_itemsize

    @cached_property
    def combine_num_scales(self) -> int:
        """fp32 scales per combine slot: ceil(H / COMBINE_FP8_BLOCK) with `combine_fp8`, else 0."""
        return ceil_div(self.hidden_dim, COMBINE_FP8_BLOCK) if self.combine_fp8 else 0

    @cached_property
    def combine_payload_bytes(self) -> int:
        """Payload bytes of one combine slot: the H fp8 bytes with `combine_fp8`, else `y_bytes`."""
        return self.hidden_dim if self.combine_fp8 else self.y_bytes

    @cached_property
    def combine_scale_offset_bytes(self) -> int:
        """Where a combine slot's fp32 scales start (`combine_fp8`): right after the payload, 16-byte
        aligned (without scales: the end of the slot)."""
        return round_up(self.combine_payload_bytes, ROW_ALIGN_BYTES)

    @cached_property
    def combine_stride_bytes(self) -> int:
        """Bytes per combine slot: payload, then (`combine_fp8`) scales, each padded to 16 bytes."""
        return self.combine_scale_offset_bytes + round_up(4 * self.combine_num_scales, ROW_ALIGN_BYTES)

    @cached_property
    def max_routes(self) -> int:
        """T*K: routes (token, slot) one rank sends at most."""
        return self.max_num_tokens * self.experts_per_token

    def layout(self, world_size: int, node_size: int | None = None, relay: bool | None = None) -> "Layout":
        """Derived sizes for `world_size` ranks, `node_size` per node (default: all on one node); `relay`:
        rows to other nodes go through a relay (`Layout.relay`; default `self.relay`)."""
        return Layout.from_config(self, world_size, node_size if node_size is not None else world_size,
                                  self.relay if relay is None else relay)


def _rows_per_token(experts_per_token: int, world_size: int, per_rank: bool) -> int:
    """Rows a token takes at most: K routes, or with rows per (token, rank) min(K, W)."""
    return min(experts_per_token, world_size) if per_rank else experts_per_token


@dataclass(frozen=True)
class Layout:
    """Sizes of one rank's buffers for a world of `world_size` ranks (`node_size` per node).

    Plain ints only (no torch), so the proxy process can receive it without importing torch.
    Build it with `A2AConfig.layout(world_size, node_size)`."""

    __hash__, __getstate__ = _cached_hash, _state_without_hash

    world_size: int
    node_size: int
    num_experts: int
    max_num_tokens: int
    experts_per_token: int
    expert_padding: int
    private_rows: int             # P: rows each receiver reserves per sender (see A2AConfig)
    dispatch_stride_bytes: int
    combine_stride_bytes: int
    expert_capacity: int = 0      # rows per local expert in the dispatch output; 0 = compact layout
    rank_rows: bool = False       # dispatch rows per (token, rank): count rows also carry W rows per rank
    combine_rank_rows: bool = False  # combine rows per (token, rank), reduced at the experts' rank
    # Rows to another node go once per (token, node) to the source's relay there (docs/protocol.md, 3.8);
    # needs rank_rows and combine_rank_rows. Its partial rows (fp32, one per remote source's row into this
    # node) are `relay_partial_stride_bytes` apart: round_up(4 H, 16), set by `from_config`.
    relay: bool = False
    relay_partial_stride_bytes: int = 0
    # Under the relay with k > 1 proxies a rank (one per NIC): each network write goes as k pieces, piece j by
    # proxy j to the peer's proxy j (docs/protocol.md, 3.5): a rank's few rail writes use every NIC. Set by
    # `with_wire_pieces` once the proxies are chosen; 1: whole writes, each by the proxy `proxy_shard` names.
    wire_pieces: int = 1

    def __post_init__(self) -> None:
        if self.relay and not (self.rank_rows and self.combine_rank_rows):
            raise ValueError("Layout.relay needs rows per (token, rank) both ways: A2AConfig(dispatch_rows='rank', "
                             f"combine_rows='rank'), got rank_rows={self.rank_rows}, "
                             f"combine_rank_rows={self.combine_rank_rows}")
        if self.relay and self.relay_partial_stride_bytes <= 0:
            raise ValueError("Layout.relay needs relay_partial_stride_bytes > 0 (build it with from_config)")
        k = self.wire_pieces
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_PROXY_SHARDS or (k > 1 and not self.relay):
            raise ValueError(f"Layout.wire_pieces must be an int in [1, {MAX_PROXY_SHARDS}], above 1 only with the "
                             f"relay, got {k!r} (relay={self.relay})")

    @classmethod
    def from_config(cls, cfg: "A2AConfig", world_size: int, node_size: int, relay: bool = False) -> "Layout":
        W, E = world_size, cfg.num_experts
        if isinstance(W, bool) or not isinstance(W, int) or W < 1:
            raise ValueError(f"world_size must be a positive int, got {W!r}")
        if W >= 1 << IMM_RANK_BITS:
            raise ValueError(f"world_size must be < {1 << IMM_RANK_BITS}, got {W}")
        if E % W:
            raise ValueError(f"num_experts ({E}) must be divisible by world_size ({W})")
        ns = node_size
        if isinstance(ns, bool) or not isinstance(ns, int) or ns < 1 or W % ns:
            raise ValueError(f"node_size must be a positive divisor of world_size ({W}), got {ns!r}")
        # Default P: twice the average rows one sender sends to one rank (T*K/W), rounded up to 8
        # and capped at T*K, so most senders need no remainder write at uniform routing.
        send_rows = cfg.max_num_tokens * _rows_per_token(cfg.experts_per_token, W, cfg.rank_rows)
        if cfg.max_private_tokens is not None:
            private = min(cfg.max_private_tokens, send_rows)
        else:
            private = min(send_rows, round_up(ceil_div(2 * cfg.max_routes, W), 8))
        return cls(W, ns, E, cfg.max_num_tokens, cfg.experts_per_token, cfg.expert_padding, private,
                   cfg.dispatch_stride_bytes, cfg.combine_stride_bytes, cfg.expert_capacity or 0, cfg.rank_rows,
                   cfg.combine_rows == "rank", relay, round_up(4 * cfg.hidden_dim, ROW_ALIGN_BYTES) if relay else 0)

    def with_wire_pieces(self, proxies: int) -> "Layout":
        """This layout for `proxies` proxy processes a rank: under the relay with several, each network write
        split in that many pieces (`wire_pieces`), else unchanged."""
        return replace(self, wire_pieces=proxies) if self.relay and proxies > 1 else self

    @cached_property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @cached_property
    def max_routes(self) -> int:
        return self.max_num_tokens * self.experts_per_token

    @cached_property
    def send_rows(self) -> int:
        """Dispatch rows one rank sends at most (its send buffer's dispatch region; the most one source's
        remainder run can hold): T*K routes, or with per-rank rows T*min(K, W) (a token reaches at most K
        ranks, and at most every rank once)."""
        return self.max_num_tokens * _rows_per_token(self.experts_per_token, self.world_size, self.rank_rows)

    @cached_property
    def combine_rows(self) -> int:
        """Combine rows one rank receives at most, and sends back to one home at most: T*K route rows, or
        with rows reduced at the experts' rank T*min(K, W)."""
        return self.max_num_tokens * _rows_per_token(self.experts_per_token, self.world_size, self.combine_rank_rows)

    @cached_property
    def max_recv_routes(self) -> int:
        """Rows one rank may receive in one dispatch: every route of every rank (duplicates too)."""
        return self.world_size * self.max_routes

    @cached_property
    def max_recv_rank_rows(self) -> int:
        """Per-rank rows one rank may receive in one dispatch (its relayed rows included): one per (source,
        token), W * T; the rows of the expand's row plan (`rank_rows.expand_rank_rows(out_row_plan=)`)."""
        return self.world_size * self.max_num_tokens

    @cached_property
    def max_dispatch_rows(self) -> int:
        """Rows of `out_expert_x`: all received routes plus padding of every local expert; with a fixed
        expert capacity C, L * C."""
        if self.expert_capacity:
            return self.num_local_experts * self.expert_capacity
        return self.max_recv_routes + self.num_local_experts * (self.expert_padding - 1)

    # ---- regions of the send and recv buffers (bytes, relative to each buffer) ---------------
    # Receiver's private region: one slot per sender, `header_rows` rows then P rows. A remote sender's
    # private write carries its count row into the last 4E bytes of the header, then its first min(n, P)
    # rows: one write per peer carries both (docs/protocol.md).
    @cached_property
    def private_offset_bytes(self) -> int:
        return 0

    @cached_property
    def header_rows(self) -> int:
        """Dispatch rows before each sender's private rows, holding its count row (4E bytes) at their end."""
        return ceil_div(self.routing_row_bytes, self.dispatch_stride_bytes)

    @cached_property
    def private_slot_rows(self) -> int:
        return self.header_rows + self.private_rows

    @cached_property
    def private_slot_bytes(self) -> int:
        """Distance between two senders' slots (and so between their count rows) in a recv buffer."""
        return self.private_slot_rows * self.dispatch_stride_bytes

    def private_header_offset_bytes(self, sender: int) -> int:
        """Where sender's count row lands in a receiver's recv buffer (just before its private rows)."""
        return (self.private_offset_bytes + sender * self.private_slot_bytes
                + self.header_rows * self.dispatch_stride_bytes - self.routing_row_bytes)

    @cached_property
    def has_remote_peers(self) -> bool:
        """Whether some rank is on another node. The private, remainder and combine staging regions serve
        remote peers only (same-node peers are pulled from and pushed to through mapped memory), so on one
        node they take no bytes (their offsets stay valid: nothing reads or writes there)."""
        return self.node_size < self.world_size

    @cached_property
    def remainder_offset_bytes(self) -> int:
        if not self.has_remote_peers:
            return self.private_offset_bytes
        return self.world_size * self.private_slot_rows * self.dispatch_stride_bytes

    # Sender's private staging region (send buffer, after its T*K dispatch rows): one slot per remote peer,
    # shaped as the receiver's private slot, so the count row ends where the first min(n, P) rows begin and
    # a private write is one contiguous source range (one iovec: EFA writes in hardware only then). The
    # plan kernel writes the count row into each slot's header, the pack kernel a remote peer's first P
    # routes into its slot (`route_tokens(out_send_row=)`) and not into their send slots, which nothing reads.
    # Cost: (W - node_size) * private_slot_bytes more send buffer per rank, none on one node.
    @cached_property
    def private_stage_slots(self) -> int:
        """Slots of the private staging region: the remote peers of any rank (0 on one node)."""
        return self.world_size - self.node_size

    @cached_property
    def private_stage_offset_bytes(self) -> int:
        return self.send_rows * self.dispatch_stride_bytes

    @cached_property
    def private_stage_rows(self) -> int:
        """Dispatch rows of the private staging region; send rows run over [0, send_rows + this)."""
        return self.private_stage_slots * self.private_slot_rows

    def private_stage_index(self, rank: int, peer: int) -> int:
        """Slot of remote `peer` in `rank`'s private staging region: peers in rank order, its node skipped."""
        first = self.node_of(rank) * self.node_size
        if first <= peer < first + self.node_size:
            raise ValueError(f"private_stage_index: rank {peer} is on rank {rank}'s node (no private write)")
        return peer - self.node_size if peer >= first else peer

    def private_stage_header_offset_bytes(self, index: int) -> int:
        """Where the count row of staging slot `index` starts in the send buffer: the source of the private
        write, which runs on over the slot's rows (the same geometry as `private_header_offset_bytes`)."""
        return (self.private_stage_offset_bytes + index * self.private_slot_bytes
                + self.header_rows * self.dispatch_stride_bytes - self.routing_row_bytes)

    @cached_property
    def combine_stage_offset_bytes(self) -> int:
        """Where the expert side stages combine rows for remote sources, in its send buffer: after the
        dispatch rows and the private staging region, so staging never overwrites rows a same-node peer
        may still be pulling."""
        return self.private_stage_offset_bytes + self.private_stage_rows * self.dispatch_stride_bytes

    @cached_property
    def relay_partial_offset_bytes(self) -> int:
        """Where the relay's partial region starts in the send buffer: after the combine staging area. Row
        `base[s] + j` (`plan.relay_partial_bases`) holds this rank's unrounded fp32 partial of remote source s's
        row j into this node; the source's relay on this node reads it over mapped memory (docs/protocol.md, 3.8)."""
        stage_rows = self.world_size * self.combine_rows if self.has_remote_peers else 0
        return self.combine_stage_offset_bytes + stage_rows * self.combine_stride_bytes

    @cached_property
    def relay_partial_rows(self) -> int:
        """Rows of the partial region: (W - node_size) * T (a remote source sends a node at most one row per
        token) with the relay and remote peers, else 0."""
        return (self.world_size - self.node_size) * self.max_num_tokens if self.relay else 0

    @cached_property
    def send_bytes(self) -> int:
        return round_up(self.relay_partial_offset_bytes + self.relay_partial_rows * self.relay_partial_stride_bytes,
                        PAGE_BYTES)

    @cached_property
    def combine_recv_offset_bytes(self) -> int:
        """Where expert outputs for this rank's routes land, in its recv buffer (slot = the route's
        dispatch send slot): after the dispatch regions, so a fast peer's combine rows never overwrite
        dispatch rows still being unpacked (no barrier between the phases)."""
        remainder_rows = self.world_size * self.send_rows if self.has_remote_peers else 0
        return self.remainder_offset_bytes + remainder_rows * self.dispatch_stride_bytes

    @cached_property
    def recv_bytes(self) -> int:
        return round_up(self.recv_sync_offset_bytes + self.sync_bytes, PAGE_BYTES)

    # ---- the same-node synchronisation area --------------------------------------------------
    # Written by the kernels of same-node peers through mapped memory, read by this rank's kernels
    # (and, with remote peers, by its proxy). It sits at the end of the recv buffer when the kernels
    # wait on the GPU for same-node peers only (device memory: fastest), else in the shared segment
    # (host memory: the host and the proxy can read it too), where its count rows are the routing
    # area. Epoch words are int64, one per source rank; a source writes only its own word and its own
    # count row, so no two writers share a word. Cost: 3 * round_up(8W, 64) + 4*W*E bytes (W=64,
    # E=256: 67 KB). Offsets below are relative to the area's start.
    @cached_property
    def dispatch_ready_offset_bytes(self) -> int:
        """int64 [W]: word s = last epoch whose count row and send buffer source s published here."""
        return 0

    @cached_property
    def combine_ready_offset_bytes(self) -> int:
        """int64 [W]: word s = last epoch whose expert outputs rank s pushed into this rank's recv buffer
        (which also says s finished reading this rank's send buffer and count row)."""
        return round_up(8 * self.world_size, FLAG_SLOT_BYTES)

    @cached_property
    def combine_aborted_offset_bytes(self) -> int:
        """int64 [W]: word s = last epoch source s aborted at its combine (written before its
        combine_ready word: bad combine input there, or an expert over capacity)."""
        return 2 * round_up(8 * self.world_size, FLAG_SLOT_BYTES)

    @cached_property
    def node_counts_offset_bytes(self) -> int:
        """int32 [W, E]: row s = source s's per-expert counts."""
        return 3 * round_up(8 * self.world_size, FLAG_SLOT_BYTES)

    @cached_property
    def sync_bytes(self) -> int:
        return self.node_counts_offset_bytes + self.routing_bytes

    @cached_property
    def recv_sync_offset_bytes(self) -> int:
        """The sync area in the recv buffer (used when every rank is on one node and waits on the GPU)."""
        return round_up(self.combine_recv_offset_bytes + self.combine_rows * self.combine_stride_bytes,
                        FLAG_SLOT_BYTES)

    # ---- the shared host segment of one rank (flags, error, routing, host-staged buffers) ----
    @cached_property
    def flags_offset_bytes(self) -> int:
        return 0

    @cached_property
    def error_offset_bytes(self) -> int:
        return round_up(int(Flag.NUM_FLAGS) * FLAG_SLOT_BYTES, 64)

    @cached_property
    def trace_offset_bytes(self) -> int:
        """int64 [len(TRACE_EVENTS), 2]: (epoch, CLOCK_MONOTONIC ns) per proxy event."""
        return self.error_offset_bytes + ERROR_MESSAGE_BYTES

    @cached_property
    def model_trace_offset_bytes(self) -> int:
        """int64 [model_trace_words]: (epoch, ns) pairs at the start and end of each half of the model's
        call (pair 2h and 2h+1 for MODEL_TRACE_EVENTS[h]), then the clock-calibration pair."""
        return self.trace_offset_bytes + len(TRACE_EVENTS) * 16

    @cached_property
    def model_trace_words(self) -> int:
        return (len(MODEL_TRACE_EVENTS) * 2 + 1) * 2

    @cached_property
    def clock_calibration_word(self) -> int:
        """Word index, in the model's trace area, of the clock-calibration pair (after the halves')."""
        return len(MODEL_TRACE_EVENTS) * 4

    @cached_property
    def shard_offset_bytes(self) -> int:
        """int64 [MAX_PROXY_SHARDS, WORDS_PER_FLAG]: one line of `ShardWord`s per proxy shard."""
        return round_up(self.model_trace_offset_bytes + self.model_trace_words * 8, FLAG_SLOT_BYTES)

    def shard_word_offset_bytes(self, shard: int, word: "ShardWord | int") -> int:
        return self.shard_offset_bytes + shard * FLAG_SLOT_BYTES + int(word) * 8

    @cached_property
    def write_table_offset_bytes(self) -> int:
        """int64 [WriteTable.NUM_TABLES, wire_pieces, W, WRITE_TABLE_COLUMNS]: the writes the kernels planned for
        the proxy (`protocol.words.WriteTable`): (src_offset_bytes, length_bytes, dst_offset_bytes, imm) per piece
        and peer."""
        return round_up(self.shard_offset_bytes + MAX_PROXY_SHARDS * FLAG_SLOT_BYTES, FLAG_SLOT_BYTES)

    @cached_property
    def write_table_bytes(self) -> int:
        return int(WriteTable.NUM_TABLES) * self.wire_pieces * self.world_size * WRITE_TABLE_COLUMNS * 8

    def write_table_row_offset_bytes(self, table: "WriteTable | int", peer: int, piece: int = 0) -> int:
        return self.write_table_offset_bytes + self.write_table_row_word(table, peer, piece) * 8

    def write_table_row_word(self, table: "WriteTable | int", peer: int, piece: int = 0) -> int:
        """Index, among the tables' int64 words, of the first word of (table, piece, peer)'s row."""
        return ((int(table) * self.wire_pieces + piece) * self.world_size + peer) * WRITE_TABLE_COLUMNS

    @cached_property
    def peer_mask_offset_bytes(self) -> int:
        """int64 [W]: shrink mode's masked peers (nonzero: masked), written by the model and the proxies."""
        return self.write_table_offset_bytes + self.write_table_bytes

    @cached_property
    def segment_sync_offset_bytes(self) -> int:
        """The sync area in the segment (used with remote peers or host waits)."""
        return round_up(self.peer_mask_offset_bytes + 8 * self.world_size, PAGE_BYTES)

    @cached_property
    def routing_offset_bytes(self) -> int:
        """int32 [W, E]: row s holds source s's per-expert counts (from s's proxy over the wire, or from
        a same-node s's kernels): the counts of the segment's sync area."""
        return self.segment_sync_offset_bytes + self.node_counts_offset_bytes

    @cached_property
    def count_row_ints(self) -> int:
        """int32 per count row: E route counts per expert, then with per-rank rows W row counts per
        destination rank (the receiver needs both: where a source's rows start, and each expert's rows)."""
        return self.num_experts + (self.world_size if self.rank_rows else 0)

    @cached_property
    def routing_row_bytes(self) -> int:
        return self.count_row_ints * 4

    @cached_property
    def routing_bytes(self) -> int:
        return self.world_size * self.routing_row_bytes

    @cached_property
    def send_offset_bytes(self) -> int:
        """Send buffer in the segment (host-staged mode)."""
        return round_up(self.segment_sync_offset_bytes + self.sync_bytes, PAGE_BYTES)

    @cached_property
    def recv_offset_bytes(self) -> int:
        return self.send_offset_bytes + self.send_bytes

    def segment_bytes(self, host_staged: bool = True) -> int:
        end = self.recv_offset_bytes + self.recv_bytes if host_staged else self.send_offset_bytes
        return round_up(end, PAGE_BYTES)

    def flag_offset_bytes(self, flag: Flag) -> int:
        return self.flags_offset_bytes + int(flag) * FLAG_SLOT_BYTES

    # ---- ranks and nodes ------------------------------------------------------------------
    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def remote_peers(self, rank: int) -> list[int]:
        return [p for p in range(self.world_size) if not self.same_node(rank, p)]

    def rail_peers(self, rank: int) -> list[int]:
        """The ranks with `rank`'s local index on the other nodes, by node: with the relay (docs/protocol.md,
        3.8) its relays there, and the sources it relays for."""
        ns, mine = self.node_size, self.node_of(rank)
        return [n * ns + rank % ns for n in range(self.world_size // ns) if n != mine]

    def wire_peers(self, rank: int) -> list[int]:
        """The remote peers `rank`'s proxies post to and count immediates from: every remote peer, or with
        the relay its rail only."""
        return self.rail_peers(rank) if self.relay else self.remote_peers(rank)

    def proxy_shard(self, rank: int, peer: int, shards: int) -> int:
        """Which of `rank`'s `shards` proxies carries `peer` (docs/protocol.md, 3.5): `peer % shards`, or
        for a rail peer under the relay its place on the rail, since rail peers are congruent modulo
        `node_size` and `peer % shards` would give one proxy all of them."""
        if self.relay and not self.same_node(rank, peer) and peer % self.node_size == rank % self.node_size:
            return (self.node_of(peer) - (self.node_of(peer) > self.node_of(rank))) % shards
        return peer % shards

    def shard_peers(self, rank: int, shard: int, shards: int) -> list[int]:
        """The wire peers proxy `shard` of `rank`'s `shards` posts to and counts immediates from: those
        `proxy_shard` gives it, or with the writes in pieces (`wire_pieces` > 1) every one (its piece of each)."""
        if self.wire_pieces > 1:
            return self.wire_peers(rank)
        return [p for p in self.wire_peers(rank) if self.proxy_shard(rank, p, shards) == shard]

    def peer_proxy(self, rank: int, peer: int, shard: int, shards: int) -> int:
        """Which of `peer`'s proxies proxy `shard` of `rank` talks to: the one carrying `rank`
        (`proxy_shard(peer, rank)`), or with the writes in pieces the same index (piece j goes NIC j to NIC j)."""
        if self.wire_pieces > 1 and peer in self.wire_peers(rank):
            return shard
        return self.proxy_shard(peer, rank, shards)

    def node_peers(self, rank: int) -> list[int]:
        """Ranks on this rank's node, itself included."""
        first = self.node_of(rank) * self.node_size
        return list(range(first, first + self.node_size))

    def node_experts(self, rank: int) -> tuple[int, int]:
        """`[first, end)` of the experts hosted on this rank's node (experts are contiguous per rank)."""
        per_node = self.node_size * self.num_local_experts
        first = self.node_of(rank) * per_node
        return first, first + per_node


# The wires a config can be given by name: issue 32's levers and issue 46's relay over the sender-reduced rows,
# each (dispatch_rows, combine_rows, combine_fp8, relay). The one table: `reference.WIRE_VARIANTS` and the CLI's
# --wire choices are read from it (it needs no torch).
WIRES = {
    "per_route": ("route", "route", False, False),             # one row per route each way (the default)
    "per_rank_dispatch": ("rank", "route", False, False),      # dispatch deduplicated per (token, rank)
    "sender_reduced": ("rank", "rank", False, False),          # and the combine reduced at the experts' rank
    "fp8_combine": ("route", "route", True, False),            # route rows, the combine's in fp8
    "sender_reduced_fp8": ("rank", "rank", True, False),       # all three levers
    "relay": ("rank", "rank", False, True),                    # sender_reduced through the relay (3.8)
    "relay_fp8": ("rank", "rank", True, True),                 # sender_reduced_fp8 through the relay
}


def wire_config(cfg: A2AConfig, wire: str) -> A2AConfig:
    """`cfg` with the rows of the wire named `wire` (`WIRES`: `dispatch_rows`, `combine_rows`, `combine_fp8` and
    `relay`; every other field kept). An unknown name is a ValueError naming the known ones."""
    import dataclasses

    if wire not in WIRES:
        raise ValueError(f"unknown wire {wire!r}: expected one of {', '.join(WIRES)}")
    dispatch_rows, combine_rows, combine_fp8, relay = WIRES[wire]
    return dataclasses.replace(cfg, dispatch_rows=dispatch_rows, combine_rows=combine_rows, combine_fp8=combine_fp8,
                               relay=relay)


__all__ = ["A2AConfig", "Layout", "WIRES", "round_up", "ceil_div", "next_power_of_2", "wire_config"]
