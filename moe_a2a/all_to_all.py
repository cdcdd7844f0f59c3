"""`AllToAll`: the checks, the state and the four halves of expert-parallel dispatch and combine.

Data flows one way: model -> kernels -> (same node: peers' mapped memory; other nodes: proxy -> wire
-> proxy) -> kernels -> model. Construction (segment, proxies, buffer placement, bootstrap) is
`runtime.wiring`; what kernels and proxies report is read by `runtime.status`; the steps of a call are
docs/protocol.md. The kernels know nothing of the network and the proxy knows nothing of tokens.
"""
from __future__ import annotations

import threading
import torch

from .config import A2AConfig
from .protocol.segment import ShardWords
from .protocol.words import Flag, ShardWord, flag_word
from .proxy import nic_settings
from .runtime import options
from .runtime.checks import (canonical_device, check_combine_recv, check_combine_send, check_dispatch_inputs,
                             check_dispatch_outputs, check_quantize)
from .runtime.status import CallAborted, CapacityExceeded, FailureBoard, Status, watch_proxies
from .runtime.tracing import Tracer
from .runtime.wiring import Wiring
from .triton_kernels import combine as combine_kernels
from .triton_kernels import dispatch as dispatch_kernels
from .triton_kernels import relay as relay_kernels
from .triton_kernels import rank_rows, routing, write_plan
from .triton_kernels.node_sync import launch_wait_apart
from .triton_kernels.quant import Fp8Quantize

_IDLE, _DISPATCH_SENT, _DISPATCH_DONE, _COMBINE_SENT = range(4)
_STATE_NAMES = ("idle (next: dispatch send)", "dispatch sent (next: dispatch recv)",
                "dispatch received (next: combine send)", "combine sent (next: combine recv)")


class AllToAll:
    """Expert-parallel dispatch and combine over this rank's group (docs/design.md, API).

    Args:
        cfg: the sizes.
        group: torch.distributed process group used only for bootstrap (default WORLD).
        node_group: ranks that share memory with this one: "auto"/None (same hostname), an int
            (node size; ranks `[k*n, (k+1)*n)` form node k) or a process group (its size).
        transport: "auto" (efa if present, else shm on one host, tcp across hosts), "efa", "shm",
            "tcp" or "verbs" (libfabric's verbs;ofi_rxm: ConnectX; untested, no RDMA device here), or
            "emulated": simulated nodes of one host exchange their remote traffic through the proxies as
            over a NIC, carried by copies (an instrument; settings from MOE_A2A_EMULATED_NIC, read here:
            docs/transport.md, "The emulated NIC").
        device: where the model's tensors live (default: current CUDA device, else CPU); normalised once
            (`canonical_device`: "cuda" is the current CUDA device, "cpu:0" is "cpu"), `a2a.device` says which.
        timeout_s: every wait ends in a TimeoutError naming what was missing after this long.
        gpu_wait: on a GPU, how the halves wait: "kernel" (spinning on the stream: asynchronous, CUDA-graph
            safe), "host" (the CPU polls, then launches: for ranks that share a GPU) or "auto" (host when
            another rank uses the same GPU without MPS, else kernel; under MPS ranks sharing a GPU wait in
            one single-warp kernel per half, `triton_kernels/node_sync.py`).
        buffers: where the send/recv buffers live (`runtime/placement.py`): "staged" (this node's rows in
            GPU buffers shared by CUDA IPC, rows to and from other nodes staged in pinned shared host
            memory), "host" (all rows host-staged), "gpu" (GPU memory: CUDA IPC on one node, else cuMem
            FDs registered with the NIC, FI_HMEM_CUDA; raises if impossible), "memfd" (that path with
            host memory, for CPUs), "auto" (default: "gpu" over efa/verbs where it works, else "staged"
            with one log line saying why; "host" on a CPU).
        nics: the NICs (libfabric domains) this rank's proxies drive, peers sharded over them: "auto" (over
            efa or verbs the NICs under this rank's GPU's PCIe switch, its share of them, `a2a.nics.rule`
            and `.reason` saying how they were chosen; over tcp/shm the provider's first) or a list of names.
        proxies: proxy processes per rank, peer p carried by proxy p % k (`Layout.proxy_shard`): an int in
            [1, wire peers] or "auto" (one per NIC on EFA, else 1); the same on every rank (docs/protocol.md, 3.5).
            Under the relay every proxy carries every rail peer: each write goes as k pieces, piece j by proxy j
            (`Layout.wire_pieces`), so a rank's few rail writes use all its NICs; k up to 16 there.
        rank_mask: shrink mode (`runtime.shrink.RankMask`, shareable between instances): a peer that a
            wait times out on is masked instead of failing the call, which goes on without it; routes to
            masked ranks' experts are dropped (docs/protocol.md, section 6, shrink mode). The wait that masks
            is the host's (host waits) or, with kernel waits, the GPU's own (CUDA-graph safe; every rank on
            one node); the deadline is `timeout_s`. With remote peers: host waits on a GPU, and
            `cfg.max_private_tokens >= max_num_tokens * experts_per_token` (no shared remainder region, whose
            offsets would need every count row).

    Experts are contiguous per rank: rank r hosts experts [r*L, (r+1)*L), L = E / world_size.
    Not thread-safe; one call in flight per instance; every dispatch is followed by one combine.
    """

    def __init__(self, cfg: A2AConfig, group=None, node_group="auto", transport: str = "auto",
                 device=None, timeout_s: float = 30.0, gpu_wait: str = "auto", buffers: str = "auto",
                 nics="auto", proxies="auto", rank_mask=None) -> None:
        self._closed = True  # until the wiring exists: close() and __del__ have nothing to release
        self.plan = p = options.plan(cfg, group, node_group, transport, device, timeout_s, gpu_wait, buffers,
                                     nics, proxies, rank_mask)
        self.cfg, self.group, self.timeout_s, self.device = cfg, p.group, p.timeout_s, p.device
        self.rank, self.world_size, self.layout = p.rank, p.world_size, p.layout
        self.transport, self.nics, self.num_proxies = p.transport, p.nics, p.num_proxies
        self.emulated_nic, self.rank_mask = p.emulated_nic, p.rank_mask
        self._error: BaseException | None = None
        self._state, self.epoch = _IDLE, 0
        self._abort_scratch = None
        self._void_recv_owed = False  # an aborted call's combine receive, issued with the next call (_abort_call)
        self._checked_quantize = None  # (the last `quantize` given to dispatch, as checked: `check_quantize`)
        self._quantize = None  # the current call's (its receive half may write its scales apart)
        # Output sets a layer above owns, checked once (`register_dispatch_outputs`): by the ids of
        # (num, x, x_scale, source_ranges, quantized_scale, quantize), holding the objects so ids stay theirs.
        self._registered_outputs: dict[tuple, tuple] = {}
        self._watch_lock = threading.Lock()
        self._w = Wiring(p.layout, p.group, p.rank, p.device, p.transport, p.nics, p.num_proxies, p.buffers,
                         p.gpu_wait, p.timeout_s, local_only=p.local_only,
                         emulated_nic=None if p.emulated_nic is None else str(p.emulated_nic),
                         shrink=rank_mask is not None, shrink_mask=None if rank_mask is None else rank_mask.tensor)
        self._closed = False
        if self.emulated_nic is not None and self.with_proxy and self.rank == 0:
            carrier = "cuda" if self.placement == "nic" and self.device.type == "cuda" else "host"
            nic_settings.log_settings(self.emulated_nic, carrier)
        self._status, self._tracer = Status(self._w, cfg), Tracer(self._w)
        if rank_mask is not None:
            if self._w.device_shrink:  # the kernels' waits mask late peers in rank_mask.tensor (graph-safe)
                rank_mask.decided_on_device()
            else:
                self._status.enable_shrink(rank_mask)
        self._routes = None  # shrink mode: the routes this call's dispatch sent (masked ranks' dropped)
        self.route_slot = torch.full((cfg.max_num_tokens, cfg.experts_per_token), -1, dtype=torch.int32,
                                     device=self.device)
        # With remote peers the pack writes each route at its send row: a remote peer's first P routes go to
        # its private staging slot, behind the count row, so its private write is one range (config.Layout).
        self._send_row = torch.full_like(self.route_slot, -1) if self.with_proxy else None
        # Per-rank rows (cfg.dispatch_rows="rank"): the row each route opens.
        self._rank_slot = torch.full_like(self.route_slot, -1) if cfg.rank_rows else None
        if self.with_proxy:  # a peer whose proxy dies says so on the board: every rank stops within ~0.5 s
            # (Shrink mode: a peer that stopped is masked by the timeouts instead, never an error here.)
            board = FailureBoard.open(self.group, self.rank, self.world_size) if rank_mask is None else None
            watch_proxies(self, board)

    # ---- what the wiring decided (read-only) ---------------------------------------------------------
    @property
    def placement(self) -> str:
        """Where the send/recv buffers are: "ipc", "nic", "staged" or "host" (`runtime.placement`)."""
        return self._w.placement

    @property
    def placement_reason(self) -> str | None:
        """Why GPU buffers were given up for staged ones (None when they were not)."""
        return self._w.placement_reason

    @property
    def proxy_cpus(self) -> list[tuple[int, list[int], str | None]]:
        """(shard, CPUs it may run on, why) for each proxy process of this rank (empty: none, or closed)."""
        return [(h.spec.shard, list(h.cpus), h.cpus_reason) for h in self._w.proxies]

    @property
    def fabric_info(self) -> list[dict]:
        """What each proxy's engine runs on, in shard order (`TransferEngine.fabric_info`: the libfabric
        loaded, its path, version and the API requested, provider, domains, FI_HMEM, threading...); empty
        without proxies, once closed, or on the emulated NIC."""
        return [dict(h.fabric_info) for h in self._w.proxies if h.fabric_info]

    @property
    def with_proxy(self) -> bool:
        """True when some peers are on other nodes: the proxy carries their rows."""
        return self._w.with_proxy

    @property
    def node_local(self) -> bool:
        """True when every rank is on this node: the proxy takes no part in the calls."""
        return not self._w.with_proxy

    @property
    def host_staged(self) -> bool:
        """True when rows to and from other nodes go through send/recv buffers in the shared segment."""
        return self.placement in ("host", "staged")

    @property
    def proxies(self) -> list:
        """This rank's proxy process handles (`runtime.proxy_handle.ProxyHandle`; empty after close)."""
        return self._w.proxies

    @property
    def host_waits(self) -> bool:
        """True when this rank's host polls before each launch (CPU, or ranks sharing a GPU)."""
        return self._w.ready_words is not None

    # ---- the wiring's addresses and views (read-only; tests and benchmarks look at them) -----------------
    @property
    def segment(self):
        """This rank's shared segment (`protocol.memory.SharedSegment`): flags, sync area, host-staged rows."""
        return self._w.segment

    @property
    def base(self):
        """uint8 view from the lowest address any kernel touches; every offset below is from it."""
        return self._w.base

    @property
    def send_offset_bytes(self):
        """Where this rank's send buffer starts, from `base`."""
        return self._w.send_offset_bytes

    @property
    def recv_offset_bytes(self):
        """Where this rank's receive buffer starts, from `base`."""
        return self._w.recv_offset_bytes

    @property
    def stage_send_offset_bytes(self):
        """Where rows to other nodes are staged, from `base` (the send buffer unless split by node)."""
        return self._w.stage_send_offset_bytes

    @property
    def stage_recv_offset_bytes(self):
        """Where rows from other nodes land, from `base` (the receive buffer unless split by node)."""
        return self._w.stage_recv_offset_bytes

    @property
    def node_slots(self):
        """Split by node: `[2]` int32, this node's slot range as the route kernel reports it (else None)."""
        return self._w.node_slots

    @property
    def counts(self):
        """`[W, E]` int32: every source's count row, as the sync area holds them."""
        return self._w.counts

    @property
    def flags(self):
        """The flags area on the device (int64 words, `protocol.words.Flag`)."""
        return self._w.flags

    @property
    def flags_host(self):
        """The flags area as a CPU tensor."""
        return self._w.flags_host

    @property
    def epoch_dev(self):
        """`[1]` int64 on the GPU: the call number kernel waits read (None on a CPU)."""
        return self._w.epoch_dev

    @property
    def peer_send_bytes(self):
        """`[W]` int64: node peers' send buffers from `base` (-1: a remote peer)."""
        return self._w.peer_send_bytes

    @property
    def peer_recv_bytes(self):
        """`[W]` int64: node peers' receive buffers from `base` (-1: a remote peer)."""
        return self._w.peer_recv_bytes

    @property
    def device_sync(self):
        """True when the sync area is in device memory (every rank on one node, kernel waits)."""
        return self._w.device_sync

    # ---- public API ---------------------------------------------------------------------------
    def empty_dispatch_outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(out_expert_num_tokens int32[L], out_expert_x [max_rows, H] in_dtype,
        out_expert_x_scale [max_rows, num_scales] float32 | None)` on this rank's device, sized for
        the worst case (`Layout.max_dispatch_rows`). The scales' rows are 64-byte aligned (row stride
        `cfg.scale_row_words`): the unpack then writes them with vector stores (H200: 10 µs, not 12.5, at
        decode)."""
        cfg, lay = self.cfg, self.layout
        rows = lay.max_dispatch_rows
        num = torch.zeros(lay.num_local_experts, dtype=torch.int32, device=self.device)
        x = torch.zeros(rows, cfg.hidden_dim, dtype=cfg.in_dtype, device=self.device)
        xs = None
        if cfg.has_scales:
            xs = torch.zeros(rows, cfg.scale_row_words, dtype=torch.float32, device=self.device)[:, :cfg.num_scales]
        return num, x, xs

    def register_dispatch_outputs(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale,
                                  out_source_ranges=None, out_quantized_scale=None, quantize=None) -> None:
        """Check a set of `dispatch` outputs once (ValueError as `dispatch` says) and remember it: a later
        dispatch given these very objects (and this `quantize` object) skips their check. For layers above
        that own their output buffers and never change their shapes in place (`moe_a2a.compat`'s slots);
        the instance holds them until it is closed. `quantize`: None or an `Fp8Quantize` (frozen: a dict of
        its fields could change after the check)."""
        self._ready()
        if quantize is not None and not isinstance(quantize, Fp8Quantize):
            raise ValueError(f"quantize: expected None or a quant.Fp8Quantize to register outputs with, got "
                             f"{type(quantize).__name__}")
        checked = check_quantize(self.cfg, quantize, None)[0]
        check_dispatch_outputs(self.cfg, self.layout, self.device, out_expert_num_tokens, out_expert_x,
                               out_expert_x_scale, out_source_ranges, out_quantized_scale, checked)
        outputs = (out_expert_num_tokens, out_expert_x, out_expert_x_scale, out_source_ranges, out_quantized_scale,
                   quantize)
        self._registered_outputs[tuple(map(id, outputs))] = outputs

    def dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, x, x_scale, indices,
                 bound_m=None, do_send: bool = True, do_recv: bool = True, *, quantize=None,
                 out_source_ranges=None, weights=None, out_quantized_scale=None) -> None:
        """Send every token to the ranks hosting its experts; receive this rank's tokens expert-major.

        Args:
            out_expert_num_tokens: `[L]` int32, written by the receive half: routes per local expert.
            out_expert_x: `[>= max_dispatch_rows, H]` in_dtype; expert l's rows start at
                `sum_{j<l} round_up(n_j, expert_padding)`, ordered by (source rank, token, k);
                padding rows untouched. Valid after the receive half.
            out_expert_x_scale: `[>= max_dispatch_rows, num_scales]` float32 (any strides), or None without
                scales. With `expert_capacity` C also `[L, C, num_scales]` float32 of any strides: row l*C + c's
                scales go to `[l, c, :]` (e.g. DeepEP's column-major layout, written by the unpack itself).
            x: `[T, H]` in_dtype, T <= max_num_tokens.  x_scale: `[T, num_scales]` float32 or None.
            indices: `[T, K]` int32/int64 expert ids, `-1` = not routed.
            bound_m: optional 1-element int32 tensor on the device: live tokens (CUDA graphs).
            do_send / do_recv: run the send half, the receive half, or both (default).
            quantize: fp8 quantisation fused into the send half's pack (`triton_kernels.quant.Fp8Quantize`
                or a dict of its fields; in_dtype bf16/fp16/fp32): each row sent carries, in its payload
                bytes, x[t]'s fp8 e4m3 bytes at [0, H) and its scales from `scale_offset_bytes`, as
                `quant.quantize_fp8(x, block, round_scale=, ue8m0=)` writes them (the rest of the row's
                payload bytes are unspecified); `x_scale` travels as without it. The receiver reads those
                bytes out of `out_expert_x` (views); its unpack copies only them (every rank of a call
                passes the same `quantize`). Used by the send half only, like `x`. Required (ValueError
                without it) when `A2AConfig.payload_bytes` makes the rows narrower than a token: then
                every row is only these bytes, at half a bf16 row's stride.
            out_source_ranges: optional `[L, W]` int64 (contiguous), written by the receive half:
                `(begin << 32) | count` per (local expert l, source rank s): expert l's rows from s are
                its rows [begin, begin + count) (DeepEP's `layout_range`; in the unpack's launch).
            out_quantized_scale: optional, with a `quantize`d call: its scales in a tensor of their own,
                written by the receive half's unpack: `[>= max_dispatch_rows, n]` or, with `expert_capacity` C,
                `[L, C, n]`, any strides (e.g. DeepEP's column-major layout), n = `quantize.scale_bytes(H) / 4`
                words, float32 (fp32 scales) or int32 (UE8M0 codes, four per word); the rows then get only the
                fp8 bytes [0, H) (with `dispatch_rows="rank"` the expand writes them row by row: no per-expert
                tiles for a column-major layout, as the route rows' unpack has).
            weights: `[T, K]` float32, the routes' weights: required with `cfg.combine_rows="rank"` (they
                travel with the rows, and the experts' rank applies them; `combine`'s `weights` are then
                checked but not read), None otherwise.

        Bad input raises ValueError before anything of it is sent and aborts the call on every rank (its
        peers raise `CallAborted` naming this rank; the next call works; docs/protocol.md, section 6). Bad
        receive outputs alone (`do_send=False`) leave the call open for a corrected receive. On a GPU the
        call is asynchronous and CUDA-graph safe with `bound_m`; index values and `bound_m` are checked on
        the device (no host sync) and reported at the end of the following combine or by `check()`.
        """
        self._ready()
        if do_send:
            self._expect(_IDLE, "dispatch(do_send=True)")
            try:
                check_dispatch_inputs(self.cfg, self.device, x, x_scale, indices, bound_m, weights)
                given = quantize
                quantize, self._checked_quantize = check_quantize(self.cfg, quantize, self._checked_quantize)
                if do_recv and (id(out_expert_num_tokens), id(out_expert_x), id(out_expert_x_scale),
                                id(out_source_ranges), id(out_quantized_scale), id(given)) \
                        not in self._registered_outputs:
                    check_dispatch_outputs(self.cfg, self.layout, self.device, out_expert_num_tokens, out_expert_x,
                                           out_expert_x_scale, out_source_ranges, out_quantized_scale, quantize)
            except ValueError as exc:
                self._abort_call(exc)  # raises exc, once the call is void on every rank
        elif do_recv:
            self._expect(_DISPATCH_SENT, "dispatch(do_recv=True)")
            # Nothing is lost: the send half is done, a corrected receive may follow.
            check_dispatch_outputs(self.cfg, self.layout, self.device, out_expert_num_tokens, out_expert_x,
                                   out_expert_x_scale, out_source_ranges, out_quantized_scale, self._quantize)
        try:
            if do_send:
                self._tracer.run("dispatch_send", self.epoch, self._dispatch_send, x, x_scale, indices, bound_m,
                                 quantize, False, weights)
            if do_recv:
                self._tracer.run("dispatch_recv", self.epoch, self._dispatch_recv, out_expert_num_tokens,
                                 out_expert_x, out_expert_x_scale, False, out_source_ranges, out_quantized_scale)
        except (CallAborted, CapacityExceeded):  # the call ended on every rank: the instance stays usable
            raise
        except BaseException as exc:
            self._fail(exc)

    def combine(self, out_tokens, indices, weights, expert_y, bound_m=None, do_send: bool = True,
                do_recv: bool = True, accumulate: bool = False) -> None:
        """Send expert outputs home; form `out_tokens[t] = sum_k weights[t,k] * y(t,k)`.

        Args:
            out_tokens: `[T, H]` out_dtype (T as in the dispatch); rows of tokens >= live count untouched.
            indices: `[T, K]` as given to `dispatch` (the routes are remembered from it).
            weights: `[T, K]` float32.
            expert_y: `[>= max_dispatch_rows, H]` out_dtype: row i is the expert output of row i
                of `out_expert_x` from `dispatch` (padding rows are never read). With `expert_capacity` C
                (rows by expert) also `[L, C, H]` with strides `(C * s, s, 1)` (e.g. contiguous).
            accumulate: add to the old `out_tokens` (in fp32, before the k terms) instead of overwriting.
            bound_m: optional `[1]` int32 on the device: tokens t >= bound_m[0] are left untouched (default:
                the dispatch's); its value is checked ([0, T]) on a CPU, as the dispatch's.

        Bad input aborts the call on every rank, as in `dispatch` (a bad receive half alone leaves it open).
        """
        self._ready()
        cfg = self.cfg
        if do_send:
            self._expect(_DISPATCH_DONE, "combine(do_send=True)")
            try:
                check_combine_send(cfg, self.layout, self.device, expert_y)
                if do_recv:
                    check_combine_recv(cfg, self.device, self._T, out_tokens, weights, indices, bound_m)
            except ValueError as exc:
                self._abort_at_combine(exc)  # raises exc, once the call is void on every rank
        elif do_recv:
            self._expect(_COMBINE_SENT, "combine(do_recv=True)")
            # The send half is done and its rows are with their homes: a corrected receive may follow.
            check_combine_recv(cfg, self.device, self._T, out_tokens, weights, indices, bound_m)
        try:
            if do_send:
                self._tracer.run("combine_send", self.epoch, self._combine_send, expert_y)
            if do_recv:
                self._tracer.run("combine_recv", self.epoch, self._combine_recv, out_tokens, weights, accumulate,
                                 bound_m)
        except BaseException as exc:
            self._fail(exc)
        if do_recv:
            # What kernels recorded of this call: said once it is issued on every rank (so raising here never
            # leaves this rank a call behind its peers), and after its kernels ran (so never by a later call).
            if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                try:
                    self._status.await_call_end(self.epoch)
                except BaseException as exc:  # a failed kernel wait or proxy: the instance is unusable
                    self._fail(exc)
            self._raise_recorded()

    def abort(self, reason: str) -> None:
        """Abort the next call on every rank, as bad input to `dispatch` does: this rank takes part in it
        with nothing (so its peers finish it and raise `CallAborted` naming it) and then raises
        `ValueError(reason)`. For layers above (`moe_a2a.compat`) that reject their own input before
        calling `dispatch`. Needs the instance idle (between calls), or with the dispatch received and
        the combine not begun: then it aborts that call at its combine, as bad input to `combine` does."""
        self._ready()
        if self._state == _DISPATCH_DONE:
            self._abort_at_combine(ValueError(reason))
        self._expect(_IDLE, "abort()")
        self._abort_call(ValueError(reason))

    def check(self) -> None:
        """Raise what went wrong in calls already issued (for CUDA-graph users, whose replays make no host
        call): waits for the device, then raises a fatal failure (a kernel wait, the proxy), then, once each,
        what leaves the instance usable: an abort (`CallAborted`, `CapacityExceeded`), a bad index or bound."""
        self._ready()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._raise_fatal_once()
        self._raise_recorded()

    def writes_posted(self, per_proxy: bool = False) -> dict[str, int] | list[dict[str, int]]:
        """RDMA writes this rank's proxies have posted so far, per phase: `{"dispatch": n, "combine": m}`
        (cumulative, summed over the proxies; zero when every rank is on one node). After the proxies
        finished a call's phase. `per_proxy=True`: one such dict per proxy (proxy j posts to the remote
        peers `Layout.proxy_shard` gives it)."""
        out = [{"dispatch": int(self._w.flags_np[flag_word(Flag.DISPATCH_WRITES_POSTED)]),
                "combine": int(self._w.flags_np[flag_word(Flag.COMBINE_WRITES_POSTED)])}]
        if self.num_proxies > 1:  # the primary counts in the flags, the others in their shard words
            words = ShardWords(self.segment, self.layout)
            out += [{"dispatch": words.get(j, ShardWord.DISPATCH_POSTED),
                     "combine": words.get(j, ShardWord.COMBINE_POSTED)} for j in range(1, self.num_proxies)]
        if per_proxy:
            return out
        return {phase: sum(d[phase] for d in out) for phase in ("dispatch", "combine")}

    def bytes_last_call(self) -> dict[str, dict[str, int]]:
        """This rank's bytes of the last call per phase, sent and received, node-local and remote:
        `{"dispatch": {"node_sent", "remote_sent", "node_received", "remote_received"}, "combine": {...}}`
        (`runtime.traffic.call_bytes` defines them). Reads the count matrix on the host (a sync: not for
        the hot path); valid once the call's combine returned, until a node peer starts the next call."""
        from .runtime import traffic  # the accessors' module, imported where they are used
        return traffic.bytes_last_call(self)

    @property
    def buffer_bytes(self) -> dict:
        """Bytes this instance holds: send, recv and segment, in device and host memory
        (`runtime.traffic.buffer_bytes`; `moe-a2a sizes` prints them for any sizes)."""
        from .runtime import traffic
        return traffic.buffer_bytes(self.layout, self.placement, self.device.type)

    def set_tracing(self, on: bool = True) -> None:
        """Record timestamps of every call (model halves and proxy steps) for `trace()` (`runtime.tracing`):
        off by default and free when off."""
        self._tracer.set(on)

    def trace(self, latest: bool = False) -> dict:
        """The last traced call: `{"rank", "epoch", "node_local", "model": {half: (t0_ns, t1_ns)}, "proxy":
        {event: t_ns}}` (no proxy events when the calls are node-local: the proxy takes no part),
        CLOCK_MONOTONIC nanoseconds (one clock for every process of this machine). On a GPU the model's
        spans are when the stream reached the start and the end of each half (mapped from %globaltimer,
        within ~1 µs). `latest=True`: the last call the stream stamped, whatever the host's epoch (CUDA-graph
        replays advance the epoch on the device only). ValueError after `close()` (the stamps are gone)."""
        if self._closed:
            raise ValueError("AllToAll is closed: trace() reads the shared segment, released by close()")
        return self._tracer.last(self.epoch, latest, self.node_local,
                                 lambda: self.with_proxy and self._state == _IDLE and self.epoch > 0)

    def close(self) -> None:
        """Stop the proxy (and remove the files it left in /dev/shm, even if it was killed), release
        shared memory. Idempotent (also after a failed construction); also `with AllToAll(...) as a2a:`.
        After it, every call and `trace()` raise ValueError("AllToAll is closed")."""
        if self._closed:
            return
        with self._watch_lock:  # the proxy watch thread writes into the segment: not once it is unmapped
            self._closed = True
        if self.device.type == "cuda":
            # Work already on the stream (a graph replay included) still reads and writes these buffers.
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - a broken context must not keep the files and proxy alive
                pass
        self._w.release()
        self._registered_outputs = {}  # the layer above's buffers are theirs to free

    def __enter__(self) -> "AllToAll":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- the four halves ----------------------------------------------------------------------------
    # Each half is its kernels; they wait in their prologue and signal in their epilogue
    # (triton_kernels/node_sync.py; the steps and flags: docs/protocol.md, section 3).
    def _dispatch_send(self, x, x_scale, indices, bound_m, quantize=None, abort: bool = False, weights=None) -> None:
        w = self._w
        if self._void_recv_owed:
            self._finish_void_recv()
        self.epoch += 1
        self._T, self._bound_m = x.shape[0], bound_m
        # A quantised call's rows hold fp8 bytes and scales only: the unpack copies just those.
        self._copy_bytes = None if quantize is None else quantize.row_bytes(self.cfg.hidden_dim)
        self._quantize = quantize
        self._status.host_wait("dispatch_send", self.epoch)
        slot = self.route_slot[: x.shape[0]]
        if self.rank_mask is not None:  # routes to masked ranks' experts are not sent
            kept = self.rank_mask.drop_routes(indices, self.layout.num_local_experts)
            self._routes = kept if kept is not indices else indices.clone()  # the caller may edit theirs
            indices = kept
        on_gpu = self.device.type == "cuda"
        rows, staged = slot, {}
        if self.with_proxy:  # a remote peer's first P rows (routes, or per-rank rows) are staged privately
            rows = self._send_row[: x.shape[0]]
            staged = {"out_send_row": rows, "private_stage": (self.layout, self.rank)}
        by_rank = self.cfg.rank_rows
        ranks = None
        if by_rank:  # one row per (token, rank) at its slot (or private staging row), routed in the same launches
            opened = self._rank_slot[: x.shape[0]]
            relay = {"rank": self.rank} if self.layout.relay else {}  # rows to other nodes go to the relays
            node = w.rank_split["route"]
            ranks = routing.RankRoutes(self.layout, w.rank_rows[self.rank], opened, **relay,
                                       out_node_slots=node.get("out_node_slots"),
                                       node_ranks=node.get("node_experts", (0, 0)), **staged)
        routing.route_tokens(indices, self.cfg.num_experts, out_counts=w.own_counts, out_route_slot=slot,
                             bound_m=bound_m, epoch=w.node.epoch, bad_index=w.bad_index if on_gpu else None,
                             ready=w.route_ready if self.with_proxy else None, abort=abort,
                             bad_bound_m=w.bad_bound_m if on_gpu else None, **w.split["route"],
                             **({} if by_rank else staged), ranks=ranks)
        if by_rank:  # the pack writes the rows' metadata too, before its count-row copy and publish, so peers
            # read rows and metadata together
            if not self.with_proxy:
                rows = opened
            meta = {"row_meta": rank_rows.row_meta_args(indices, slot, w.own_counts, weights, self.cfg, self.layout,
                                                        **relay)}
        if self.with_proxy:  # the proxy posts the private writes this plans once the pack says SEND_READY
            write_plan.plan_private_writes(w.counts, w.write_tables, w.node.epoch, w.flags, self.rank,
                                           self.layout, w.base, w.stage_send_offset_bytes)
        dispatch_kernels.pack_tokens_by_expert(x, x_scale, rows, w.base, w.send_offset_bytes, self.cfg,
                                               bound_m=bound_m, node=w.node, quantize=quantize,
                                               max_slots=self.layout.send_rows + self.layout.private_stage_rows,
                                               **(w.rank_split if by_rank else w.split)["pack"],
                                               **(meta if by_rank else {}))
        self._state = _DISPATCH_SENT

    def _dispatch_recv(self, out_num, out_x, out_x_scale, aborting: bool = False, out_source_ranges=None,
                       out_quantized_scale=None) -> None:
        w = self._w
        if self.with_proxy:  # once every count row is in: the remainder and combine writes for the proxy
            self._status.host_wait("dispatch_plan", self.epoch)
            write_plan.plan_remainder_and_combine_writes(w.counts, w.write_tables, w.node, w.base,
                                                         w.stage_recv_offset_bytes, self.rank, self.layout,
                                                         combine_rank=self.cfg.combine_rows == "rank",
                                                         relay_recv_bytes=w.relay_recv_bytes)
        self._status.host_wait("dispatch_recv", self.epoch)
        aborted = self._status.aborted_sources(self.epoch)
        if self.cfg.rank_rows:
            relay = {"peer_recv_bytes": w.peer_stage_recv_bytes} if self.layout.relay else {}  # relayed rows
            split = out_quantized_scale is not None  # the scales to a tensor of their own (as `_unpack`)
            rank_rows.expand_rank_rows(out_num, out_x, out_x_scale, w.counts, w.rank_rows, self.rank, w.base,
                                       w.peer_send_bytes, w.stage_recv_offset_bytes, self.cfg, self.layout, node=w.node,
                                       copy_bytes=self.cfg.hidden_dim if split else self._copy_bytes,
                                       out_source_ranges=out_source_ranges, quantize=self._quantize if split else None,
                                       out_quantized_scale=out_quantized_scale, out_row_plan=w.row_plan, **relay)
        else:
            self._unpack(out_num, out_x, out_x_scale, out_source_ranges, out_quantized_scale)
        self._state = _DISPATCH_DONE
        if aborting:
            return
        self._after_unpack(aborted)

    def _unpack(self, out_num, out_x, out_x_scale, out_source_ranges, out_quantized_scale=None) -> None:
        w = self._w
        split = out_quantized_scale is not None  # the scales to a tensor of their own: the rows get the fp8 bytes
        dispatch_kernels.unpack_tokens_by_expert(
            out_num, out_x, out_x_scale, w.counts, self.rank, w.base, w.peer_send_bytes,
            w.stage_recv_offset_bytes, self.cfg, self.layout, node=w.node,  # remote sources' rows
            copy_bytes=self.cfg.hidden_dim if split else self._copy_bytes, out_source_ranges=out_source_ranges,
            quantize=self._quantize if split else None, out_quantized_scale=out_quantized_scale)

    def _after_unpack(self, aborted) -> None:
        # CPU kernels have run: an expert over capacity is known now (a GPU says it at the end of combine).
        over = self._status.capacity_exceeded() if self.device.type != "cuda" and self.layout.expert_capacity else None
        if over or aborted:
            # A host that waits knows now: finish the call's combine half here (it moves nothing that
            # counts; over capacity, the unpack kernel has marked the call void for the combine to tell every
            # peer), so every rank ends the call together and the next one starts clean.
            self._finish_void()
            self._status.abort_seen = self.epoch
            if over:
                raise CapacityExceeded(f"{over} (epoch {self.epoch}: the call was aborted on every rank; the "
                                       f"next proceeds normally)")
            raise CallAborted(self._status.aborted_message(self.epoch, aborted))

    def _finish_void(self) -> None:
        """The combine half of a void call, into scratch buffers: peers' waits are met, nothing counts."""
        scratch = self._scratch()
        self._combine_send(scratch["y"])
        self._combine_recv(scratch["out"][: self._T], scratch["w"][: self._T], False, self._bound_m)

    def _combine_send(self, expert_y) -> None:
        w = self._w
        self._status.host_wait("combine_send", self.epoch)
        if self.cfg.combine_rows == "rank":
            lay, stage = self.layout, w.stage_send_offset_bytes + self.layout.combine_stage_offset_bytes
            if expert_y.dim() == 3:  # [L, C, H] rows by expert (checked: strides (C * s, s, 1)): its L * C rows
                expert_y = expert_y.view(-1, expert_y.shape[2])
            rank_rows.reduce_rank_rows_by_source(
                expert_y, w.counts, w.rank_rows, self.rank, w.base, w.peer_send_bytes, w.peer_recv_bytes,
                w.stage_recv_offset_bytes, stage, self.cfg, lay, node=w.node, row_plan=w.row_plan,
                **({"partial_bytes": w.send_offset_bytes + lay.relay_partial_offset_bytes,
                    "relay_recv_bytes": w.peer_stage_recv_bytes} if lay.relay else {}))
            if lay.relay and self.with_proxy:  # the node's partials of the rows this rank relayed, staged for home
                self._status.host_wait("combine_relay", self.epoch)
                relay_kernels.reduce_relayed_rows(w.rank_rows, self.rank, w.base, w.peer_partial_bytes,
                                                  w.stage_recv_offset_bytes, stage, self.cfg, lay, node=w.node)
            self._state = _COMBINE_SENT
            return
        combine_kernels.pack_combine_by_source(
            expert_y, w.counts, self.rank, w.base, w.peer_recv_bytes,
            w.stage_send_offset_bytes + self.layout.combine_stage_offset_bytes, self.cfg, self.layout, node=w.node)
        self._state = _COMBINE_SENT

    def _combine_recv(self, out_tokens, weights, accumulate, bound_m) -> None:
        w = self._w
        self._status.host_wait("combine_recv", self.epoch)
        if self.rank_mask is not None:  # experts of ranks masked during this call sent nothing: skip them
            if w.device_shrink:  # the wait that may mask them first, then the slots dropped by the device mask
                launch_wait_apart(w.node, "combine_recv", w.base)
            self.rank_mask.drop_route_slots(self.route_slot[: self._T], self._routes, self.layout.num_local_experts)
        if self.cfg.combine_rows == "rank":
            rank_rows.reduce_rank_rows_by_token(out_tokens, self._rank_slot[: self._T], w.base,
                                                w.recv_offset_bytes + self.layout.combine_recv_offset_bytes, self.cfg,
                                                accumulate=accumulate,
                                                bound_m=bound_m if bound_m is not None else self._bound_m, node=w.node,
                                                **w.rank_split["reduce"])
            self._state = _IDLE
            return
        combine_kernels.reduce_combined_tokens(
            out_tokens, self.route_slot[: self._T], weights, w.base,
            w.recv_offset_bytes + self.layout.combine_recv_offset_bytes, self.cfg, accumulate=accumulate,
            bound_m=bound_m if bound_m is not None else self._bound_m, node=w.node, **w.split["reduce"])
        self._state = _IDLE

    # ---- aborted calls ------------------------------------------------------------------------------
    def _abort_call(self, exc: ValueError) -> None:
        """This rank's input was rejected: take part in the call with no tokens and a count row of -1
        (both halves, into scratch buffers), so every peer finishes it and reports the abort; then
        raise `exc`. Nothing of the rejected input is read."""
        scratch = self._scratch()
        try:
            self._dispatch_send(scratch["x"], scratch["xs"], scratch["idx"], None, abort=True,
                                weights=scratch["w"][:0] if self.cfg.combine_rows == "rank" else None)
            self._dispatch_recv(scratch["num"], scratch["ex"], scratch["exs"], aborting=True)
            self._combine_send(scratch["y"])
        except BaseException as inner:
            self._fail(inner)
        # Its combine receive only waits for the peers' combine of this call, which a peer with kernel waits
        # issues when it learns of the abort (check(), or its own combine): until then it may run calls of other
        # instances (DeepEP's two calls in flight), which this rank's stream must not hold up behind that wait.
        self._state, self._void_recv_owed = _IDLE, True
        self._status.abort_seen = self.epoch
        raise ValueError(f"{exc} (rank {self.rank} aborted this call, epoch {self.epoch}, on every rank: it sent "
                         f"nothing; the next call proceeds normally)") from None

    def _abort_at_combine(self, exc: ValueError) -> None:
        """This rank's combine input was rejected: finish the call with scratch buffers, telling every peer
        the call is void (CALL_ABORTED: node peers through the combine pack, remote ones through the
        proxy's immediates), then raise `exc`."""
        self._mark_aborted()
        try:
            self._finish_void()
        except BaseException as inner:
            self._fail(inner)
        self._status.abort_seen = self.epoch
        raise ValueError(f"{exc} (rank {self.rank} aborted this call, epoch {self.epoch}, on every rank at its "
                         f"combine; the next call proceeds normally)") from None

    def _finish_void_recv(self) -> None:
        """The combine receive an aborted call left to this one: wait for the peers' combine of it (no rows)."""
        self._void_recv_owed = False
        scratch = self._scratch()
        self._combine_recv(scratch["out"][:0], scratch["w"][:0], False, None)

    def _mark_aborted(self) -> None:
        """This call is void from this rank: its combine pack tells the node peers (the device word), its
        proxy the remote ones (the flag). Both before the combine pack is launched."""
        self._w.node.aborted.fill_(self.epoch)
        self._w.segment_flags[Flag.CALL_ABORTED] = self.epoch

    def _scratch(self) -> dict:
        """Buffers of an aborted call, made on the first one (`void_call_buffers`)."""
        if self._abort_scratch is None:
            self._abort_scratch = void_call_buffers(self.cfg, self.layout, self.device)
        return self._abort_scratch

    # ---- errors, state, validation --------------------------------------------------------------------
    def _raise_recorded(self) -> None:
        self._status.raise_recorded(self.epoch)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        raise exc

    def _ready(self) -> None:
        if self._closed:
            raise ValueError("AllToAll is closed")
        if self._error is not None:
            raise RuntimeError(f"AllToAll is unusable after an earlier error: {self._error!r}") from self._error
        if self.device.type == "cuda":
            self._raise_fatal_once()
            if self.host_waits and torch.cuda.is_current_stream_capturing():
                raise ValueError("this rank waits on the host (gpu_wait='host', or another rank shares its GPU), "
                                 "and a host wait cannot be captured in a CUDA graph: use one GPU per rank and "
                                 "gpu_wait='kernel' or 'auto'")

    def _raise_fatal_once(self) -> None:
        try:
            self._status.raise_fatal(self.epoch)
        except BaseException as exc:
            self._error = exc
            raise

    def _expect(self, state: int, call: str) -> None:
        if self._state != state:
            raise ValueError(f"{call}: called out of order; the instance is {_STATE_NAMES[self._state]}")


def void_call_buffers(cfg: A2AConfig, lay, dev) -> dict:
    """Buffers of an aborted call: no tokens in; one row out, since the kernels never write or read past
    the rows they are given (the call's outputs are void)."""
    T, K, H = cfg.max_num_tokens, cfg.experts_per_token, cfg.hidden_dim

    def scales(rows):
        return torch.zeros(rows, cfg.num_scales, dtype=torch.float32, device=dev) if cfg.has_scales else None

    return {"x": torch.zeros(0, H, dtype=cfg.in_dtype, device=dev), "xs": scales(0),
            "idx": torch.zeros(0, K, dtype=torch.int32, device=dev),
            "num": torch.zeros(lay.num_local_experts, dtype=torch.int32, device=dev),
            "ex": torch.zeros(1, H, dtype=cfg.in_dtype, device=dev), "exs": scales(1),
            "y": torch.zeros(1, H, dtype=cfg.out_dtype, device=dev),
            "out": torch.zeros(T, H, dtype=cfg.out_dtype, device=dev),
            "w": torch.zeros(T, K, dtype=torch.float32, device=dev)}


__all__ = ["AllToAll", "CallAborted", "CapacityExceeded", "canonical_device"]
