"""Helpers shared by the Triton attention kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# FP8 constexpr of the kernels: how the cache's bytes are read (the cache is passed as uint8).
FP8_NONE, FP8_E4M3, FP8_E5M2 = 0, 1, 2


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap), with tanh written through exp (no libdevice dependency)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))


@triton.jit
def load_paged_rows(
    cache_ptr,
    block_table_ptr,
    pos,
    valid,
    kv_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    FP8: tl.constexpr,
):
    """Rows [len(pos), HEAD_PAD] of one KV head, read through the block table (flash layout);
    an fp8 cache's rows come back as fp32 without the layer's scale."""
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    dims = tl.arange(0, HEAD_PAD)
    offs = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_SIZE + dims[None, :]
    rows = tl.load(cache_ptr + offs, mask=valid[:, None] & (dims[None, :] < HEAD_SIZE), other=0)
    if FP8 != FP8_NONE:
        rows = dequant_fp8(rows, FP8)
    return rows


@triton.jit
def dequant_fp8(raw, FP8: tl.constexpr):
    """fp32 values of fp8 bytes (uint8): e5m2 is the top byte of an fp16; e4m3's exponent and
    mantissa shifted into an fp16 are the value times 2^-8, subnormals included (exact)."""
    x = raw.to(tl.uint16)
    if FP8 == FP8_E4M3:
        bits = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return (x << 8).to(tl.float16, bitcast=True).to(tl.float32)


def fp8_kind(cache: torch.Tensor) -> int:
    """The kernels' FP8 constexpr for a cache tensor."""
    if cache.dtype == torch.float8_e4m3fn:
        return FP8_E4M3
    return FP8_E5M2 if cache.dtype == torch.float8_e5m2 else FP8_NONE


def kernel_cache(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels get: an fp8 cache's bytes as uint8 (dequantized in dequant_fp8)."""
    return cache.view(torch.uint8) if fp8_kind(cache) != FP8_NONE else cache


def dot_precision(is_fp32: bool) -> str:
    """fp32 caches (and fp8, read as fp32) use exact IEEE dots (tf32 would cost ~3 digits);
    16-bit caches the default."""
    return "ieee" if is_fp32 else "tf32"
