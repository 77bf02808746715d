"""Triton cache write: each new token's K/V row goes to its slot; pad slots are skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedattn.attention.fp8 import raw_bytes, to_cache


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_stride,
    value_stride,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    # NOTE: a PAD_SLOT_ID (negative) slot masks out both the read and the write.
    mask = (offs < ROW) & ((offs * 0 + slot) >= 0)
    key = tl.load(key_ptr + token * key_stride + offs, mask=mask)
    value = tl.load(value_ptr + token * value_stride + offs, mask=mask)
    tl.store(key_cache_ptr + slot * ROW + offs, key, mask=mask)
    tl.store(value_cache_ptr + slot * ROW + offs, value, mask=mask)


def _rows(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """[T, Hkv, D] with contiguous (Hkv, D) rows in the cache dtype (a token stride is allowed);
    fp8 rows are quantized here (x / scale, saturated) and passed as their bytes."""
    x = to_cache(x, dtype, scale)
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return raw_bytes(x)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, Hkv, D] into a contiguous flash-layout cache at slot_mapping."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, num_kv_heads, head_size = key_cache.shape
    key, value = _rows(key, key_cache.dtype, k_scale), _rows(value, value_cache.dtype, v_scale)
    row = num_kv_heads * head_size
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        raw_bytes(key_cache),
        raw_bytes(value_cache),
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )
