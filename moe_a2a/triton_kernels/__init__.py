"""Triton kernels of moe_a2a, laid out as Triton's own `triton_kernels`: one public launcher module per op
(routing, dispatch, combine, rank_rows, relay, write_plan, quant, node_sync, sync: overview, argument checks,
block sizes and grids, remembered launches) and its `@triton.jit` bodies in a private module beside it
(`_dispatch_kernels.py` for `dispatch.py`, ...), each kernel named after its launcher plus `_kernel`
(`unpack_tokens_by_expert` -> `_unpack_tokens_by_expert_kernel`). What they share is private too:
`_details.py` (the `@triton.jit` helpers), `_checks.py` (argument checks), `_launch.py` (words, blocks,
grids and remembered launches)."""
