"""Triton kernels of moe_a2a, one job per file: routing, dispatch, combine, quant, sync."""
