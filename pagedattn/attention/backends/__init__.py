"""Attention backends: torch (reference), cpu (vectorised PyTorch), triton (GPU kernels)."""

from pagedattn.attention.backends.base import AttentionBackend, get_attn_backend

__all__ = ["AttentionBackend", "get_attn_backend"]
