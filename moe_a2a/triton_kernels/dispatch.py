"""Dispatch data movement: pack tokens expert-major into the send buffer, unpack received rows.

Payloads are opaque bytes. Every tensor is viewed as *words* (int32, int16 or uint8: the widest
that divides every row length, stride and offset the launcher can see), so fp8, bf16, fp16 and fp32
payloads share one kernel and a copy is bitwise. Rows in the send/recv buffers start 16-byte aligned
(`A2AConfig` strides; buffer offsets are multiples of 16), so when the host can also prove that for the
other side the kernels hint `tl.multiple_of` and the compiler emits 16-byte accesses on GPU.

Buffers of several ranks (this rank's send/recv buffers, a same-node peer's buffer mapped into this
process) are addressed as int64 byte offsets from ONE uint8 tensor `base`: on GPU everything lives in
one UVA space, and under `TRITON_INTERPRET=1` raw host addresses work the same way.

- `pack_tokens_by_expert`: x[t] (+ its fp32 scales) -> `send + route_slot[t, k] * Sd` for every live k.
  Each token is read once and written K times.
- `unpack_tokens_by_expert`: the rows every source sent to this rank -> `out_expert_x` in the order of
  `reference.dispatch`. All offsets come from the `[W, E]` count matrix, on the device: no host sync,
  nothing computed on the host per call, so it can be captured in a CUDA graph.

The per-(source, local expert) tables are built by the `@triton.jit` helpers `_recv_pair_tables`,
`_node_peer_tables` and `_tile_rows` below, and rows move through `_copy_row_words`;
`combine.pack_combine_by_source` reuses them, so both directions agree on every row by construction.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..config import A2AConfig, Layout, ceil_div, next_power_of_2

# Persistent programs per SM of the unpack / combine-pack kernels. Measured on H200 (W=64 layout,
# decode T=128 and prefill T=4096): 1 beats 2 and 4 (decode unpack 8.3 vs 10.2 / 13.0 us).
PROGRAMS_PER_SM = 1
# Programs of those kernels without a GPU (interpreter): few, but more than one, so the persistent
# loop's stride is exercised.
CPU_PROGRAMS = 3
# Largest copy chunk of one row, in bytes: 2 KB = 4 warps x 32 lanes x 16 bytes, one vector per lane.
MAX_CHUNK_BYTES = 2048
# Rows per tile of the unpack / combine-pack loop. Each tile pays a one-hot lookup over the W*L pairs,
# so bigger tiles amortise it, but at decode there are only ~1000 rows for 132 SMs. Measured on H200:
# decode unpack 8.3 us at 8 rows (12.7 at 16), prefill 224 us at 16 rows (254 at 8).
ROWS_PER_TILE = 8
ROWS_PER_TILE_LARGE = 16     # when a rank sends more than LARGE_ROUTES routes (prefill)
LARGE_ROUTES = 4096
# The interpreter pays per operation, not per element, so it takes big tiles.
CPU_ROWS_PER_TILE = 32
# Tokens per program of pack / reduce in the interpreter (1 on GPU).
CPU_TOKENS_PER_PROGRAM = 64


# ================================================================================================
# Shared device helpers (dispatch unpack and combine pack walk the same rows)
# ================================================================================================
@triton.jit
def _recv_pair_tables(
    counts_ptr,          # (W, E) int32, row stride `stride_counts_w`, last stride 1
    stride_counts_w,     # elements between rows of counts
    rank,                # this rank ("me"): its experts are [rank*L, rank*L + L)
    PAD: tl.constexpr,   # expert_padding
    W: tl.constexpr,
    L: tl.constexpr,
    W_PAD: tl.constexpr,  # next_pow2(W)
    L_PAD: tl.constexpr,  # next_pow2(L)
):
    """Tables over the (local expert l, source s) pairs, as [L_PAD, W_PAD] int64 tiles.

    Received rows are numbered densely, l-major then s then the source's order: `q` = dense row.
    Returns
      cnt[l, s]          rows source s sends to local expert l (counts[s, rank*L + l])
      dense_start[l, s]  first dense row of the pair (exclusive prefix in (l, s) order)
      out_start[l, s]    first row of out_expert_x: sum_{j<l} round_up(tot_j, PAD) + sum_{s'<s} cnt[l, s']
      block_start[l, s]  position of the pair's first row in source s's block: sum_{j<l} cnt[j, s]
      n_src[s]           rows source s sends to this rank
      tot[l]             rows local expert l receives (out_expert_num_tokens)
      num_rows           total received rows
    Padding entries (l >= L or s >= W) have cnt == 0, so no dense row ever selects them.
    Reads W*L int32 (1 KB at E=256).
    """
    l_idx = tl.arange(0, L_PAD)[:, None]
    s_idx = tl.arange(0, W_PAD)[None, :]
    valid = (l_idx < L) & (s_idx < W)
    cnt = tl.load(counts_ptr + s_idx.to(tl.int64) * stride_counts_w + rank * L + l_idx,
                  mask=valid, other=0).to(tl.int64)
    tot = tl.sum(cnt, axis=1)                                   # [L_PAD]
    padded = (tot + PAD - 1) // PAD * PAD
    seg_start = tl.cumsum(padded, axis=0) - padded              # exclusive, padded segments
    expert_dense_start = tl.cumsum(tot, axis=0) - tot           # exclusive, unpadded
    before = tl.cumsum(cnt, axis=1) - cnt                       # earlier sources, same expert
    dense_start = expert_dense_start[:, None] + before
    out_start = seg_start[:, None] + before
    block_start = tl.cumsum(cnt, axis=0) - cnt                  # earlier experts, same source
    n_src = tl.sum(cnt, axis=0)                                 # [W_PAD]
    num_rows = tl.sum(tot, axis=0)
    return cnt, dense_start, out_start, block_start, n_src, tot, num_rows


@triton.jit
def _send_offsets_of(
    counts_ptr,          # (W, E) int32
    stride_counts_w,
    rank,
    is_peer,             # [W_PAD] int1: only these sources are summed (same-node ones)
    L: tl.constexpr,
    W_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """[W_PAD] int64: for each source s with is_peer[s], where its run of rows for this rank starts in
    its send buffer, sum_{e < rank*L} counts[s, e] (plan.send_offsets(counts[s])[rank]); 0 elsewhere.
    Masked loads fetch nothing, so only the node's <= 8 rows are read (8 KB at most for E=256)."""
    s_idx = tl.arange(0, W_PAD)
    acc = tl.zeros([W_PAD], dtype=tl.int64)
    end = rank * L
    for e0 in range(0, end, BLOCK_E):
        e_idx = e0 + tl.arange(0, BLOCK_E)
        mask = is_peer[:, None] & (e_idx[None, :] < end)
        part = tl.load(counts_ptr + s_idx[:, None].to(tl.int64) * stride_counts_w + e_idx[None, :],
                       mask=mask, other=0)
        acc += tl.sum(part.to(tl.int64), axis=1)
    return acc


@triton.jit
def _node_peer_tables(peer_bytes_ptr, counts_ptr, stride_counts_w, rank,
                      W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, BLOCK_E: tl.constexpr):
    """([W_PAD] peer buffer - base in bytes or -1, [W_PAD] same-node flag, [W_PAD] `_send_offsets_of`)
    from a (W,) int64 peer table: the sources (dispatch) or homes (combine) reached in memory."""
    s_idx = tl.arange(0, W_PAD)
    peer = tl.load(peer_bytes_ptr + s_idx, mask=s_idx < W, other=-1)
    is_peer = (peer >= 0) & (s_idx < W)
    return peer, is_peer, _send_offsets_of(counts_ptr, stride_counts_w, rank, is_peer, L, W_PAD, BLOCK_E)


@triton.jit
def _live_token_block(num_tokens, bound_m_ptr, BLOCK_T: tl.constexpr, HAS_BOUND_M: tl.constexpr):
    """(this program's BLOCK_T token ids along grid axis 0, which of them are < min(T, bound_m))."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    num_live = num_tokens
    if HAS_BOUND_M:
        num_live = tl.minimum(tl.load(bound_m_ptr).to(tl.int64), num_tokens)
    return tokens, tokens < num_live


@triton.jit
def _copy_row_words(src_ptr, src_words, dst_ptr, dst_words, is_row, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Copy WORDS words of every row i with is_row[i] from src_ptr + src_words[i] to dst_ptr + dst_words[i],
    BLOCK_W words at a time (the data movement of unpack and of combine pack, in opposite directions)."""
    for c0 in range(0, WORDS, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        mask = is_row[:, None] & (cols < WORDS)[None, :]
        v = tl.load(src_ptr + src_words[:, None] + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst_words[:, None] + cols[None, :], v, mask=mask)


@triton.jit
def _tile_rows(
    tile,                # int32: tile number; rows tile*BLOCK_R .. +BLOCK_R of the dense numbering
    num_rows,            # int64: received rows in total
    cnt, dense_start, out_start,  # [NPAIR] int64 pair tables of `_recv_pair_tables`, flattened
    first_bytes,         # [NPAIR] int64: byte offset (from base) of the pair's row 0 in the other buffer
    rest_bytes,          # [NPAIR] int64: ... of a virtual row 0 for rows i >= split (only when HAS_SPLIT)
    split,               # [NPAIR] int64: rows i < split use first_bytes, the others rest_bytes
    STRIDE_BYTES: tl.constexpr,   # slot stride of the other buffer
    BLOCK_R: tl.constexpr,
    HAS_SPLIT: tl.constexpr,      # dispatch from a remote source: private region, then remainder
):
    """For the BLOCK_R dense rows q of a tile: (is_row, row of the expert-major tensor, byte offset of
    the row's slot from base). The pair of each row is found by a one-hot [BLOCK_R, NPAIR] compare and
    the pair's table entries by masked sums: a register gather that needs no scratch memory, cheap
    because NPAIR = E is small (256) next to the BLOCK_R rows of kilobytes each tile moves."""
    q = tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # rows < W*T*K < 2**31: int32 tile is safe
    is_row = q < num_rows
    sel = (q[:, None] >= dense_start[None, :]) & (q[:, None] < dense_start[None, :] + cnt[None, :])
    i = q - tl.sum(tl.where(sel, dense_start[None, :], 0), axis=1)
    row = tl.sum(tl.where(sel, out_start[None, :], 0), axis=1) + i
    addr = tl.sum(tl.where(sel, first_bytes[None, :], 0), axis=1)
    if HAS_SPLIT:
        use_first = i < tl.sum(tl.where(sel, split[None, :], 0), axis=1)
        addr = tl.where(use_first, addr, tl.sum(tl.where(sel, rest_bytes[None, :], 0), axis=1))
    return is_row, row, addr + i * STRIDE_BYTES


# ================================================================================================
# Kernels
# ================================================================================================
@triton.jit
def _pack_tokens_by_expert_kernel(
    x_ptr,               # (T, X_WORDS) words, row stride `stride_x_t`: the payload bytes of x
    x_scale_ptr,         # (T, S) int32 (fp32 bits), strides (stride_scale_t, stride_scale_s)
    route_slot_ptr,      # (T, K) int32/int64, strides (stride_slot_t, stride_slot_k); -1 = no route
    base_ptr,            # uint8: the byte address space of the send buffer
    bound_m_ptr,         # (1,) int32 live tokens; read only when HAS_BOUND_M
    send_bytes,          # int: send buffer - base, in bytes
    num_tokens,          # T
    stride_x_t, stride_scale_t, stride_scale_s, stride_slot_t, stride_slot_k,
    K: tl.constexpr,
    MAX_SLOTS: tl.constexpr,       # T*K slots in the send buffer: a bad slot is dropped, never written
    X_WORDS: tl.constexpr,         # payload words per row; constexpr so tail masks are provable
    S: tl.constexpr,               # fp32 scales per row (0: none)
    S_PAD: tl.constexpr,
    SCALE_OFFSET_BYTES: tl.constexpr,
    SD_BYTES: tl.constexpr,        # dispatch slot stride (multiple of 16)
    WORD_BYTES: tl.constexpr,
    ALIGN_WORDS: tl.constexpr,     # row starts are multiples of this many words (16 bytes when proven)
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_BOUND_M: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(X_WORDS, BLOCK_W)): one program per BLOCK_T tokens x BLOCK_W-word
    chunk of their payload.

    Reads the chunk once and writes it to the K slots of each token: T*x_bytes read, up to K*T*x_bytes
    written. The chunk-0 programs also copy the tokens' S scales (4*S bytes per slot)."""
    tokens, is_live = _live_token_block(num_tokens, bound_m_ptr, BLOCK_T, HAS_BOUND_M)
    chunk = tl.program_id(1)

    word_ty: tl.constexpr = x_ptr.dtype.element_ty
    base_words = base_ptr.to(tl.pointer_type(word_ty))
    base_i32 = base_ptr.to(tl.pointer_type(tl.int32))

    cols = chunk * BLOCK_W + tl.arange(0, BLOCK_W)
    x_mask = is_live[:, None] & (cols < X_WORDS)[None, :]
    rows = tl.load(x_ptr + tokens[:, None] * stride_x_t + cols[None, :], mask=x_mask)
    if HAS_SCALES:
        s_cols = tl.arange(0, S_PAD)
        # Only chunk 0 copies scales: fold `chunk == 0` into the column bound (a scalar condition
        # broadcast into a block mask is also what the interpreter mishandles).
        s_mask = is_live[:, None] & (s_cols < tl.where(chunk == 0, S, 0))[None, :]
        scales = tl.load(x_scale_ptr + tokens[:, None] * stride_scale_t + s_cols[None, :] * stride_scale_s,
                         mask=s_mask)

    for k in range(K):
        slot = tl.load(route_slot_ptr + tokens * stride_slot_t + k * stride_slot_k,
                       mask=is_live, other=-1).to(tl.int64)
        has_slot = (slot >= 0) & (slot < MAX_SLOTS)
        dst_bytes = send_bytes + slot * SD_BYTES
        dst_words = tl.multiple_of(dst_bytes // WORD_BYTES, ALIGN_WORDS)
        tl.store(base_words + dst_words[:, None] + cols[None, :], rows, mask=x_mask & has_slot[:, None])
        if HAS_SCALES:
            dst_scale = (dst_bytes + SCALE_OFFSET_BYTES) // 4
            tl.store(base_i32 + dst_scale[:, None] + s_cols[None, :], scales, mask=s_mask & has_slot[:, None])


@triton.jit
def _unpack_tokens_by_expert_kernel(
    out_num_tokens_ptr,  # (L,) int32: out, rows per local expert
    out_x_ptr,           # (R, X_WORDS) words, row stride `stride_out_x_r`: out, expert-major rows
    out_scale_ptr,       # (R, S) int32 (fp32 bits), strides (stride_out_scale_r, stride_out_scale_s)
    counts_ptr,          # (W, E) int32: row s = source s's routes per expert
    base_ptr,            # uint8: byte address space of this rank's recv buffer and peers' send buffers
    peer_send_bytes_ptr,  # (W,) int64: peer s's send buffer - base (same node), -1 = remote source
    recv_bytes,          # int: this rank's recv buffer - base
    rank,
    num_out_rows,        # R: rows of out_expert_x (a row past it is dropped, never written)
    stride_counts_w, stride_out_x_r, stride_out_scale_r, stride_out_scale_s,
    W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr,
    PAD: tl.constexpr,                  # expert_padding
    P: tl.constexpr,                    # private rows per source
    PRIVATE_OFFSET_BYTES: tl.constexpr,
    X_WORDS: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
    SCALE_OFFSET_BYTES: tl.constexpr, SD_BYTES: tl.constexpr,
    WORD_BYTES: tl.constexpr, ALIGN_WORDS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    """Grid: (G,) persistent programs; program g copies row tiles g, g+G, ... of the dense received
    rows (BLOCK_R rows x BLOCK_W-word chunks). Tiles ignore (source, expert) boundaries, so a skewed
    routing (every token to one expert) spreads over all programs like a uniform one.

    Each program first builds the per-pair tables from counts (W*L int32 + the node peers' row
    prefixes), then moves (x_bytes + 4*S) bytes per received row in and out."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cnt, dense_start, out_start, block_start, n_src, tot, num_rows = _recv_pair_tables(
        counts_ptr, stride_counts_w, rank, PAD, W, L, W_PAD, L_PAD)

    # Where the pair's rows are: a same-node source is pulled from its send buffer (rows contiguous);
    # a remote one sits in this rank's private slot (rows < P of its block) then in its remainder run.
    peer_send, is_pull, send_off = _node_peer_tables(peer_send_bytes_ptr, counts_ptr, stride_counts_w, rank,
                                                     W, L, W_PAD, BLOCK_E)
    rest = tl.maximum(n_src - P, 0)
    remainder_row = W * P + tl.cumsum(rest, axis=0) - rest     # plan.remainder_offsets
    s_row = tl.arange(0, W_PAD)[None, :].to(tl.int64)
    first_bytes = tl.where(                                      # row i < split: first_bytes + i*Sd
        is_pull[None, :],
        peer_send[None, :] + (send_off[None, :] + block_start) * SD_BYTES,
        recv_bytes + PRIVATE_OFFSET_BYTES + (s_row * P + block_start) * SD_BYTES)
    rest_bytes = recv_bytes + (remainder_row[None, :] + block_start - P) * SD_BYTES
    split = tl.where(is_pull[None, :], 1 << 62, P - block_start)

    NPAIR: tl.constexpr = L_PAD * W_PAD
    cnt = tl.reshape(cnt, (NPAIR,))
    dense_start = tl.reshape(dense_start, (NPAIR,))
    out_start = tl.reshape(out_start, (NPAIR,))
    first_bytes = tl.reshape(first_bytes, (NPAIR,))
    rest_bytes = tl.reshape(rest_bytes, (NPAIR,))
    split = tl.reshape(split, (NPAIR,))

    l_idx = tl.arange(0, L_PAD)
    tl.store(out_num_tokens_ptr + l_idx, tot.to(tl.int32), mask=l_idx < tl.where(pid == 0, L, 0))

    word_ty: tl.constexpr = out_x_ptr.dtype.element_ty
    base_words = base_ptr.to(tl.pointer_type(word_ty))
    base_i32 = base_ptr.to(tl.pointer_type(tl.int32))
    num_tiles = tl.cdiv(num_rows, BLOCK_R).to(tl.int32)
    for tile in range(pid, num_tiles, num_programs):
        is_row, out_row, src_bytes = _tile_rows(tile, num_rows, cnt, dense_start, out_start, first_bytes,
                                                rest_bytes, split, SD_BYTES, BLOCK_R, True)
        is_row = is_row & (out_row < num_out_rows)
        src_words = tl.multiple_of(src_bytes // WORD_BYTES, ALIGN_WORDS)
        dst_words = out_row * stride_out_x_r
        _copy_row_words(base_words, src_words, out_x_ptr, dst_words, is_row, X_WORDS, BLOCK_W)
        if HAS_SCALES:
            s_cols = tl.arange(0, S_PAD)
            mask = is_row[:, None] & (s_cols < S)[None, :]
            src_scale = (src_bytes + SCALE_OFFSET_BYTES) // 4
            v = tl.load(base_i32 + src_scale[:, None] + s_cols[None, :], mask=mask)
            tl.store(out_scale_ptr + out_row[:, None] * stride_out_scale_r
                     + s_cols[None, :] * stride_out_scale_s, v, mask=mask)


# ================================================================================================
# Launcher helpers (shared with combine.py)
# ================================================================================================
def _fail(name: str, expected: str, got: str) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _check_tensor(name, t, *, dtypes=None, shape=None, device=None, host_ok=False, last_contig=True):
    """ValueError naming `name` unless t is a tensor of one of `dtypes`, of `shape` (None entries are
    free), on `device` (a pinned host tensor is accepted for a GPU launch when host_ok) with stride 1
    in its last dimension."""
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    if dtypes is not None and t.dtype not in dtypes:
        _fail(name, "dtype " + " or ".join(str(d) for d in dtypes), str(t.dtype))
    if shape is not None and (t.dim() != len(shape) or any(
            want is not None and want != got for want, got in zip(shape, t.shape))):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        _fail(name, f"shape {want}", str(list(t.shape)))
    if device is not None and t.device != device and not (
            host_ok and device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()):
        _fail(name, f"device {device}" + (" (or pinned host memory)" if host_ok else ""), str(t.device))
    if last_contig and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(name, "stride 1 in the last dimension", f"strides {t.stride()}")


def _check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, "a Python int", repr(value))
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        _fail(name, f"an int in [{lo}, {hi})", repr(value))
    return value


def _check_bound_m(bound_m, device):
    if bound_m is not None:
        _check_tensor("bound_m", bound_m, dtypes=(torch.int32,), shape=(1,), device=device)


def _word_bytes(row_bytes: int, *byte_quantities: int) -> tuple[int, torch.dtype]:
    """Widest word (4, 2 or 1 bytes) that divides a row's length and every address quantity."""
    for size, dtype in ((4, torch.int32), (2, torch.int16), (1, torch.uint8)):
        if row_bytes % size == 0 and all(q % size == 0 for q in byte_quantities):
            return size, dtype
    raise AssertionError("unreachable")


def _align_words(word_bytes: int, *byte_quantities: int) -> int:
    """Words every row start is a multiple of: 16 bytes' worth when all starts are 16-aligned (the
    compiler then issues 16-byte vector accesses), else 1 (no hint)."""
    return 16 // word_bytes if all(q % 16 == 0 for q in byte_quantities) else 1


def _as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same memory as `t` ([N, H] any dtype, last stride 1) viewed as [N, bytes/word] words."""
    u8 = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return u8 if dtype == torch.uint8 else u8.view(dtype)


def _chunk_words(row_words: int, word_bytes: int) -> int:
    return min(next_power_of_2(max(row_words, 1)), MAX_CHUNK_BYTES // word_bytes)


def _num_warps(block_elems: int, elem_bytes: int) -> int:
    """One 16-byte vector per lane per access: warps = bytes / (32 lanes * 16 bytes), in [1, 8]."""
    return max(1, min(8, block_elems * elem_bytes // 512))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _persistent_grid(device: torch.device, layout: Layout) -> tuple[tuple[int], int]:
    """(grid, rows per tile) of the persistent kernels. The grid is fixed by the device and the
    buffer capacity, never by the data (that would need a host sync and break CUDA graphs)."""
    max_rows = layout.max_recv_routes
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = _sm_count(index) * PROGRAMS_PER_SM
        rows_per_tile = ROWS_PER_TILE_LARGE if layout.max_routes > LARGE_ROUTES else ROWS_PER_TILE
    else:
        programs, rows_per_tile = CPU_PROGRAMS, CPU_ROWS_PER_TILE
    return (max(1, min(programs, ceil_div(max_rows, rows_per_tile))),), rows_per_tile


def _check_layout(layout, cfg: A2AConfig) -> None:
    """`layout` must be `cfg.layout(W, node_size)` for some W: same sizes and strides."""
    fields = ("num_experts", "max_num_tokens", "experts_per_token", "expert_padding",
              "dispatch_stride_bytes", "combine_stride_bytes")
    if not isinstance(layout, Layout):
        _fail("layout", "a Layout (cfg.layout(world_size))", type(layout).__name__)
    bad = [f for f in fields if getattr(layout, f) != getattr(cfg, f)]
    if bad:
        _fail("layout", "cfg.layout(world_size) of this cfg",
              ", ".join(f"{f}={getattr(layout, f)}" for f in bad))


def _check_counts(counts, W: int, E: int, device) -> None:
    _check_tensor("counts", counts, dtypes=(torch.int32,), shape=(W, E), device=device, host_ok=True)


def _check_peer_table(name: str, table, W: int, device) -> None:
    _check_tensor(name, table, dtypes=(torch.int64,), shape=(W,), device=device, host_ok=True,
                  last_contig=False)
    if W > 1 and table.stride(0) != 1:
        _fail(name, "a contiguous tensor", f"strides {table.stride()}")


# ================================================================================================
# Launchers
# ================================================================================================
def pack_tokens_by_expert(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    route_slot: torch.Tensor,
    send_base: torch.Tensor,
    send_offset_bytes: int,
    cfg: A2AConfig,
    bound_m: torch.Tensor | None = None,
) -> None:
    """Copy every live route's token into its expert-major slot of this rank's dispatch send buffer.

    Args:
        x: `[T, H]` cfg.in_dtype, last stride 1, T <= cfg.max_num_tokens.
        x_scale: `[T, num_scales]` float32 (any strides) when cfg.has_scales, else None.
        route_slot: `[T, K]` int32/int64: slot of route (t, k) in the send buffer, `-1` = no route
            (masked, or t >= bound_m); from `routing.py`.
        send_base: 1-D uint8 tensor, the base of the byte address space.
        send_offset_bytes: the send buffer's offset from `send_base.data_ptr()` (a multiple of 16).
        bound_m: optional `[1]` int32 on x's device: tokens t >= bound_m[0] are not read.

    Slot j is written at `send + j*Sd` (payload) and `send + j*Sd + cfg.dispatch_scale_offset_bytes`
    (scales); bytes between payload and scales are not touched. No host sync; CUDA-graph safe.
    """
    if not isinstance(cfg, A2AConfig):
        _fail("cfg", "an A2AConfig", type(cfg).__name__)
    _check_tensor("x", x, dtypes=(cfg.in_dtype,), shape=(None, cfg.hidden_dim))
    device = x.device
    T, K = x.shape[0], cfg.experts_per_token
    if T > cfg.max_num_tokens:
        _fail("x", f"at most max_num_tokens={cfg.max_num_tokens} rows", str(T))
    if cfg.has_scales:
        _check_tensor("x_scale", x_scale, dtypes=(torch.float32,), shape=(T, cfg.num_scales), device=device,
                      last_contig=False)
    elif x_scale is not None:
        _fail("x_scale", "None (this config has no scales)", f"a tensor {tuple(x_scale.shape)}")
    _check_tensor("route_slot", route_slot, dtypes=(torch.int32, torch.int64), shape=(T, K), device=device,
                  last_contig=False)
    _check_tensor("send_base", send_base, dtypes=(torch.uint8,), shape=(None,), device=device)
    _check_int("send_offset_bytes", send_offset_bytes)
    _check_bound_m(bound_m, device)
    if T == 0:
        return

    x_row_bytes = x.stride(0) * x.element_size()
    word_bytes, word_dtype = _word_bytes(cfg.x_bytes, x.data_ptr(), x_row_bytes, send_base.data_ptr(),
                                         send_offset_bytes, cfg.dispatch_stride_bytes)
    # The hint is on the offset from base, so base and offset must each be 16-byte aligned.
    align = _align_words(word_bytes, x.data_ptr(), x_row_bytes, send_base.data_ptr(), send_offset_bytes)
    x_words = _as_words(x, word_dtype)
    row_words = cfg.x_bytes // word_bytes
    block_w = _chunk_words(row_words, word_bytes)
    # GPU: one token per program (decode T=128 x 4 chunks = 512 programs fill 132 SMs). Interpreter:
    # it pays per operation, not per element, so all tokens in one program.
    block_t = 1 if device.type == "cuda" else min(next_power_of_2(T), CPU_TOKENS_PER_PROGRAM)
    S = cfg.num_scales
    scale_i32 = x_scale.view(torch.int32) if cfg.has_scales else x_words  # dummy pointer without scales
    stride_scale = x_scale.stride() if cfg.has_scales else (0, 0)
    grid = (ceil_div(T, block_t), ceil_div(row_words, block_w))
    _pack_tokens_by_expert_kernel[grid](
        x_words, scale_i32, route_slot, send_base, bound_m if bound_m is not None else route_slot,
        send_offset_bytes, T,
        x_words.stride(0), stride_scale[0], stride_scale[1], route_slot.stride(0), route_slot.stride(1),
        K=K, MAX_SLOTS=cfg.max_routes, X_WORDS=row_words, S=S, S_PAD=next_power_of_2(max(S, 1)),
        SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes, SD_BYTES=cfg.dispatch_stride_bytes,
        WORD_BYTES=word_bytes, ALIGN_WORDS=align, BLOCK_T=block_t, BLOCK_W=block_w,
        HAS_SCALES=cfg.has_scales, HAS_BOUND_M=bound_m is not None,
        num_warps=_num_warps(block_t * block_w, word_bytes),
    )


def unpack_tokens_by_expert(
    out_expert_num_tokens: torch.Tensor,
    out_expert_x: torch.Tensor,
    out_expert_x_scale: torch.Tensor | None,
    counts: torch.Tensor,
    rank: int,
    base: torch.Tensor,
    peer_send_bytes: torch.Tensor,
    recv_bytes: int,
    cfg: A2AConfig,
    layout: Layout,
) -> None:
    """Copy every row sent to this rank into the expert-major dispatch output (`reference.dispatch`).

    Args:
        out_expert_num_tokens: `[L]` int32, out: rows per local expert.
        out_expert_x: `[R, H]` cfg.in_dtype, last stride 1, out. Expert l's rows start at
            sum_{j<l} round_up(num_tokens[j], expert_padding), ordered by (source, token, k). Padding
            rows and rows past the received ones are not written; R >= layout.max_dispatch_rows
            guarantees room (a row past R is dropped, never written out of bounds).
        out_expert_x_scale: `[R, num_scales]` float32 (any strides) when cfg.has_scales, else None.
        counts: `[W, E]` int32, the routing matrix (row s = source s's routes per expert), on the
            device or pinned host memory. Must be validated (`plan.validate_counts`) beforehand.
        rank: this rank.
        base: 1-D uint8 tensor, base of the byte address space of all buffers below.
        peer_send_bytes: `[W]` int64: for a same-node source s (this rank included), the offset of s's
            send buffer from base; `-1` for a remote source. Offsets are multiples of 16.
        recv_bytes: offset of this rank's recv buffer from base (remote sources' rows are there, at
            the private region then the remainder region of `plan`).

    Every offset is computed on the device from `counts`: no host sync, CUDA-graph safe.
    """
    if not isinstance(cfg, A2AConfig):
        _fail("cfg", "an A2AConfig", type(cfg).__name__)
    _check_layout(layout, cfg)
    W, L, E = layout.world_size, layout.num_local_experts, cfg.num_experts
    _check_tensor("out_expert_x", out_expert_x, dtypes=(cfg.in_dtype,), shape=(None, cfg.hidden_dim))
    device = out_expert_x.device
    R = out_expert_x.shape[0]
    _check_tensor("out_expert_num_tokens", out_expert_num_tokens, dtypes=(torch.int32,), shape=(L,),
                  device=device)
    if cfg.has_scales:
        _check_tensor("out_expert_x_scale", out_expert_x_scale, dtypes=(torch.float32,),
                      shape=(R, cfg.num_scales), device=device, last_contig=False)
    elif out_expert_x_scale is not None:
        _fail("out_expert_x_scale", "None (this config has no scales)", "a tensor")
    _check_counts(counts, W, E, device)
    _check_int("rank", rank, 0, W)
    _check_tensor("base", base, dtypes=(torch.uint8,), shape=(None,), device=device)
    _check_peer_table("peer_send_bytes", peer_send_bytes, W, device)
    _check_int("recv_bytes", recv_bytes)

    out_row_bytes = out_expert_x.stride(0) * out_expert_x.element_size() if R else 0
    # Sources' rows start at base + (recv_bytes or peer_send_bytes[s]) + multiples of Sd (16-aligned);
    # the hint is on the offset from base, so base and recv_bytes must each be 16-byte aligned.
    word_bytes, word_dtype = _word_bytes(cfg.x_bytes, out_expert_x.data_ptr(), out_row_bytes, recv_bytes,
                                         base.data_ptr(), layout.private_offset_bytes,
                                         cfg.dispatch_stride_bytes)
    align = _align_words(word_bytes, out_expert_x.data_ptr(), out_row_bytes, recv_bytes, base.data_ptr())
    x_words = _as_words(out_expert_x, word_dtype)
    row_words = cfg.x_bytes // word_bytes
    block_w = _chunk_words(row_words, word_bytes)
    S = cfg.num_scales
    scale_i32 = out_expert_x_scale.view(torch.int32) if cfg.has_scales else x_words
    stride_scale = out_expert_x_scale.stride() if cfg.has_scales else (0, 0)
    grid, block_r = _persistent_grid(device, layout)
    _unpack_tokens_by_expert_kernel[grid](
        out_expert_num_tokens, x_words, scale_i32, counts, base, peer_send_bytes, recv_bytes, rank, R,
        counts.stride(0), x_words.stride(0) if R else row_words, stride_scale[0], stride_scale[1],
        W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L),
        PAD=cfg.expert_padding, P=layout.private_rows, PRIVATE_OFFSET_BYTES=layout.private_offset_bytes,
        X_WORDS=row_words, S=S, S_PAD=next_power_of_2(max(S, 1)),
        SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes, SD_BYTES=cfg.dispatch_stride_bytes,
        WORD_BYTES=word_bytes, ALIGN_WORDS=align,
        BLOCK_R=block_r, BLOCK_W=block_w, BLOCK_E=min(next_power_of_2(E), 256),
        HAS_SCALES=cfg.has_scales,
        num_warps=_num_warps(block_r * block_w, word_bytes),
    )


__all__ = ["pack_tokens_by_expert", "unpack_tokens_by_expert"]
