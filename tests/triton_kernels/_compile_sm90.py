"""Compile the write-plan kernels for sm_90 without a device (run by test_compile_sm90.py in a process of
its own: under TRITON_INTERPRET=1 the kernels are interpreted functions, which do not compile).

    python3 -m tests.triton_kernels._compile_sm90 WORLD NODE
"""
import inspect
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_a2a.config import A2AConfig, next_power_of_2
from moe_a2a.protocol.words import HALF_FLAGS, Flag, flag_word
from moe_a2a.triton_kernels import write_plan


def _compile(fn, pointers: dict, constexprs: dict):
    names = inspect.signature(fn.fn).parameters
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i64") for n in names}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32))


def main(world: int, node: int) -> None:
    lay = A2AConfig(max_num_tokens=128, num_experts=256 if world % 2 == 0 else 2 * world, experts_per_token=8,
                    hidden_dim=7168, in_dtype=torch.float8_e4m3fn).layout(world, node)
    W, L = lay.world_size, lay.num_local_experts
    wait, _, signal, status, _ = HALF_FLAGS["dispatch_plan"]
    shape = dict(W=W, L=L, W_PAD=next_power_of_2(W), L_PAD=next_power_of_2(L))
    kernels = [
        _compile(write_plan._plan_remainder_and_return_writes_kernel,
                 dict(counts_ptr="*i32", base_ptr="*u8", epoch_ptr="*i64", failed_ptr="*i64", flags_ptr="*i64",
                      remainder_ptr="*i64", combine_ptr="*i64"),
                 dict(NODE=node, P=lay.private_rows, PRIVATE_SLOT_ROWS=lay.private_slot_rows,
                      SLOT_WORDS=lay.private_slot_bytes // 4, DISPATCH_STRIDE_BYTES=lay.dispatch_stride_bytes,
                      COMBINE_STRIDE_BYTES=lay.combine_stride_bytes, COMBINE_STAGE_BYTES=lay.combine_stage_offset_bytes,
                      COMBINE_RECV_BYTES=lay.combine_recv_offset_bytes, BLOCK_S=write_plan.BLOCK_S,
                      MAX_ROUTES=lay.max_routes, PROXY_WAIT_WORD=flag_word(wait), SIGNAL_WORD=flag_word(signal),
                      ERROR_WORD=flag_word(Flag.ERROR), STATUS_WORD=flag_word(status),
                      BAD_COUNTS_WORD=flag_word(Flag.BAD_COUNTS), SPIN=True, USE_PTX=True, BACKOFF_NS=200, **shape)),
        _compile(write_plan._plan_private_writes_kernel,
                 dict(counts_ptr="*i32", epoch_ptr="*i64", table_ptr="*i64", remainder_writes_ptr="*i64"),
                 dict(NODE=node, P=lay.private_rows, STRIDE_BYTES=lay.dispatch_stride_bytes, **shape)),
    ]
    for k in kernels:
        assert k.asm.get("cubin"), "no cubin"
    print("compiled", [k.name for k in kernels])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
