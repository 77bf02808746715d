"""KV cache layouts, sizes, strides and software address translation (SPEC section 2)."""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np
import torch

from pagedattn.attention.u8 import is_u8, row_elements

# NOTE: a slot_mapping entry equal to PAD_SLOT_ID marks a padding token whose K/V is not written.
PAD_SLOT_ID = -1

# Bytes per 16-byte vector load of the classic kernel: x = CACHE_VECTOR_BYTES / sizeof(cache_t).
CACHE_VECTOR_BYTES = 16

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# torch.uint8: the u8 cache (attention.u8), rows of D bytes plus their scale and min; CPU only.
_CPU_DTYPES = (torch.float32, torch.bfloat16, *_FP8_DTYPES, torch.uint8)
_GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16, *_FP8_DTYPES)


class KVCacheLayout(enum.Enum):
    """How one layer's K/V blocks are laid out in memory."""

    # [num_blocks, B, num_kv_heads, head_size] for key and value: one contiguous row per token.
    FLASH = "flash"
    # key [num_blocks, Hkv, head_size/x, B, x], value [num_blocks, Hkv, head_size, B]
    CLASSIC = "classic"


class BlockAddress(NamedTuple):
    """Where logical token i of a sequence lives: table index, offset in block, physical block."""

    block_idx: int
    offset: int
    block_id: int


def check_cache_dtype(dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise if the KV cache dtype is not supported on the device."""
    is_cpu = torch.device(device).type == "cpu"
    allowed = _CPU_DTYPES if is_cpu else _GPU_DTYPES
    if dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"KV cache dtype {dtype} is not supported on {device}: use one of {names}")


def cache_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector in the classic key layout (16 fp8, 8 fp16/bf16, 4 fp32)."""
    return CACHE_VECTOR_BYTES // torch.empty((), dtype=dtype).element_size()


def kv_cache_shapes(
    layout: KVCacheLayout,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of (key_cache, value_cache) of one layer (a u8 row is D + 8 bytes, flash only)."""
    if layout is KVCacheLayout.FLASH:
        shape = (num_blocks, block_size, num_kv_heads, row_elements(head_size, dtype))
        return shape, shape
    if is_u8(dtype):
        raise ValueError("the u8 KV cache needs the flash layout, not the classic one")
    x = cache_x(dtype)
    if head_size % x:
        raise ValueError(
            f"head_size={head_size} must be a multiple of x={x} for the classic layout"
        )
    key_shape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    return key_shape, (num_blocks, num_kv_heads, head_size, block_size)


def allocate_kv_cache(
    layout: KVCacheLayout,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate one layer's zeroed (key_cache, value_cache)."""
    check_cache_dtype(dtype, device)
    key_shape, value_shape = kv_cache_shapes(
        layout, num_blocks, block_size, num_kv_heads, head_size, dtype
    )
    key_cache = torch.zeros(key_shape, dtype=dtype, device=device)
    return key_cache, torch.zeros(value_shape, dtype=dtype, device=device)


def layout_of(key_cache: torch.Tensor) -> KVCacheLayout:
    """Infer the layout from the key cache's rank (4: flash, 5: classic)."""
    if key_cache.dim() == 4:
        return KVCacheLayout.FLASH
    if key_cache.dim() == 5:
        return KVCacheLayout.CLASSIC
    raise ValueError(
        f"key_cache has shape {tuple(key_cache.shape)}: expected 4 dims (flash layout) "
        "or 5 dims (classic layout)"
    )


def block_size_of(key_cache: torch.Tensor) -> int:
    """Token slots per block of a key cache in either layout."""
    return key_cache.shape[1] if layout_of(key_cache) is KVCacheLayout.FLASH else key_cache.shape[3]


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block ID costs across all layers (K and V); a u8 row is D + 8 bytes."""
    element_size = torch.empty((), dtype=dtype).element_size()
    row = row_elements(head_size, dtype)
    return 2 * num_layers * block_size * num_kv_heads * row * element_size


def kv_block_stride(num_kv_heads: int, head_size: int, block_size: int) -> int:
    """Elements between consecutive blocks in the classic layout."""
    return num_kv_heads * head_size * block_size


def kv_head_stride(head_size: int, block_size: int) -> int:
    """Elements between consecutive KV heads of one block in the classic layout."""
    return head_size * block_size


def translate(block_table: list[int], token_idx: int, block_size: int) -> BlockAddress:
    """Software address translation of logical token ``token_idx`` (one token)."""
    block_idx, offset = divmod(token_idx, block_size)
    if block_idx >= len(block_table):
        raise IndexError(
            f"token {token_idx} needs block_idx {block_idx}, table has {len(block_table)} blocks"
        )
    return BlockAddress(block_idx, offset, block_table[block_idx])


def slot_mapping(
    block_tables: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """The cache slot of every token: ``block_id * block_size + offset`` (SPEC section 2).

    block_tables: [num_seqs, max_blocks]; seq_of_token, positions: [T]. Returns [T] int64.
    The one place the address formula is written; ``translate`` is its one-token form.
    """
    block_idx, offset = np.divmod(positions, block_size)
    if len(positions) and int(block_idx.max()) >= block_tables.shape[1]:
        raise IndexError(
            f"position {int(positions.max())} is past the block tables "
            f"({block_tables.shape[1]} blocks of {block_size})"
        )
    return block_tables[seq_of_token, block_idx].astype(np.int64) * block_size + offset


def classic_key_offset(
    block_table: list[int],
    token_idx: int,
    kv_head: int,
    dim: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> int:
    """Element offset from the key cache base of key[token_idx, kv_head, dim], classic layout."""
    x = cache_x(dtype)
    addr = translate(block_table, token_idx, block_size)
    return (
        addr.block_id * kv_block_stride(num_kv_heads, head_size, block_size)
        + kv_head * kv_head_stride(head_size, block_size)
        + (dim // x) * block_size * x
        + addr.offset * x
        + dim % x
    )


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one sequence's first seq_len keys and values through its block table.

    Returns (key, value), each [seq_len, num_kv_heads, head_size], in either layout.
    """
    block_size = block_size_of(key_cache)
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    if layout_of(key_cache) is KVCacheLayout.FLASH:
        num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
        key = key_cache[blocks].reshape(-1, num_kv_heads, head_size)  # [n*B, Hkv, D]
        value = value_cache[blocks].reshape(-1, num_kv_heads, head_size)
    else:
        _, num_kv_heads, _, _, x = key_cache.shape
        head_size = value_cache.shape[2]
        # [n, Hkv, D/x, B, x] -> [n, B, Hkv, D/x, x] -> [n*B, Hkv, D]
        key = key_cache[blocks].permute(0, 3, 1, 2, 4).reshape(-1, num_kv_heads, head_size)
        # [n, Hkv, D, B] -> [n, B, Hkv, D] -> [n*B, Hkv, D]
        value = value_cache[blocks].permute(0, 3, 1, 2).reshape(-1, num_kv_heads, head_size)
    return key[:seq_len], value[:seq_len]
