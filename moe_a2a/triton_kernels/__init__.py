"""Triton kernels of moe_a2a, one job per file (DESIGN section 3)."""
