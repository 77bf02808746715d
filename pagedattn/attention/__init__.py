"""Paged KV cache layout, cache ops and attention backends."""

from pagedattn.attention.backends.base import AttentionBackend, get_attn_backend
from pagedattn.attention.layout import (
    PAD_SLOT_ID,
    KVCacheLayout,
    allocate_kv_cache,
    bytes_per_block,
    slot_mapping,
)
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.ops import copy_blocks, reshape_and_cache

__all__ = [
    "PAD_SLOT_ID",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCacheLayout",
    "allocate_kv_cache",
    "bytes_per_block",
    "copy_blocks",
    "get_attn_backend",
    "reshape_and_cache",
    "slot_mapping",
]
