"""Cache write (reshape_and_cache) and block copy (copy_blocks) ops in PyTorch, both layouts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedattn.attention.fp8 import raw_bytes, to_cache
from pagedattn.attention.layout import PAD_SLOT_ID, KVCacheLayout, block_size_of, layout_of


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, num_kv_heads, head_size] into their slots; PAD_SLOT_ID slots are skipped.

    ``slot = block_id * B + offset``; the layout (flash or classic) is read off key_cache's rank.
    An fp8 cache stores key / k_scale and value / v_scale, saturated (attention.fp8).
    """
    num_tokens = slot_mapping.shape[0]
    if key.shape[0] < num_tokens or value.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping has {num_tokens} entries but key/value have "
            f"{key.shape[0]}/{value.shape[0]} tokens"
        )
    key, value = key[:num_tokens], value[:num_tokens]
    valid = slot_mapping != PAD_SLOT_ID
    slots = slot_mapping[valid].long()
    key = to_cache(key[valid], key_cache.dtype, k_scale)
    value = to_cache(value[valid], value_cache.dtype, v_scale)
    if layout_of(key_cache) is KVCacheLayout.FLASH:
        num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
        # [num_blocks * B, num_kv_heads, head_size]: slot indexes the flattened view directly.
        # NOTE: raw_bytes: torch has no index_copy_ for fp8; the bytes are the same.
        raw_bytes(key_cache).view(-1, num_kv_heads, head_size).index_copy_(0, slots, raw_bytes(key))
        raw_bytes(value_cache).view(-1, num_kv_heads, head_size).index_copy_(
            0, slots, raw_bytes(value)
        )
        return
    block_size = block_size_of(key_cache)
    block_ids, offsets = slots // block_size, slots % block_size
    _, num_kv_heads, num_vecs, _, x = key_cache.shape
    # [t, num_kv_heads, head_size/x, x]; advanced indices on dims 0 and 3 put t first.
    key_cache[block_ids, :, :, offsets, :] = key.reshape(-1, num_kv_heads, num_vecs, x)
    value_cache[block_ids, :, :, offsets] = value


def copy_blocks(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src_to_dst: Sequence[tuple[int, int]] | torch.Tensor,
) -> None:
    """Copy whole blocks src -> dst in every layer (copy-on-write); all reads precede all writes."""
    pairs = torch.as_tensor(src_to_dst, dtype=torch.int64).reshape(-1, 2)
    if pairs.shape[0] == 0:
        return
    for key_cache, value_cache in kv_caches:
        pairs_dev = pairs.to(key_cache.device)
        src, dst = pairs_dev[:, 0], pairs_dev[:, 1]
        for cache in (raw_bytes(key_cache), raw_bytes(value_cache)):
            cache.index_copy_(0, dst, cache.index_select(0, src))
