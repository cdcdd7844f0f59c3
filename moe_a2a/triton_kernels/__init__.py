"""Triton kernels of moe_a2a, one public module per job: routing, dispatch, combine, quant, node_sync,
sync. Each reads top to bottom: overview, kernels, launchers. What they share is private:
`_details.py` (the `@triton.jit` helpers), `_checks.py` (argument checks), `_launch.py` (words, blocks,
grids and remembered launches)."""
