"""DeepEP's normal (high-throughput) mode for the facade (issue 32, item 6): `get_dispatch_layout`, `dispatch`
(and its cached form with a handle), `combine`, driven by `compat/deep_ep.py`'s `Buffer`.

Semantics are DeepEP's (commit dd758ca: `deep_ep/buffers/legacy.py`, `csrc/legacy/buffer.hpp`,
`csrc/kernels/legacy/intranode.cu`, `layout.cu`), read there, not copied:
- a token travels once to every rank r with `is_token_in_rank[t, r]`; rank r receives every source's
  tokens grouped by source rank, in token order (`rank_prefix_matrix[s][r]` = the rows from sources <= s);
- `recv_topk_idx` holds the received token's top-k ids made local (`id - r * L`), -1 for experts of other
  ranks; `recv_topk_weights` its weights, 0 where the id is -1 there;
- `num_recv_tokens_per_expert_list` is the callers' `num_tokens_per_expert` summed over the sources for each
  local expert, each rounded up to `expert_alignment` (empty with `num_worst_tokens`);
- with `num_worst_tokens > 0` the received tensors have that many rows, `recv_topk_idx` -1 past the count;
- combine sends each received row home and sums them there **without weights**: `bias_0 + bias_1` (each
  bf16 taken to fp32) then the rows in rank order, in fp32, cast to bf16 once; the top-k weights given to
  the combine are summed the same way (fp32, rank order).

How: the rows move through `AllToAll` instances whose "experts" are the ranks (num_experts = W; token t's
routes are the ranks `is_token_in_rank[t]` names, in ascending order, then -1; top-k = R, the most ranks a
token goes to on any rank, agreed per call), so rank r's one local "expert" receives
every source's tokens in (source, token) order, which is DeepEP's `recv_x` order. A dispatched row carries,
after the token's bytes (bf16, or fp8 with its scales), an int32 token index, the K top-k ids (int32) and
the K weights (fp32 bits), moved bit-exactly (AllToAll moves payloads as opaque words). The instance's
combine payload is fp32 (`out_dtype=float32`): the row sent home is the expert output as fp32 followed by
the K top-k weights, the combine sums with weight 1 per route in route (= rank) order with the bias as the
accumulator's first term, so both sums are DeepEP's arithmetic exactly; the cast to bf16 is made once at
the end. Costs beyond DeepEP's (for later, issue 32 items 1, 4, 7): one staging copy of `x` per dispatch and
one copy out of the received rows; a combine of fp32 rows (twice DeepEP's bytes); buffers sized for R routes
a token (T x R send rows, W x T receive rows and T x R fp32 combine rows a rank on one node; across nodes also
the remote regions, W x T x R rows); one host all-gather per call
(the call's verdicts and counts, so that bad input raises on every rank before anything is sent; and which
call it is, a dispatch or a combine and its number, so that ranks out of step are refused on every rank, each
told where the others are, instead of pairing one rank's dispatch with another's combine).

Over another wire (`Buffer(wire=)`) the instances take its rows and relay but keep fp32 combine rows (no fp8: they
carry the top-k weights); where the combine is reduced at the experts' rank the weights (1 a route) go with the
dispatch (`_route_weights`), and the relay adds the rows of each other node before the home adds them.

Calls on one Buffer are collective (every rank makes the same calls in the same order, as DeepEP requires).
Instances are built at the first call that needs them (every rank in the same call), per hidden size (bf16
and fp8 calls share them: a row has room for either), for the largest T any rank passed (rounded up to a
power of two) and top-k; a later call with more tokens or top-k builds a larger set. Each set has two slots used
alternately (two dispatches in flight). DeepEP's handles stay valid for ever; ours are served on the slot
that dispatched them: a dispatch whose slot still holds an uncombined call finishes that call first with a
combine of nothing, and a handle combined again (or whose slot was reused) is dispatched again first (its
routes; the payload is not needed). Both are extra transfers, never wrong results.
"""
from __future__ import annotations

import dataclasses
import socket

import torch

from ..all_to_all import AllToAll, CallAborted, canonical_device
from ..config import A2AConfig, ceil_div, round_up, wire_config
from ..fingerprint import all_gather
from ._api import _NO_EVENT, Config, EventOverlap
from ._slots import FP8_BLOCK  # DeepEP's fp8 scale block: an fp8 call of hidden H passes ceil(H / 128) scales

FREE, DISPATCHED, COMBINED = range(3)
_FP8 = torch.float8_e4m3fn


class NormalHandle(tuple):
    """What `Buffer.dispatch` returns as its handle: a 6-tuple indexed as DeepEP's intranode handle, plus
    the facade's state of the call (attributes).

    Fields: 0 `rank_prefix_matrix` `[W, W]` int32 (`[s][r]`: tokens rank r receives from ranks <= s, as
    DeepEP's); 1 `channel_prefix_matrix` `[W, num_channels]` int32 (`[r][c]`: this rank's tokens to rank r in
    DeepEP's channels 0..c, `num_channels = config.num_sms // 2`); 2 None (DeepEP's receive-side channel
    prefix: no channels here); 3 `recv_src_idx` `[num_recv]` int32 (the received token's index on its
    source); 4 `is_token_in_rank` `[T, W]` bool; 5 `send_head` `[T, W]` int32: the row of token t in rank
    r's `recv_x`, -1 where not sent (DeepEP's holds ring-buffer positions instead)."""

    def __new__(cls, fields, call):
        obj = super().__new__(cls, fields)
        obj.call = call
        return obj

    def __repr__(self) -> str:
        c = self.call
        return f"NormalHandle(call={c.call}, num_tokens={c.T}, num_recv_tokens={c.n})"


class _Call:
    """One normal-mode dispatch: what its combine (and a cached dispatch) needs."""

    def __init__(self, owner, set_, slot: int, call: int, T: int, n: int, routes, is_token_in_rank, k=None,
                 worst: int = 0):
        self.owner, self.set, self.slot, self.call = owner, set_, slot, call
        self.T, self.n, self.routes, self.is_token_in_rank = T, n, routes, is_token_in_rank
        self.k = k          # the dispatch's num_topk (None without topk_idx): a combine's topk_weights has it
        self.worst = worst  # its num_worst_tokens: recv_x had that many rows (a combine may pass them all)


class _Slot:
    def __init__(self, a2a: AllToAll, row_elems: int, T: int) -> None:
        self.a2a = a2a
        self.num, self.ex, _ = a2a.empty_dispatch_outputs()
        rows, dev = self.ex.shape[0], a2a.device
        self.send = torch.zeros(T, row_elems, dtype=torch.bfloat16, device=dev)
        self.y = torch.zeros(rows, row_elems, dtype=torch.float32, device=dev)
        self.out = torch.zeros(T, row_elems, dtype=torch.float32, device=dev)
        self.zero_w = torch.zeros(T, a2a.cfg.experts_per_token, dtype=torch.float32, device=dev)
        self.state, self.call, self.routes = FREE, -1, None

    def close(self) -> None:
        self.a2a.close()


class _Set:
    """Two slots of instances for hidden size H: up to S scale words, top-k K, up to T tokens a rank, each to
    at most R ranks (the instances' routes a token). bf16 and fp8 calls share them (AllToAll moves the rows
    as opaque words): a row holds 2H bytes of x (a bf16 token, or an fp8 one in its first H bytes), then S
    scale words, then the metadata; so one set of buffers serves both kinds (at 8 ranks on one GPU, two
    would not fit)."""

    def __init__(self, H: int, S: int, K: int, T: int, R: int) -> None:
        self.H, self.S, self.K, self.T, self.R = H, S, K, T, R
        self.scale_off = 2 * H
        self.meta_off = self.scale_off + 4 * S
        total = round_up(self.meta_off + 4 * (1 + 2 * K), 4)
        self.row_elems = total // 2  # bf16 elements, >= H + K: the fp32 combine row holds the output and K weights
        self.slots: list[_Slot] = []
        self.next = 0

    def fits(self, H, S, K, T, R) -> bool:
        return H == self.H and S <= self.S and K <= self.K and T <= self.T and R <= self.R


def _int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    return value


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {t.dtype} on {t.device}"
    return type(t).__name__


class NormalMode:
    """The normal-mode calls of one `Buffer` (made at its first normal-mode call)."""

    def __init__(self, buf) -> None:
        self.buf = buf
        self.W, self.rank = buf.group_size, buf.rank
        self.sets: list[_Set] = []
        self.calls = 0  # dispatches (their handles' numbers)
        self.seq = 0    # normal-mode calls exchanged (dispatch and combine): says where each rank is
        self._node_size: int | None = None

    # ---- get_dispatch_layout ------------------------------------------------------------------
    def node_size(self) -> int:
        """Ranks per node, from the Buffer's `node_group` ("auto": by hostname, one all-gather, once)."""
        if self._node_size is None:
            ng = self.buf._options["node_group"]
            if isinstance(ng, int) and not isinstance(ng, bool):
                size = ng
            elif ng is None or ng == "auto":
                rows = all_gather(self.buf.group, (_TAG, "hosts", socket.gethostname()))
                foreign = [r for r, row in enumerate(rows)
                           if not (isinstance(row, tuple) and row[:2] == (_TAG, "hosts"))]
                if foreign:  # paired with another collective: node counts from it would be wrong
                    raise ValueError(f"rank {self.rank}: get_dispatch_layout: its first call groups the ranks by "
                                     f"host (one all-gather, node_group='auto'), but rank(s) {foreign} made another "
                                     f"collective: every rank makes its first normal-mode call together")
                hosts = [row[2] for row in rows]
                size = hosts.count(hosts[self.rank])
            else:
                import torch.distributed as dist
                size = dist.get_world_size(ng)
            self._node_size = size if size >= 1 and self.W % size == 0 else self.W
        return self._node_size

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream):
        _check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        W = self.W
        num_experts = _int(num_experts, "num_experts", 1)
        if num_experts % W:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks ({W})")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.dtype not in (
                torch.int64, torch.int32) or not topk_idx.is_contiguous():
            raise ValueError(f"topk_idx: expected a contiguous [num_tokens, num_topk] int64 (deep_ep.topk_idx_t) "
                             f"tensor, got {_describe(topk_idx)}")
        _wait(previous_event)
        T, dev = topk_idx.shape[0], topk_idx.device
        if T and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
            raise ValueError(f"topk_idx: expert ids must be in [-1, {num_experts}), got values in "
                             f"[{int(topk_idx.min())}, {int(topk_idx.max())}]")
        L = num_experts // W
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).to(torch.int32)
        rank_of = torch.where(valid, topk_idx.long() // L, torch.full_like(topk_idx, W, dtype=torch.long))
        in_rank = torch.zeros(T, W + 1, dtype=torch.bool, device=dev)
        in_rank.scatter_(1, rank_of, True)
        is_token_in_rank = in_rank[:, :W].contiguous()
        per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        per_rdma_rank = None
        N = self.node_size()
        if N < W:  # several nodes: tokens per node (DeepEP's "RDMA rank")
            per_rdma_rank = is_token_in_rank.view(T, W // N, N).any(2).sum(0, dtype=torch.int32)
        return per_rank, per_rdma_rank, per_expert, is_token_in_rank, _event(dev, async_finish)

    # ---- dispatch -------------------------------------------------------------------------------
    def dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                 allocate_on_comm_stream, kwargs=None):
        buf, W = self.buf, self.W
        error, info, args = None, None, None
        try:
            _refuse_kwargs(kwargs, "dispatch")
            args = self._check_dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                        topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                        previous_event, async_finish, allocate_on_comm_stream)
            info = args["info"]
        except Exception as exc:  # noqa: BLE001 - any failure of the checks is this rank's verdict, said everywhere
            error = _as_value_error(exc, "dispatch")
        table = self._exchange("dispatch", error, info, {"cached": handle is not None})
        infos = [row[1] for row in table]
        for name, what in _DISPATCH_AGREE:
            if infos[0]["cached"] and name in ("k", "E"):
                continue
            if not infos[0]["cached"] and name == "call":
                continue
            values = [i[name] for i in infos]
            if any(v != values[0] for v in values):
                per_rank = "; ".join(f"{v} on rank {r}" for r, v in enumerate(values))
                raise ValueError(f"rank {self.rank}: normal-mode dispatch: {what} differs between ranks ({per_rank}): "
                                 f"DeepEP needs it equal on every rank; refused on every rank, nothing was sent")
        if not infos[0]["cached"]:
            counts = [i["per_rank"] for i in infos]  # counts[s][r]: tokens s sends to r
            for r in range(W):
                n_r, worst = sum(c[r] for c in counts), infos[r]["worst"]
                if worst and n_r > worst:
                    raise ValueError(f"rank {self.rank}: normal-mode dispatch: rank {r} receives {n_r} tokens > its "
                                     f"num_worst_tokens ({worst}); refused on every rank, nothing was sent")
        i0 = infos[0]
        T_max, K_max = max(i["T"] for i in infos), i0["k"] or 0
        R_max = max(i["R"] for i in infos)  # the most ranks one token goes to, on any rank
        set_ = self._set_for(i0["H"], i0["S"], max(K_max, 1), T_max, max(R_max, 1), args["device"])
        _wait(previous_event)
        index, set_.next = set_.next, set_.next ^ 1
        slot = set_.slots[index]
        self.calls += 1
        if not i0["cached"]:
            is_token_in_rank = args["is_token_in_rank"]
            routes = self._routes(is_token_in_rank, set_.R)
            prefix = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            n = int(prefix[W - 1, self.rank])
        else:
            call_ = handle.call
            is_token_in_rank, routes, n = call_.is_token_in_rank, call_.routes, call_.n
            if routes.shape[1] < set_.R:  # the handle's set routes fewer ranks a token: padded with -1
                routes = torch.cat([routes, routes.new_full((routes.shape[0], set_.R - routes.shape[1]), -1)], 1)
            prefix = handle[0]
        self._retire(slot)
        T = args["T"]
        try:
            send = self._stage(set_, slot, args)
        except Exception as exc:  # noqa: BLE001 - the peers are in this call: it is aborted on every rank
            self._run(slot, lambda: slot.a2a.abort(f"rank {self.rank}: normal-mode dispatch: x could not be staged "
                                                   f"({type(exc).__name__}: {exc})"))
        self._run(slot, lambda: slot.a2a.dispatch(slot.num, slot.ex, None, send, None, routes,
                                                  **_route_weights(slot, routes)))
        slot.state, slot.call, slot.routes = DISPATCHED, self.calls, routes
        if int(slot.num[0]) != n:  # the counts exchanged and the rows received must agree
            raise RuntimeError(f"rank {self.rank}: normal-mode dispatch received {int(slot.num[0])} rows, the "
                               f"exchanged counts say {n}")
        rows = n if i0["cached"] or not args["worst"] else args["worst"]
        recv_x, meta = self._unstage(set_, slot, args, n, rows)
        ev = _event(args["device"], async_finish)
        if i0["cached"]:
            return recv_x, None, None, None, None, ev
        call_ = _Call(self, set_, index, self.calls, T, n, routes, is_token_in_rank, i0["k"], args["worst"])
        dev = args["device"]
        cpm = _channel_prefix(is_token_in_rank, (config.num_sms if config is not None else buf.num_sms) // 2)
        send_head = self._send_head(is_token_in_rank, prefix.to(dev))
        src = meta["src"]
        if rows > n:  # num_worst_tokens: DeepEP's recv_src_idx has that many rows too (-1 past the count here)
            src = torch.cat([src, src.new_full((rows - n,), -1)])
        fields = (prefix.to(dev), cpm, None, src, is_token_in_rank, send_head)
        recv_idx = recv_w = None
        if i0["k"] is not None:
            recv_idx, recv_w = meta["idx"], meta["w"]
        per_expert = []
        if not args["worst"]:
            E = i0["E"]
            L = E // W
            mine = [sum(i["per_expert"][self.rank * L + l] for i in infos) for l in range(L)]
            per_expert = [round_up(c, args["align"]) for c in mine]
        return recv_x, recv_idx, recv_w, per_expert, NormalHandle(fields, call_), ev

    def _check_dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                        topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                        allocate_on_comm_stream) -> dict:
        W = self.W
        _check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        if config is not None and not isinstance(config, Config):
            raise ValueError(f"config: expected a deep_ep.Config or None, got {type(config).__name__}")
        align = _int(expert_alignment, "expert_alignment", 1)
        worst = _int(num_worst_tokens, "num_worst_tokens", 0)
        scales = None
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError(f"x: expected a bf16 tensor or a (float8_e4m3fn x, scales) pair, got a "
                                 f"{type(x).__name__} of {len(x)}")
            x, scales = x
            if not isinstance(x, torch.Tensor) or x.dtype != _FP8:
                raise ValueError(f"x: the first of the pair must be a float8_e4m3fn [num_tokens, hidden] tensor, "
                                 f"got {_describe(x)}")
        elif not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            raise ValueError(f"x: expected a bfloat16 [num_tokens, hidden] tensor or a (float8_e4m3fn, scales) "
                             f"pair, got {_describe(x)}")
        if x.dim() != 2 or not x.is_contiguous() or x.shape[1] < 1:
            raise ValueError(f"x: expected a contiguous [num_tokens, hidden] tensor, got {_describe(x)} with "
                             f"strides {x.stride()}")
        T, H = x.shape
        dev = x.device
        S, scale_dtype = 0, None
        if scales is not None:
            if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or scales.shape[0] != T or \
                    scales.dtype not in (torch.float32, torch.int32) or scales.device != dev:
                raise ValueError(f"x: the scales must be a [num_tokens={T}, num_scales] float32 (or int32) tensor on "
                                 f"{dev}, got {_describe(scales)}")
            S, scale_dtype = scales.shape[1], str(scales.dtype)
        info = {"kind": "fp8" if scales is not None else "bf16", "H": H, "S": S, "scale_dtype": scale_dtype,
                "T": T, "worst": worst}
        k = None
        if handle is not None:
            if not isinstance(handle, NormalHandle) or handle.call.owner is not self:
                raise ValueError(f"handle: expected a handle returned by this Buffer's dispatch, got "
                                 f"{type(handle).__name__}")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx / topk_weights (as DeepEP's)")
            if T != handle.call.T:
                raise ValueError(f"x: a cached dispatch needs the handle's {handle.call.T} tokens, got {T}")
            info.update(cached=True, k=None, E=None, call=handle.call.call, R=handle.call.routes.shape[1])
            return {"info": info, "x": x, "scales": scales, "T": T, "worst": 0, "align": align, "device": dev,
                    "topk_idx": None, "topk_weights": None}
        for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                        ("num_tokens_per_expert", num_tokens_per_expert)):
            if t is None:
                raise ValueError(f"{name}: required without a handle (from get_dispatch_layout)")
        if not isinstance(is_token_in_rank, torch.Tensor) or is_token_in_rank.dtype != torch.bool or \
                tuple(is_token_in_rank.shape) != (T, W) or not is_token_in_rank.is_contiguous() or \
                is_token_in_rank.device != dev:
            raise ValueError(f"is_token_in_rank: expected a contiguous bool [{T}, {W}] tensor on {dev}, got "
                             f"{_describe(is_token_in_rank)}")
        if not isinstance(num_tokens_per_rank, torch.Tensor) or num_tokens_per_rank.dtype != torch.int32 or \
                tuple(num_tokens_per_rank.shape) != (W,):
            raise ValueError(f"num_tokens_per_rank: expected an int32 [{W}] tensor, got {_describe(num_tokens_per_rank)}")
        if not isinstance(num_tokens_per_expert, torch.Tensor) or num_tokens_per_expert.dtype != torch.int32 or \
                num_tokens_per_expert.dim() != 1 or num_tokens_per_expert.shape[0] % W or \
                num_tokens_per_expert.shape[0] == 0:
            raise ValueError(f"num_tokens_per_expert: expected an int32 [num_experts] tensor, num_experts divisible "
                             f"by {W}, got {_describe(num_tokens_per_expert)}")
        per_rank = is_token_in_rank.sum(0, dtype=torch.int32).cpu()
        if not torch.equal(per_rank, num_tokens_per_rank.cpu()):
            raise ValueError(f"num_tokens_per_rank {num_tokens_per_rank.tolist()} does not match is_token_in_rank "
                             f"(its column sums: {per_rank.tolist()})")
        E = num_tokens_per_expert.shape[0]
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("topk_idx and topk_weights: give both or neither (as DeepEP)")
        if topk_idx is not None:
            if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != T or \
                    topk_idx.dtype not in (torch.int64, torch.int32) or not topk_idx.is_contiguous() or \
                    topk_idx.device != dev or topk_idx.shape[1] < 1:
                raise ValueError(f"topk_idx: expected a contiguous int64 [{T}, num_topk] tensor on {dev}, got "
                                 f"{_describe(topk_idx)}")
            k = topk_idx.shape[1]
            if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (T, k) or \
                    topk_weights.dtype != torch.float32 or topk_weights.device != dev:
                raise ValueError(f"topk_weights: expected a float32 [{T}, {k}] tensor on {dev}, got "
                                 f"{_describe(topk_weights)}")
            if T and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= E):
                raise ValueError(f"topk_idx: expert ids must be in [-1, {E}), got values in "
                                 f"[{int(topk_idx.min())}, {int(topk_idx.max())}]")
        info.update(cached=False, k=k, E=E, call=None, per_rank=per_rank.tolist(),
                    R=int(is_token_in_rank.sum(1).max()) if T else 0,
                    per_expert=num_tokens_per_expert.cpu().tolist())
        return {"info": info, "x": x, "scales": scales, "T": T, "worst": worst, "align": align, "device": dev,
                "is_token_in_rank": is_token_in_rank, "topk_idx": topk_idx, "topk_weights": topk_weights}

    def _routes(self, is_token_in_rank: torch.Tensor, R: int) -> torch.Tensor:
        """`[T, R]` int32: the ranks token t goes to, in ascending order (the combine sums in route order, so
        in rank order, as DeepEP), then -1; R >= the most ranks a token goes to."""
        W = self.W
        ranks = torch.arange(W, dtype=torch.int32, device=is_token_in_rank.device).expand(is_token_in_rank.shape[0], W)
        keyed = torch.where(is_token_in_rank, ranks, torch.full_like(ranks, W))
        routes = keyed.sort(dim=1).values[:, :R]
        return torch.where(routes == W, torch.full_like(routes, -1), routes).contiguous()

    def _send_head(self, is_token_in_rank, prefix) -> torch.Tensor:
        """`[T, W]` int32: the row of token t in rank r's recv_x (-1: not sent there)."""
        start = prefix[self.rank - 1] if self.rank else torch.zeros_like(prefix[0])
        pos = is_token_in_rank.to(torch.int32).cumsum(0, dtype=torch.int32) - 1 + start
        return torch.where(is_token_in_rank, pos, torch.full_like(pos, -1)).to(torch.int32)

    def _stage(self, set_: _Set, slot: _Slot, args) -> torch.Tensor:
        """The rows this dispatch sends: x's bytes, the scales, the token index, top-k ids and weights."""
        T = args["T"]
        send = slot.send[:T]
        b = send.view(torch.uint8)
        x = args["x"]
        # Into a view of the row in x's dtype: x.view(uint8) needs last stride 1, which an empty x need not have.
        b[:, :x.shape[1] * x.element_size()].view(x.dtype).copy_(x)
        if args["scales"] is not None:
            S = args["scales"].shape[1]
            b[:, set_.scale_off:set_.scale_off + 4 * S].view(torch.int32).copy_(args["scales"].view(torch.int32))
        K = set_.K
        meta = b[:, set_.meta_off:set_.meta_off + 4 * (1 + 2 * K)].view(torch.int32)
        meta[:, 0] = torch.arange(T, dtype=torch.int32, device=send.device)
        meta[:, 1:1 + K] = -1
        meta[:, 1 + K:] = 0
        idx = args["topk_idx"]
        if idx is not None:
            k = idx.shape[1]
            meta[:, 1:1 + k] = idx.to(torch.int32)
            meta[:, 1 + K:1 + K + k] = args["topk_weights"].view(torch.int32)
        return send

    @staticmethod
    def _stage_combine(slot: _Slot, n: int, H: int, x, topk_weights, biases: list, out: torch.Tensor) -> None:
        """The rows this combine sends (x, then the top-k weights, fp32) and the biases as the sums' first term."""
        slot.y[:n, :H] = x[:n]  # with num_worst_tokens rows, those past the count are not sent (as DeepEP)
        if topk_weights is not None:
            slot.y[:n, H:H + topk_weights.shape[1]] = topk_weights[:n]
        if biases:
            out.zero_()
            out[:, :H] = biases[0].float()
            if len(biases) == 2:
                out[:, :H] += biases[1].float()

    def _unstage(self, set_: _Set, slot: _Slot, args, n: int, rows: int):
        """recv_x (fresh tensors, `rows` of them, the first n received) and the rows' metadata."""
        dev, H, K = args["device"], set_.H, set_.K
        b = slot.ex.view(torch.uint8)[:n]
        fp8 = args["scales"] is not None
        x_bytes = H if fp8 else 2 * H
        xb = torch.zeros(rows, x_bytes, dtype=torch.uint8, device=dev)
        xb[:n] = b[:, :x_bytes]
        recv_x = xb.view(_FP8 if fp8 else torch.bfloat16)
        if fp8:
            S = args["scales"].shape[1]
            sc = torch.zeros(rows, S, dtype=args["scales"].dtype, device=dev)
            sc[:n].view(torch.int32).copy_(b[:, set_.scale_off:set_.scale_off + 4 * S].view(torch.int32))
            recv_x = (recv_x, sc)
        meta = b[:, set_.meta_off:set_.meta_off + 4 * (1 + 2 * K)].view(torch.int32)
        out = {"src": meta[:, 0].clone()}
        idx = args["topk_idx"]
        if idx is not None:
            k, L = idx.shape[1], args["info"]["E"] // self.W
            g = meta[:, 1:1 + k]
            lo = self.rank * L
            local = (g >= lo) & (g < lo + L)
            ridx = torch.full((rows, k), -1, dtype=idx.dtype, device=dev)
            ridx[:n] = torch.where(local, g - lo, torch.full_like(g, -1)).to(idx.dtype)
            rw = torch.zeros(rows, k, dtype=torch.float32, device=dev)
            w = meta[:, 1 + K:1 + K + k].contiguous().view(torch.float32)
            rw[:n] = torch.where(local, w, torch.zeros_like(w))
            out["idx"], out["w"] = ridx, rw
        return recv_x, out

    # ---- combine ----------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream,
                kwargs=None):
        error, info = None, None
        try:
            _refuse_kwargs(kwargs, "combine")
            _check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
            if config is not None and not isinstance(config, Config):
                raise ValueError(f"config: expected a deep_ep.Config or None, got {type(config).__name__}")
            if not isinstance(handle, NormalHandle) or handle.call.owner is not self:
                raise ValueError(f"handle: expected a handle returned by this Buffer's dispatch, got "
                                 f"{type(handle).__name__}")
            c = handle.call
            H = c.set.H
            rows = (c.n, c.worst) if c.worst > c.n else (c.n,)  # DeepEP's: as many rows as its recv_x had
            shapes = " or ".join(f"[{r}, {H}]" for r in rows)
            if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or \
                    x.shape[0] not in rows or x.shape[1] != H or not x.is_contiguous():
                raise ValueError(f"x: expected a contiguous bfloat16 {shapes} tensor (the handle's received "
                                 f"tokens{', or num_worst_tokens rows' if len(rows) > 1 else ''}), got {_describe(x)}")
            dev = x.device
            k = None
            if topk_weights is not None:
                # The dispatch's num_topk when it had top-k (other widths would sum weights nobody sent), else
                # any the rows have room for.
                ks = f"{c.k}" if c.k is not None else f"num_topk <= {c.set.K}"
                if not isinstance(topk_weights, torch.Tensor) or topk_weights.dim() != 2 or \
                        topk_weights.shape[0] not in rows or topk_weights.dtype != torch.float32 or \
                        topk_weights.device != dev or not (topk_weights.shape[1] == c.k if c.k is not None
                                                           else 1 <= topk_weights.shape[1] <= c.set.K):
                    raise ValueError(f"topk_weights: expected a float32 [{' or '.join(map(str, rows))}, {ks}] tensor "
                                     f"on {dev} (the dispatch's recv_topk_weights), got {_describe(topk_weights)}")
                k = topk_weights.shape[1]
            biases = [] if bias is None else [bias] if isinstance(bias, torch.Tensor) else bias
            if not isinstance(biases, (tuple, list)) or len(biases) > 2:
                raise ValueError(f"bias: expected None, a tensor or a pair of tensors, got {type(bias).__name__}")
            for b in biases:
                if b is None:
                    continue
                if not isinstance(b, torch.Tensor) or b.dtype != torch.bfloat16 or tuple(b.shape) != (c.T, H) \
                        or b.device != dev:
                    raise ValueError(f"bias: expected bfloat16 [{c.T}, {H}] tensors on {dev}, got {_describe(b)}")
            info = {"call": c.call, "k": k}
        except Exception as exc:  # noqa: BLE001 - any failure of the checks is this rank's verdict, said everywhere
            error = _as_value_error(exc, "combine")
        call = handle.call.call if isinstance(handle, NormalHandle) else None
        table = self._exchange("combine", error, info, {"handle": call})
        calls = [row[1]["call"] for row in table]
        if any(v != calls[0] for v in calls):
            said = "; ".join(f"call {v} on rank {r}" for r, v in enumerate(calls))
            raise ValueError(f"rank {self.rank}: normal-mode combine: handle: the ranks combine the handles of "
                             f"different dispatches ({said}); refused on every rank, nothing was sent")
        ks = [row[1]["k"] for row in table]
        if any(v != ks[0] for v in ks):
            said = "; ".join(f"{'None' if v is None else f'[{c.n}, {v}]'} on rank {r}" for r, v in enumerate(ks))
            raise ValueError(f"rank {self.rank}: normal-mode combine: topk_weights differs between ranks ({said}): "
                             f"every rank passes its weights of the same num_topk, or every rank None (the weights "
                             f"are summed over the ranks); refused on every rank, nothing was sent")
        _wait(previous_event)
        c = handle.call
        set_, slot = c.set, c.set.slots[c.slot]
        if slot.call != c.call or slot.state != DISPATCHED:  # reused, or combined before: dispatch it again
            self._retire(slot)
            send = slot.send[:c.T]  # its bytes do not matter: the combine sends x
            self._run(slot, lambda: slot.a2a.dispatch(slot.num, slot.ex, None, send, None, c.routes,
                                                      **_route_weights(slot, c.routes)))
            slot.state, slot.call, slot.routes = DISPATCHED, c.call, c.routes
        H, n, T = set_.H, c.n, c.T
        out = slot.out[:T]
        biases = [b for b in ([] if bias is None else [bias] if isinstance(bias, torch.Tensor) else bias)
                  if b is not None]
        try:
            self._stage_combine(slot, n, H, x, topk_weights, biases, out)
        except Exception as exc:  # noqa: BLE001 - the peers are in this call: it is aborted on every rank
            self._run(slot, lambda: slot.a2a.abort(f"rank {self.rank}: normal-mode combine: the expert outputs "
                                                   f"could not be staged ({type(exc).__name__}: {exc})"))
        weights = (c.routes >= 0).to(torch.float32)
        self._run(slot, lambda: slot.a2a.combine(out, c.routes, weights, slot.y, accumulate=bool(biases)))
        slot.state = COMBINED
        combined = out[:, :H].to(torch.bfloat16)
        combined_w = out[:, H:H + k].clone() if k is not None else None
        return combined, combined_w, _event(x.device, async_finish)

    # ---- the instances ------------------------------------------------------------------------------
    def _exchange(self, what: str, error, info, where: dict) -> list:
        """Every rank's verdict on its input and what it says of the call (one all-gather): any rejection
        raises on every rank before anything is sent. Each row also says which call it is (`what`, this
        rank's normal-mode call number, `where`'s detail): calls out of step (a rank that skipped its combine,
        or is in another collective) are refused on every rank, saying where each rank is, and the numbering
        is agreed again so that the next call every rank makes works."""
        self.seq += 1
        table = all_gather(self.buf.group, (_TAG, what, self.seq, where, None if error is None else str(error), info))
        step = _out_of_step(table, self.rank)
        if step is not None:
            self.seq = max([self.seq] + [row[2] for row in table if _is_row(row)])
            raise ValueError(f"rank {self.rank}: normal-mode {what} refused on every rank, nothing was sent: the "
                             f"calls are out of step ({step}). Every rank makes the same normal-mode calls in "
                             f"the same order (DeepEP's rule); the next call that every rank makes works")
        table = [row[3:] for row in table]
        rejected = [r for r, row in enumerate(table) if row[1] is not None]
        if error is not None:
            others = [r for r in rejected if r != self.rank]
            raise ValueError(f"{error} (rank {self.rank} refused this normal-mode {what} on every rank"
                             + (f", as did rank(s) {others}" if others else "") + "; nothing was sent)") from None
        if rejected:
            raise CallAborted(f"rank {self.rank}: this normal-mode {what} was refused on every rank by rank(s) "
                              f"{', '.join(map(str, rejected))}: {table[rejected[0]][1]}; nothing was sent")
        return [(row[1], row[2]) for row in table]

    def _set_for(self, H, S, K, T, R, device) -> _Set:
        for s in reversed(self.sets):
            if s.fits(H, S, K, T, R):
                return s
        same = [s for s in self.sets if s.H == H]
        T = max([T, 16] + [s.T for s in same])
        T = 1 << (T - 1).bit_length()
        K = max([K] + [s.K for s in same])
        R = max([R] + [s.R for s in same])
        S = max([S, ceil_div(H, FP8_BLOCK)] + [s.S for s in same])  # room for a later fp8 call's scales
        set_ = _Set(H, S, K, T, R)
        W = self.W
        cfg = A2AConfig(max_num_tokens=T, num_experts=W, experts_per_token=R, hidden_dim=set_.row_elems,
                        in_dtype=torch.bfloat16, scale_block=None, out_dtype=torch.float32,
                        expert_capacity=W * T)
        if self.buf.wire != "per_route":
            # The Buffer's wire, but fp32 combine rows always: they carry the top-k weights beside x, which fp8
            # blocks would round (and DeepEP's sums are exact).
            cfg = dataclasses.replace(wire_config(cfg, self.buf.wire), combine_fp8=False)
        opts = dict(self.buf._options)
        if opts["device"] is None:
            opts["device"] = canonical_device(device)
        built: list[AllToAll] = []
        try:
            with torch.device("cpu"):  # the construction's host tables are CPU tensors (DeepEP's test sets cuda)
                for _ in range(2):
                    built.append(AllToAll(cfg, **opts))
            set_.slots = [_Slot(a2a, set_.row_elems, T) for a2a in built]
        except BaseException:
            for a2a in built:
                a2a.close()
            raise
        self.sets.append(set_)
        return set_

    @staticmethod
    def _run(slot: _Slot, half) -> None:
        try:
            half()
        except BaseException:
            slot.state = FREE
            raise

    def _retire(self, slot: _Slot) -> None:
        """Before a slot's next dispatch: a call dispatched and never combined gets a combine of nothing."""
        if slot.state == DISPATCHED:
            T = slot.routes.shape[0]
            self._run(slot, lambda: slot.a2a.combine(slot.out[:T], slot.routes, slot.zero_w[:T], slot.y))
        slot.state = FREE

    def close(self) -> None:
        for s in self.sets:
            for slot in s.slots:
                slot.close()
        self.sets = []


# What a dispatch's ranks must agree on, in that order, and how the messages name it.
_DISPATCH_AGREE = (("cached", "handle (a cached dispatch or not)"), ("call", "handle (the dispatch it is of)"),
                   ("kind", "x (bf16, or an (fp8, scales) pair)"), ("H", "hidden (x.shape[1])"),
                   ("S", "the scale columns (x[1].shape[1])"), ("scale_dtype", "the scales' dtype (x[1].dtype)"),
                   ("k", "num_topk (topk_idx.shape[1]; None without topk_idx)"),
                   ("E", "num_experts (num_tokens_per_expert.shape[0])"))

# The first word of a normal-mode exchange row: a row without it is another collective of the group.
_TAG = "moe_a2a.compat normal mode"


def _is_row(row) -> bool:
    return isinstance(row, tuple) and len(row) == 6 and row[0] == _TAG and isinstance(row[2], int)


def _where(row) -> str:
    """Which call a rank's exchange row is of, in words."""
    if not _is_row(row):
        return f"not in a normal-mode call (its all-gather is another collective of the group: {type(row).__name__})"
    _, what, seq, where, _, _ = row
    if what == "combine":
        return f"at its combine (normal-mode call {seq}) of the handle of dispatch {where.get('handle')}"
    return f"at its {'cached ' if where.get('cached') else ''}dispatch (normal-mode call {seq})"


def _out_of_step(table: list, rank: int) -> str | None:
    """None when every row of one exchange is of the same call (kind and number), else where each rank is."""
    keys = [(row[1], row[2]) if _is_row(row) else None for row in table]
    if all(k is not None and k == keys[0] for k in keys):
        return None
    return "; ".join(f"rank {r}{' (this rank)' if r == rank else ''} is {_where(row)}" for r, row in enumerate(table))


def _route_weights(slot: _Slot, routes: torch.Tensor) -> dict:
    """The dispatch's `weights=` over a wire that reduces the combine at the experts' rank: 1 per route (the
    combine sums the rows unweighted, as DeepEP's), so they are known at the dispatch; else nothing."""
    if slot.a2a.cfg.combine_rows != "rank":
        return {}
    return {"weights": (routes >= 0).to(torch.float32)}


def _refuse_kwargs(kwargs, what: str) -> None:
    if kwargs:
        raise ValueError(f"unexpected arguments {sorted(kwargs)}: not arguments of DeepEP's {what}")


def _as_value_error(exc: Exception, what: str) -> ValueError:
    """A check's failure as the ValueError every rank is told of (never another type: a torch error raised
    while checking is said as what it was)."""
    if isinstance(exc, ValueError):
        return exc
    return ValueError(f"normal-mode {what}: its arguments could not be checked ({type(exc).__name__}: {exc})")


def _check_stream_args(previous_event, async_finish, allocate_on_comm_stream) -> None:
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True (as DeepEP)")


def _wait(previous_event) -> None:
    """DeepEP's `previous_event`: the call's work waits for it (on the current stream here: no comm stream)."""
    event = getattr(previous_event, "event", None)
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def _event(device, async_finish: bool):

    if async_finish and device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return EventOverlap(event)
    return _NO_EVENT


def _channel_prefix(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """DeepEP's `channel_prefix_matrix` `[W, num_channels]` int32: tokens to rank r in channels 0..c, channel c
    being tokens `[c * ceil(T / num_channels), ...)`."""
    T, W = is_token_in_rank.shape
    num_channels = max(num_channels, 1)
    per = -(-T // num_channels) if T else 0
    ends = torch.tensor([min(per * (c + 1), T) for c in range(num_channels)], dtype=torch.long,
                        device=is_token_in_rank.device)
    cum = torch.cat([torch.zeros(1, W, dtype=torch.int32, device=is_token_in_rank.device),
                     is_token_in_rank.to(torch.int32).cumsum(0, dtype=torch.int32)])
    return cum[ends].T.contiguous()
