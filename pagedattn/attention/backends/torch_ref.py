"""Reference attention: gather each sequence's blocks and run dense masked attention in fp32."""

from __future__ import annotations

import torch

from pagedattn.attention.backends.base import AttentionBackend
from pagedattn.attention.fp8 import from_cache
from pagedattn.attention.layout import KVCacheLayout, gather_kv
from pagedattn.attention.metadata import AttentionMetadata


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the last q_len positions over key/value [L, Hkv, D] (unpaged).

    query is [q_len, Hq, D]; query j sits at absolute position L - q_len + j. Computed in fp32.
    """
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)  # [Hq, q_len, D]
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hq, q_len, L]
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    visible = k_pos <= q_pos  # [q_len, L]
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hq, q_len, D]
    return out.transpose(0, 1).to(query.dtype)


class TorchRefBackend(AttentionBackend):
    """The test oracle: plain per-sequence gather + dense attention; supports both layouts.

    Defaults to the flash layout (shared with cpu/triton, so one cache serves every backend);
    ``TorchRefBackend(KVCacheLayout.CLASSIC)`` allocates the classic layout for layout tests.
    """

    name = "torch"

    def __init__(self, layout: KVCacheLayout = KVCacheLayout.FLASH) -> None:
        self.layout = layout

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Attention of query [T, Hq, D] over the paged cache (layout read off key_cache)."""
        output = torch.zeros_like(query)
        loc = metadata.query_start_loc_cpu
        for s, seq_len in enumerate(metadata.seq_lens_cpu):
            start, end = loc[s], loc[s + 1]
            if end == start:
                continue
            key, value = gather_kv(key_cache, value_cache, metadata.block_tables[s], seq_len)
            key = from_cache(key, torch.float32, k_scale)  # fp8: dequantized; else a cast
            value = from_cache(value, torch.float32, v_scale)
            output[start:end] = dense_attention(
                query[start:end],
                key,
                value,
                scale=scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        return output
