"""Triton backend: GPU kernels for the cache write, paged decode and paged prefill.

Default layout: flash ``[num_blocks, B, num_kv_heads, head_size]``; a program loads BLOCK_N
whole (head_size-contiguous) rows per step, which coalesces on GPU for any block size B.
On CPU the kernels run under ``TRITON_INTERPRET=1`` (slow; tests only).
"""

from __future__ import annotations

import torch

from pagedattn.attention.backends.base import AttentionBackend
from pagedattn.attention.backends.kernels import cache_write, paged_decode, paged_prefill
from pagedattn.attention.layout import KVCacheLayout, layout_of
from pagedattn.attention.metadata import AttentionMetadata

# Decode splits contexts longer than this into partitions merged by log-sum-exp.
DEFAULT_PARTITION_SIZE = 512


class TritonBackend(AttentionBackend):
    """Paged attention in Triton kernels (flash layout)."""

    name = "triton"
    layout = KVCacheLayout.FLASH

    def __init__(
        self, partition_size: int = DEFAULT_PARTITION_SIZE, block_m: int = 64, block_n: int = 64
    ) -> None:
        block_n = min(block_n, partition_size)
        if partition_size % block_n or min(block_m, block_n) < 16:
            raise ValueError(
                f"partition_size={partition_size} must be a multiple of block_n={block_n}, and "
                f"block_m={block_m}, block_n={block_n} must be >= 16 (tl.dot minimum)"
            )
        self.partition_size, self.block_m, self.block_n = partition_size, block_m, block_n

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write key/value [T, Hkv, D] into their slots with the Triton kernel."""
        _check_cache(key_cache, value_cache)
        cache_write.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
        )

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
        """Decode kernel for pure-decode batches, the prefill kernel otherwise."""
        _check_cache(key_cache, value_cache)
        query = query[: metadata.num_actual_tokens]
        if query.stride(2) != 1:
            query = query.contiguous()
        if metadata.is_pure_decode:
            return paged_decode.paged_decode(
                query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                metadata.max_seq_len, scale=scale, sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
                partition_size=self.partition_size,
                block_n=self.block_n,
            )  # fmt: skip
        return paged_prefill.paged_prefill(
            query, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
            metadata.seq_lens, metadata.max_query_len, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            k_scale=k_scale, v_scale=v_scale, block_m=self.block_m, block_n=self.block_n,
        )  # fmt: skip


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if layout_of(key_cache) is not KVCacheLayout.FLASH or not (
        key_cache.is_contiguous() and value_cache.is_contiguous()
    ):
        raise ValueError("the triton backend needs contiguous flash-layout KV caches")
