"""Triton kernels for the paged KV cache (flash layout): cache write, decode, prefill."""
