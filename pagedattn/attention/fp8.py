"""FP8 KV cache: the dtypes, per-layer scales, and quantize / dequantize in PyTorch.

A cache in fp8 (e4m3 or e5m2, one byte per element) stores ``x / scale`` saturated to the
format's largest finite value, so no NaN or Inf is ever written (vLLM does the same); reads
multiply by the layer's scale. ``k_scale``/``v_scale`` are per layer, 1.0 unless
``--calculate-kv-scales`` sets them from the first prefill's amax (``amax / fp8 max``).
"""

from __future__ import annotations

import torch

from pagedattn.attention import u8

# --kv-cache-dtype name -> torch dtype; "fp8" is e4m3, as in vLLM.
FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The largest finite value of each format: quantization saturates there.
FP8_MAX = {
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),  # 448
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),  # 57344
}
# NOTE: a computed scale never goes below this (an all-zero first prefill would give scale 0).
MIN_SCALE = 1e-6


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether dtype is one of the FP8 KV cache dtypes."""
    return dtype in FP8_MAX


def fp8_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype spelling of an fp8 torch dtype (fp8_e4m3 / fp8_e5m2)."""
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else "fp8_e5m2"


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x / scale in fp8 ``dtype``, saturated to +-FP8_MAX (round to nearest even, as torch)."""
    limit = FP8_MAX[dtype]
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32):
    """The values an fp8 tensor stands for (x * scale) in ``dtype``."""
    return (x.float() * scale).to(dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x in the cache's dtype: quantized for an fp8 cache, u8 rows (values, scale, min) for a
    u8 cache (attention.u8; scale unused), else a plain cast (scale unused)."""
    if u8.is_u8(cache_dtype):
        return u8.quantize(x)
    return quantize(x, cache_dtype, scale) if is_fp8(cache_dtype) else x.to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache contents in ``dtype``: dequantized (times scale) for fp8, rows [..., D + 8] to
    [..., D] for u8, else a plain cast."""
    if u8.is_u8(x.dtype):
        return u8.dequantize(x, dtype)
    return dequantize(x, scale, dtype) if is_fp8(x.dtype) else x.to(dtype)


def compute_scale(x: torch.Tensor, dtype: torch.dtype) -> float:
    """The scale that maps x's amax onto the format's largest value (amax / fp8 max)."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return max(amax / FP8_MAX[dtype], MIN_SCALE)


def raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A one-byte cache as uint8 (the same memory) for ops torch lacks on fp8 (index_copy_)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
