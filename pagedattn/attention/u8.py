"""u8 KV cache: asymmetric 8-bit K/V with a scale and a zero point per token per KV head.

This is OpenVINO's CPU KV cache format (``KV_CACHE_PRECISION=u8``), hence the name (not
``int8``: ``bench quant --kv-cache-dtype int8`` is the symmetric variant, measured only). Each
(token, kv head) row of ``D`` values is stored as ``D`` bytes ``q = round((x - min) / scale)`` in
[0, 255], followed by ``U8_SCALE_BYTES`` bytes: the row's ``scale = (max - min) / 255`` and
``min`` as two float32 (the zero point, kept exact rather than rounded to a byte). A cache is a
torch.uint8 tensor ``[num_blocks, B, Hkv, D + 8]``: the scales live inside the block's bytes, so
paging, prefix caching, copy-on-write, preemption, block freeing and the KV store move them with
the block and need no special case. Reads give ``q * scale + min``.

The quantization is ``(x - min) * (1 / scale)`` rounded half to even in float32, the same
operations in the same order as the compiled cache write (csrc/step_ops_cpu.cpp), so both give the
same bytes.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype names of the u8 cache.
U8_NAMES = ("u8",)
# Bytes after each row's D values: float32 scale, float32 min.
U8_SCALE_BYTES = 8
U8_MAX = 255.0


def is_u8(dtype: torch.dtype) -> bool:
    """Whether dtype is the u8 KV cache's storage dtype (torch.uint8)."""
    return dtype == torch.uint8


def row_elements(head_size: int, dtype: torch.dtype) -> int:
    """Elements of one (token, kv head) row in a cache of ``dtype``: D, or D + 8 bytes for u8."""
    return head_size + U8_SCALE_BYTES if is_u8(dtype) else head_size


def head_size_of(row: int, dtype: torch.dtype) -> int:
    """The head size of a cache whose last dim is ``row`` (row_elements' inverse)."""
    return row - U8_SCALE_BYTES if is_u8(dtype) else row


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as u8 rows [..., D + 8]: D bytes, then float32 scale and min (per row)."""
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True)
    scale = (xf.amax(dim=-1, keepdim=True) - lo) * (1.0 / U8_MAX)  # NOTE: as the C++, not / 255
    # NOTE: a constant row has scale 0: every q is 0 and reads give min exactly.
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((xf - lo) * inv).clamp_(0, U8_MAX).to(torch.uint8)
    trailer = torch.cat([scale, lo], dim=-1).contiguous().view(torch.uint8)
    return torch.cat([q, trailer], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values u8 rows [..., D + 8] stand for, [..., D] in ``dtype`` (q * scale + min)."""
    head_size = rows.shape[-1] - U8_SCALE_BYTES
    trailer = rows[..., head_size:].contiguous().view(torch.float32)  # [..., 2]
    scale, lo = trailer[..., :1], trailer[..., 1:]
    return (rows[..., :head_size].float() * scale + lo).to(dtype)
