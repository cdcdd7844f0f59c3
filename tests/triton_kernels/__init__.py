"""Tests of moe_a2a.triton_kernels (run under TRITON_INTERPRET=1 on CPU)."""
