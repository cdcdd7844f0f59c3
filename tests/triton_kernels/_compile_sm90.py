"""Compile kernels for sm_90 without a device (run by test_compile_sm90.py in a process of its own: under
TRITON_INTERPRET=1 the kernels are interpreted functions, which do not compile).

    python3 -m tests.triton_kernels._compile_sm90 WORLD NODE     # the write-plan kernels
    python3 -m tests.triton_kernels._compile_sm90 pack           # dispatch pack (copy and fused fp8), quantize_fp8
    python3 -m tests.triton_kernels._compile_sm90 wait           # the separate wait, shrink mode's included
    python3 -m tests.triton_kernels._compile_sm90 rank_rows      # per-rank rows' kernels, RANK_ROWS write plans
    python3 -m tests.triton_kernels._compile_sm90 relay          # the relay's variants and reduce_relayed_rows
"""
import inspect
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_a2a.config import A2AConfig, next_power_of_2
from moe_a2a.protocol.words import HALF_FLAGS, Flag, flag_word
from moe_a2a.triton_kernels import _dispatch_kernels, _quant_kernels, _routing_kernels, _write_plan_kernels
from moe_a2a.triton_kernels import quant, rank_rows, write_plan


def _compile(fn, pointers: dict, constexprs: dict, options: dict | None = None):
    names = inspect.signature(fn.fn).parameters
    # Meta-parameters left out take their defaults, as a launch does (not runtime ints: `if` on them is static).
    constexprs = {**{n: p.default for n, p in names.items() if "constexpr" in str(p.annotation)
                     and p.default is not inspect.Parameter.empty}, **constexprs}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i64") for n in names}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def main(world: int, node: int) -> None:
    lay = A2AConfig(max_num_tokens=128, num_experts=256 if world % 2 == 0 else 2 * world, experts_per_token=8,
                    hidden_dim=7168, in_dtype=torch.float8_e4m3fn).layout(world, node)
    W, L = lay.world_size, lay.num_local_experts
    wait, _, signal, status, _ = HALF_FLAGS["dispatch_plan"]
    shape = dict(W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L))
    kernels = [
        _compile(_write_plan_kernels._plan_remainder_and_combine_writes_kernel,
                 dict(counts_ptr="*i32", base_ptr="*u8", epoch_ptr="*i64", failed_ptr="*i64", flags_ptr="*i64",
                      remainder_ptr="*i64", combine_ptr="*i64"),
                 dict(NODE=node, P=lay.private_rows, PRIVATE_SLOT_ROWS=lay.private_slot_rows,
                      SLOT_WORDS=lay.private_slot_bytes // 4, DISPATCH_STRIDE_BYTES=lay.dispatch_stride_bytes,
                      COMBINE_STRIDE_BYTES=lay.combine_stride_bytes, COMBINE_STAGE_BYTES=lay.combine_stage_offset_bytes,
                      COMBINE_RECV_BYTES=lay.combine_recv_offset_bytes, BLOCK_S=write_plan.BLOCK_S,
                      MAX_ROUTES=lay.max_routes, PROXY_WAIT_WORD=flag_word(wait), SIGNAL_WORD=flag_word(signal),
                      ERROR_WORD=flag_word(Flag.ERROR), STATUS_WORD=flag_word(status),
                      BAD_COUNTS_WORD=flag_word(Flag.BAD_COUNTS), SPIN=True, USE_PTX=True, BACKOFF_NS=200, **shape)),
        _compile(_write_plan_kernels._plan_private_writes_kernel,
                 dict(counts_ptr="*i32", epoch_ptr="*i64", table_ptr="*i64", remainder_writes_ptr="*i64",
                      base_ptr="*u8"),
                 dict(NODE=node, P=lay.private_rows, STRIDE_BYTES=lay.dispatch_stride_bytes,
                      STAGE_HEADER_BYTES=lay.private_stage_header_offset_bytes(0), SLOT_BYTES=lay.private_slot_bytes,
                      E=lay.num_experts, E_PAD=next_power_of_2(lay.num_experts), BLOCK_P=16, HEADERS=True, **shape)),
    ]
    # The route kernels with the private staging rows (one program, and the two-launch fixup).
    send_rows = dict(SR_L=L, SR_NODE=node, SR_P=lay.private_rows, SR_HR=lay.header_rows, SR_FIRST=lay.max_routes,
                     SEND_ROWS=True)
    route_ptrs = dict(indices_ptr="*i32", bound_m_ptr="*i32", route_slot_ptr="*i32", counts_ptr="*i32",
                      hist_ptr="*i32", send_row_ptr="*i32", epoch_ptr="*i64", bad_index_ptr="*i64",
                      ready_ptr="*i64", node_slots_ptr="*i32", bad_bound_ptr="*i64",
                      **{n: "i32" for n in ("num_tokens", "num_experts", "num_blocks", "stride_counts", "abort",
                                            "node_lo", "node_hi", "sr_node_first")})  # ints that fit, as launched
    kernels += [
        _compile(_routing_kernels._route_tokens_block_kernel, route_ptrs,
                 dict(K=8, BLOCK_R=128, E_BINS=next_power_of_2(lay.num_experts + 1), HAS_BOUND_M=False, SINGLE=True,
                      **send_rows)),
        _compile(_routing_kernels._route_tokens_fixup_kernel, route_ptrs,
                 dict(K=8, BLOCK_R=64, E_PAD=next_power_of_2(lay.num_experts), CHUNK_B=16, **send_rows)),
    ]
    # Per-rank rows routed from the experts (`rank_keys`; the relay's mapping too), both paths, rows per rank.
    rank_rows = dict(SR_L=1, SR_NODE=node, SR_P=lay.private_rows, SR_HR=lay.header_rows, SR_FIRST=lay.max_routes,
                     SEND_ROWS=True)
    for relay in (False, True):
        keys = dict(RK_L=L, RK_RELAY=relay, RK_NODE=node, RANK_KEYS=True)
        kernels += [
            _compile(_routing_kernels._route_tokens_block_kernel, route_ptrs,
                     dict(K=8, K_PAD=8, BLOCK_R=64, E_BINS=next_power_of_2(W + 1), HAS_BOUND_M=True, SINGLE=False,
                          **keys)),
            _compile(_routing_kernels._route_tokens_block_kernel, route_ptrs,
                     dict(K=8, K_PAD=8, BLOCK_R=128, E_BINS=next_power_of_2(W + 1), HAS_BOUND_M=False, SINGLE=True,
                          **rank_rows, **keys)),
            _compile(_routing_kernels._route_tokens_fixup_kernel, route_ptrs,
                     dict(K=8, BLOCK_R=64, E_PAD=next_power_of_2(W), CHUNK_B=16, **rank_rows, **keys)),
        ]
        # The ranks routed in the experts' two launches (`route_tokens(ranks=)`), staged rows and node slots.
        fused = dict(RK_L=L, RK_RELAY=relay, RK_NODE=node, RANK_ALSO=True)
        fused_ptrs = dict(route_ptrs, rank_slot_ptr="*i32", rank_counts_ptr="*i32", rank_node_slots_ptr="*i32")
        kernels += [
            _compile(_routing_kernels._route_tokens_block_kernel, fused_ptrs,
                     dict(K=8, K_PAD=8, BLOCK_R=64, E_BINS=next_power_of_2(lay.num_experts + 1),
                          W_BINS=next_power_of_2(W + 1), HAS_BOUND_M=True, SINGLE=False, HAS_EPOCH=True, CHECK=True,
                          CHECK_BOUND=True, **fused)),
            _compile(_routing_kernels._route_tokens_fixup_kernel, fused_ptrs,
                     dict(K=8, BLOCK_R=64, E_PAD=next_power_of_2(lay.num_experts), CHUNK_B=16,
                          W_PAD=next_power_of_2(W), CHUNK_BW=16, HAS_READY=True, USE_PTX=True, CHECK_BOUND=True,
                          HAS_NODE_SLOTS=True, RHAS_NODE_SLOTS=True, **rank_rows, **fused)),
        ]
    for k in kernels:
        assert k.asm.get("cubin"), "no cubin"
    print("compiled", [k.name for k in kernels])


def main_pack() -> None:
    """Dispatch pack at the DeepEP facade's decode shape (bf16 rows of H=7168 plus a 4-byte column), as a
    copy and with the fused fp8 quantisation (fp32 scales, UE8M0 codes with S % 4 != 0 at H=7040), with
    and without node synchronisation / remote rows first; and quantize_fp8, which shares its math."""
    pointers = dict(x_ptr="*bf16", x_scale_ptr="*i32", route_slot_ptr="*i32", base_ptr="*u8", bound_m_ptr="*i32",
                    failed_ptr="*i64", counter_ptr="*i32", epoch_ptr="*i64", flags_ptr="*i64",
                    peer_sync_bytes_ptr="*i64", node_slots_ptr="*i32")
    kernels = []
    for H, fused, ue8m0, sync in ((7168, None, False, False), (7168, True, False, True), (7168, True, True, False),
                                  (7040, True, True, True)):
        cfg = A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=H,
                        in_dtype=torch.bfloat16, scale_block=H)
        meta = dict(K=8, MAX_SLOTS=cfg.max_routes, S=1, S_PAD=1, SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes,
                    SD_BYTES=cfg.dispatch_stride_bytes, BLOCK_T=1, HAS_SCALES=True, HAS_BOUND_M=True)
        if fused:
            q = quant.Fp8Quantize(scale_offset_bytes=H, round_scale=True, ue8m0=ue8m0)
            meta.update(X_WORDS=H, BLOCK_W=1024, WORD_BYTES=1, ALIGN_WORDS=16, QUANT=True, Q_BLOCK=q.block,
                        Q_SCALES=q.num_scales(H), Q_SCALE_OFFSET_BYTES=q.scale_offset_bytes, ROUND_SCALE=True,
                        UE8M0=ue8m0, FP8_VIA_BITS=False)
            pointers_x = dict(pointers)
        else:
            meta.update(X_WORDS=cfg.x_bytes // 4, BLOCK_W=512, WORD_BYTES=4, ALIGN_WORDS=4)
            pointers_x = dict(pointers, x_ptr="*i32")
        if sync:
            meta.update(NODE_SYNC=True, HAS_PROXY=True, USE_PTX=True, NODE=4, SPLIT=True, REMOTE_FIRST=True, E=256,
                        E_PAD=256)
        kernels.append(_compile(_dispatch_kernels._pack_tokens_by_expert_kernel, pointers_x, meta))
    for ue8m0 in (False, True):
        kernels.append(_compile(_quant_kernels._quantize_fp8_kernel,
                                dict(x_ptr="*bf16", out_ptr="*u8", scale_ptr="*u8" if ue8m0 else "*fp32",
                                     bound_m_ptr="*i32"),
                                dict(BLOCK_T=32, BLOCK_C=128, HAS_BOUND_M=True, FP8_VIA_BITS=False,
                                     ROUND_SCALE=ue8m0, UE8M0=ue8m0)))
    for k in kernels:
        assert k.asm.get("cubin"), "no cubin"
    print("compiled", [k.name for k in kernels])


# The pack writing per-rank rows' metadata (`rank_rows.row_meta_args`): its pointers and meta-parameters.
_PACK_META_PTRS = dict(x_ptr="*i32", x_scale_ptr="*i32", route_slot_ptr="*i32", bound_m_ptr="*i32",
                       node_slots_ptr="*i32", meta_indices_ptr="*i32", meta_slot_ptr="*i32", meta_counts_ptr="*i32",
                       meta_weights_ptr="*fp32")


def _pack_meta(cfg, L: int, **extra) -> dict:
    return dict(K=8, MAX_SLOTS=cfg.max_routes, X_WORDS=cfg.x_bytes // 4, S=cfg.num_scales,
                S_PAD=next_power_of_2(cfg.num_scales), SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes,
                SD_BYTES=cfg.dispatch_stride_bytes, WORD_BYTES=4, ALIGN_WORDS=4, BLOCK_T=1, BLOCK_W=512,
                HAS_SCALES=True, HAS_BOUND_M=True, E=256, E_PAD=256, META_OFFSET_BYTES=cfg.rank_meta_offset_bytes,
                META_K_PAD=8, META_L=L, META_E_PAD=256, META_WEIGHTS=True, RANK_META=True, **extra)


def main_wait() -> None:
    """The separate wait (`_node_sync_kernels._wait_apart_kernel`, launched by `node_sync.launch_wait_apart`) as
    ranks sharing a GPU and shrink mode launch it: node peers only, plain and masking (dispatch: with the count
    rows zeroed; combine: without)."""
    from moe_a2a.triton_kernels import _node_sync_kernels

    pointers = dict(base_ptr="*u8", failed_ptr="*i64", epoch_ptr="*i64", flags_ptr="*i64", mask_ptr="*i32")
    kernels = []
    for shrink, counts in ((False, False), (True, True), (True, False)):
        meta = dict(READY_BYTES=64, NODE=8, NODE_PAD=8, HAS_PROXY=False, PROXY_WAIT_WORD=0, PROXY_DELTA=0,
                    ERROR_WORD=1, STATUS_WORD=2, USE_PTX=True, BACKOFF_NS=200, E=256 if shrink else 1,
                    E_PAD=256 if shrink else 1, SHRINK=shrink)
        ptrs = dict(pointers) if shrink else dict(pointers, mask_ptr="*i64")
        if not counts:
            meta["counts_bytes"] = 0  # a launch with 0 specialises it away
        kernels.append(_compile(_node_sync_kernels._wait_apart_kernel, ptrs, meta))
    for k in kernels:
        assert k.asm.get("cubin"), "no cubin"
    print("compiled", [k.name for k in kernels])


def main_rank_rows() -> None:
    """The kernels of per-rank rows (`rank_rows.py`) as AllToAll launches them: on one node and with a proxy,
    node synchronisation, split buffers, fp8 payloads and fp8 combine rows; and the write plans counting rows
    per rank (W=16 on two nodes)."""
    from moe_a2a.triton_kernels import _combine_kernels
    from moe_a2a.triton_kernels import _rank_rows_kernels as rk

    kernels = []
    for W, node, fp8 in ((2, 2, False), (16, 8, True)):
        cfg = A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=7168,
                        in_dtype=torch.float8_e4m3fn, dispatch_rows="rank", combine_rows="rank", combine_fp8=fp8)
        lay = cfg.layout(W, node)
        L = lay.num_local_experts
        shape = dict(W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L), K=8, K_PAD=8)
        sync = dict(NODE_SYNC=True, HAS_PROXY=node < W, USE_PTX=True, NODE=node, NODE_PAD=next_power_of_2(node),
                    KERNEL_WAIT=True)
        ptrs = dict(failed_ptr="*i64", counter_ptr="*i32", epoch_ptr="*i64", flags_ptr="*i64",
                    peer_sync_bytes_ptr="*i64", aborted_ptr="*i64", node_slots_ptr="*i32", counts_ptr="*i32",
                    rank_rows_ptr="*i32", base_ptr="*u8", peer_send_bytes_ptr="*i64", peer_recv_bytes_ptr="*i64",
                    indices_ptr="*i32", out_ptr="*i32", route_slot_ptr="*i32", send_row_ptr="*i32",
                    weights_ptr="*fp32", out_num_tokens_ptr="*i32", out_x_ptr="*i32", out_scale_ptr="*i32",
                    out_ranges_ptr="*i64", expert_y_ptr="*bf16", out_tokens_ptr="*bf16", rank_slot_ptr="*i32",
                    bound_m_ptr="*i32")
        fp8_args = dict(FP8=fp8, Q_BLOCK=128, SCALE_OFFSET_BYTES=cfg.combine_scale_offset_bytes, FP8_VIA_BITS=False)
        ptrs["row_plan_ptr"] = "*i32"
        plan = fp8  # the expand's row plan, and the reduce reading it, on one of the two layouts
        kernels += [
            _compile(_dispatch_kernels._pack_tokens_by_expert_kernel, dict(ptrs, **_PACK_META_PTRS),
                     _pack_meta(cfg, L, SPLIT=fp8, REMOTE_FIRST=fp8, NODE_SYNC=fp8, HAS_PROXY=fp8, USE_PTX=True,
                                NODE=node)),
            _compile(rk._expand_rank_rows_kernel, ptrs,
                     dict(PAD=1, X_WORDS=cfg.x_bytes // 4, S=cfg.num_scales, P=lay.private_rows,
                          HEADER_ROWS=lay.header_rows, PRIVATE_OFFSET_BYTES=0,
                          SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes,
                          META_OFFSET_BYTES=cfg.rank_meta_offset_bytes, SD_BYTES=cfg.dispatch_stride_bytes,
                          WORD_BYTES=4, ALIGN_WORDS=4, BLOCK_R=16, BLOCK_W=512, HAS_SCALES=True, CAPACITY=0,
                          CAPACITY_WORD=1, ABORT_WORD=2, HAS_RANGES=True, HAS_PLAN=plan, **shape, **sync)),
            _compile(rk._reduce_rank_rows_by_source_kernel, ptrs,
                     dict(PAD=1, H=7168, META_OFFSET_BYTES=cfg.rank_meta_offset_bytes, P=lay.private_rows,
                          HEADER_ROWS=lay.header_rows, PRIVATE_OFFSET_BYTES=0, SD_BYTES=cfg.dispatch_stride_bytes,
                          SC_BYTES=cfg.combine_stride_bytes, COMBINE_RECV_BYTES=lay.combine_recv_offset_bytes,
                          ITEM_BYTES=2, BLOCK_R=16, BLOCK_H=256, CAPACITY=0, ABORT_BYTES=64, FROM_PLAN=plan,
                          H_CHUNKS=4 if plan else 1, **fp8_args,  # (several hidden chunks a program: REDUCE_H_CHUNKS)
                          **shape, **{k: v for k, v in sync.items() if k != "NODE_PAD"}),
                     rank_rows._no_fma(torch.device("cuda"))),
        ]
        # The reduces as their launchers compile them (`rank_rows._no_fma`): no fused multiply-add in the PTX,
        # where an fp8 row's q * scale (or w * y) fused into the sum would flip the reference's rounding ties.
        kernels.append(_compile(rk._reduce_rank_rows_by_token_kernel, ptrs,
                                dict(K=8, K_PAD=8, MAX_SLOTS=cfg.max_routes, H=7168, SC_BYTES=cfg.combine_stride_bytes,
                                     ITEM_BYTES=2, BLOCK_T=1, BLOCK_H=1024, HAS_BOUND_M=True, ACCUMULATE=True,
                                     SPLIT=fp8, ABORT_BYTES=64, **fp8_args, **sync),
                                rank_rows._no_fma(torch.device("cuda"))))
        for k in (kernels[-1], kernels[-2]):  # the reduce by token, and by source (above, compiled alike)
            assert "fma.rn.f32" not in k.asm["ptx"], f"{k.name}: fused multiply-adds"
        # The route rows' receive and combine send, which share the report and epilogue helpers with them.
        kernels += [
            _compile(_dispatch_kernels._unpack_tokens_by_expert_kernel, ptrs,
                     dict(PAD=1, P=lay.private_rows, PRIVATE_OFFSET_BYTES=0, HEADER_ROWS=lay.header_rows,
                          X_WORDS=cfg.x_bytes // 4, S=cfg.num_scales, SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes,
                          SD_BYTES=cfg.dispatch_stride_bytes, WORD_BYTES=4, ALIGN_WORDS=4, BLOCK_R=16, BLOCK_W=512,
                          BLOCK_E=256, HAS_SCALES=True, CAPACITY=64, CAPACITY_WORD=1, ABORT_WORD=2, HAS_RANGES=True,
                          ABORT_AT_COMBINE=True, **{k: v for k, v in shape.items() if k not in ("K", "K_PAD")},
                          **sync)),
            # DeepEP's column-major scales of a fused quantisation (the by-expert pass)
            _compile(_dispatch_kernels._unpack_tokens_by_expert_kernel, dict(ptrs, out_qscale_ptr="*i32"),
                     dict(PAD=1, P=lay.private_rows, PRIVATE_OFFSET_BYTES=0, HEADER_ROWS=lay.header_rows,
                          X_WORDS=cfg.x_bytes // 4, S=cfg.num_scales, SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes,
                          SD_BYTES=cfg.dispatch_stride_bytes, WORD_BYTES=4, ALIGN_WORDS=4, BLOCK_R=16, BLOCK_W=512,
                          BLOCK_E=256, HAS_SCALES=True, CAPACITY=64, CAPACITY_WORD=1, ABORT_WORD=2, Q_SCALE_WORD=1792,
                          Q_WORDS=56, QSCALES_BY_EXPERT=True, BLOCK_QC=64,
                          **{k: v for k, v in shape.items() if k not in ("K", "K_PAD")}, **sync)),
            _compile(_combine_kernels._pack_combine_by_source_kernel, dict(ptrs, expert_y_ptr="*i32"),
                     dict(PAD=1, Y_WORDS=3584, SC_BYTES=cfg.combine_stride_bytes, WORD_BYTES=4, ALIGN_WORDS=4,
                          BLOCK_R=16, BLOCK_W=512, BLOCK_E=256, COMBINE_RECV_BYTES=lay.combine_recv_offset_bytes,
                          CAPACITY=0, ABORT_BYTES=64, **{k: v for k, v in shape.items() if k not in ("K", "K_PAD")},
                          **{k: v for k, v in sync.items() if k != "NODE_PAD"})),
        ]
        if node < W:
            wait, _, signal, status, _ = HALF_FLAGS["dispatch_plan"]
            kernels += [
                _compile(_write_plan_kernels._plan_remainder_and_combine_writes_kernel,
                         dict(counts_ptr="*i32", base_ptr="*u8", epoch_ptr="*i64", failed_ptr="*i64", flags_ptr="*i64",
                              remainder_ptr="*i64", combine_ptr="*i64"),
                         dict(NODE=node, P=lay.private_rows, PRIVATE_SLOT_ROWS=lay.private_slot_rows,
                              SLOT_WORDS=lay.private_slot_bytes // 4, DISPATCH_STRIDE_BYTES=lay.dispatch_stride_bytes,
                              COMBINE_STRIDE_BYTES=lay.combine_stride_bytes,
                              COMBINE_STAGE_BYTES=lay.combine_stage_offset_bytes,
                              COMBINE_RECV_BYTES=lay.combine_recv_offset_bytes, BLOCK_S=write_plan.BLOCK_S,
                              MAX_ROUTES=lay.max_routes, MAX_RANK_ROWS=lay.send_rows, PROXY_WAIT_WORD=flag_word(wait),
                              SIGNAL_WORD=flag_word(signal), ERROR_WORD=flag_word(Flag.ERROR),
                              STATUS_WORD=flag_word(status), BAD_COUNTS_WORD=flag_word(Flag.BAD_COUNTS), SPIN=True,
                              USE_PTX=True, BACKOFF_NS=200, RANK_ROWS=True, COMBINE_RANK=True,
                              PIECES=2,  # each write in pieces (the relay with 2 proxies a rank)
                              **{k: v for k, v in shape.items() if k not in ("K", "K_PAD")})),
                _compile(_write_plan_kernels._plan_private_writes_kernel,
                         dict(counts_ptr="*i32", epoch_ptr="*i64", table_ptr="*i64", remainder_writes_ptr="*i64",
                              base_ptr="*u8"),
                         dict(NODE=node, P=lay.private_rows, STRIDE_BYTES=lay.dispatch_stride_bytes,
                              STAGE_HEADER_BYTES=lay.private_stage_header_offset_bytes(0),
                              SLOT_BYTES=lay.private_slot_bytes, E=lay.count_row_ints,
                              E_PAD=next_power_of_2(lay.count_row_ints), BLOCK_P=8, HEADERS=True, RANK_ROWS=True,
                              PIECES=2, **{k: v for k, v in shape.items() if k not in ("K", "K_PAD")})),
            ]
    for k in kernels:
        assert k.asm.get("cubin"), "no cubin"
    # The arrival (`_details.node_arrive_of`) in every data kernel here: one system fence, then a relaxed
    # atomic (a release pattern); an acq_rel atomic would fence a second time (docs/protocol.md).
    arrivals = [k for k in kernels if "atom.global.sys" in k.asm["ptx"]]
    assert len(arrivals) >= 4, "the data kernels here have no system-scope arrival to check"
    for k in arrivals:
        ptx = k.asm["ptx"]
        at = ptx.index("atom.global.sys")
        assert ptx[at:ptx.index("\n", at)].count(".relaxed.") == 1, f"{k.name}: the arrival's atomic is not relaxed"
        assert ptx[ptx.rindex("fence", 0, at):at].count("\n") < 16, f"{k.name}: no fence just before the arrival"
    print("compiled", [k.name for k in kernels])


def main_relay() -> None:
    """The relay's kernels (`relay.py`, RELAY variants of `rank_rows.py`'s) at W=16 on two nodes of 8, bf16 and
    fp8 combine rows, with node synchronisation and a proxy."""
    import triton.language as tl

    from moe_a2a.triton_kernels import _rank_rows_kernels as rk
    from moe_a2a.triton_kernels import _relay_kernels

    kernels = []
    for fp8 in (False, True):
        cfg = A2AConfig(max_num_tokens=128, num_experts=256, experts_per_token=8, hidden_dim=7168,
                        in_dtype=torch.float8_e4m3fn, dispatch_rows="rank", combine_rows="rank", combine_fp8=fp8)
        lay = cfg.layout(16, 8, relay=True)
        L = lay.num_local_experts
        shape = dict(W=16, L=L, W_PAD=16, K=8, K_PAD=8)
        relay = dict(RELAY=True, NODE_SIZE=8)
        sync = dict(NODE_SYNC=True, HAS_PROXY=True, USE_PTX=True, NODE=8, KERNEL_WAIT=True)
        ptrs = dict(failed_ptr="*i64", counter_ptr="*i32", epoch_ptr="*i64", flags_ptr="*i64",
                    peer_sync_bytes_ptr="*i64", aborted_ptr="*i64", counts_ptr="*i32", rank_rows_ptr="*i32",
                    base_ptr="*u8", peer_send_bytes_ptr="*i64", peer_recv_bytes_ptr="*i64",
                    peer_partial_bytes_ptr="*i64", indices_ptr="*i32", out_ptr="*i32", route_slot_ptr="*i32",
                    send_row_ptr="*i32", weights_ptr="*fp32", out_num_tokens_ptr="*i32", out_x_ptr="*i32",
                    out_scale_ptr="*i32", out_ranges_ptr="*i64", expert_y_ptr="*bf16", relay_recv_bytes_ptr="*i64",
                    out_qscale_ptr="*i32", row_plan_ptr="*i32")
        fp8_args = dict(FP8=fp8, Q_BLOCK=128, SCALE_OFFSET_BYTES=cfg.combine_scale_offset_bytes, FP8_VIA_BITS=False)
        places = dict(P=lay.private_rows, HEADER_ROWS=lay.header_rows, PRIVATE_OFFSET_BYTES=0,
                      META_OFFSET_BYTES=cfg.rank_meta_offset_bytes, SD_BYTES=cfg.dispatch_stride_bytes)
        kernels += [
            _compile(_dispatch_kernels._pack_tokens_by_expert_kernel, dict(ptrs, **_PACK_META_PTRS),
                     _pack_meta(cfg, L, META_RELAY=True, META_NODE=8, SPLIT=True, REMOTE_FIRST=True, NODE_SYNC=True,
                                HAS_PROXY=True, USE_PTX=True, NODE=8)),
            # (the DeepEP facade's receive: a fused quantisation's scale words to [L, C, 56] too, rows by capacity)
            _compile(rk._expand_rank_rows_kernel, ptrs,
                     dict(PAD=1, X_WORDS=cfg.x_bytes // 4, S=cfg.num_scales, SCALE_OFFSET_BYTES=cfg.dispatch_scale_offset_bytes,
                          WORD_BYTES=4, ALIGN_WORDS=4, BLOCK_R=16, BLOCK_W=512, HAS_SCALES=True, CAPACITY=2048,
                          CAPACITY_WORD=1, ABORT_WORD=2, L_PAD=L, NODE_PAD=8, Q_SCALE_WORD=1792, Q_WORDS=56,
                          HAS_PLAN=True, **places, **shape, **sync, **relay)),
            _compile(rk._reduce_rank_rows_by_source_kernel, ptrs,
                     dict(PAD=1, H=7168, SC_BYTES=cfg.combine_stride_bytes, COMBINE_RECV_BYTES=lay.combine_recv_offset_bytes,
                          ITEM_BYTES=2, BLOCK_R=16, BLOCK_H=256, CAPACITY=0, L_PAD=L, ALIGN_BYTES=16,
                          PARTIAL_STRIDE_BYTES=lay.relay_partial_stride_bytes, FROM_PLAN=True, H_CHUNKS=2, **fp8_args,
                          **places, **shape, **sync, **relay)),
            _compile(_relay_kernels._reduce_relayed_rows_kernel, ptrs,
                     dict(H=7168, SC_BYTES=cfg.combine_stride_bytes, PARTIAL_STRIDE_BYTES=lay.relay_partial_stride_bytes,
                          ITEM_BYTES=2, Y_TY=tl.bfloat16, BLOCK_R=16, BLOCK_H=256, ALIGN_BYTES=16, NODE_PAD=8,
                          L=L, W=16, W_PAD=16, K=8, K_PAD=8, NODE_SIZE=8, ABORT_BYTES=lay.combine_aborted_offset_bytes,
                          CALL_ABORTED_WORD=3, H_CHUNKS=2, **places, **fp8_args, **sync)),
        ]
    for k in kernels:
        assert k.asm.get("cubin"), "no cubin"
    print("compiled", [k.name for k in kernels])


if __name__ == "__main__":
    if sys.argv[1] == "rank_rows":
        main_rank_rows()
    elif sys.argv[1] == "relay":
        main_relay()
    elif sys.argv[1] == "pack":
        main_pack()
    elif sys.argv[1] == "wait":
        main_wait()
    else:
        main(int(sys.argv[1]), int(sys.argv[2]))
