"""Helpers shared by the Triton attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


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
):
    """Rows [len(pos), HEAD_PAD] of one KV head, read through the block table (flash layout)."""
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    dims = tl.arange(0, HEAD_PAD)
    offs = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_SIZE + dims[None, :]
    return tl.load(cache_ptr + offs, mask=valid[:, None] & (dims[None, :] < HEAD_SIZE), other=0.0)


def dot_precision(is_fp32: bool) -> str:
    """fp32 caches use exact IEEE dots (tf32 would cost ~3 digits); 16-bit caches the default."""
    return "ieee" if is_fp32 else "tf32"
