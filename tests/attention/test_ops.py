"""reshape_and_cache writes exactly the addressed slots; copy_blocks copies exactly."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention.layout import PAD_SLOT_ID, KVCacheLayout, allocate_kv_cache, gather_kv
from pagedattn.attention.ops import copy_blocks, reshape_and_cache

SENTINEL = -7.0


def _sentinel_caches(layout, dtype, num_blocks=6, block_size=4, num_kv_heads=2, head_size=16):
    caches = allocate_kv_cache(layout, num_blocks, block_size, num_kv_heads, head_size, dtype)
    for cache in caches:
        cache.fill_(SENTINEL)
    return caches


@pytest.mark.parametrize("layout", list(KVCacheLayout))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_only_addressed_slots(layout, dtype):
    block_size, num_kv_heads, head_size = 4, 2, 16
    key_cache, value_cache = _sentinel_caches(layout, dtype)
    slots = torch.tensor([9, PAD_SLOT_ID, 0, 23, PAD_SLOT_ID, 14])
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(6, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(6, num_kv_heads, head_size, generator=gen).to(dtype)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    # Read every slot back as [num_blocks * B, Hkv, D] through an identity block table.
    table = torch.arange(6)
    all_keys, all_values = gather_kv(key_cache, value_cache, table, 6 * block_size)
    written = {9: 0, 0: 2, 23: 3, 14: 5}
    for slot in range(6 * block_size):
        if slot in written:
            assert torch.equal(all_keys[slot], key[written[slot]])
            assert torch.equal(all_values[slot], value[written[slot]])
        else:
            assert (all_keys[slot] == SENTINEL).all() and (all_values[slot] == SENTINEL).all()


def test_reshape_and_cache_rejects_short_key():
    key_cache, value_cache = _sentinel_caches(KVCacheLayout.FLASH, torch.float32)
    key = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries"):
        reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([0, 1]))


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_copy_blocks_copies_exactly(layout):
    num_layers, gen = 2, torch.Generator().manual_seed(2)
    kv_caches = []
    for _ in range(num_layers):
        key_cache, value_cache = _sentinel_caches(layout, torch.float32)
        key_cache.copy_(torch.randn(key_cache.shape, generator=gen))
        value_cache.copy_(torch.randn(value_cache.shape, generator=gen))
        kv_caches.append((key_cache, value_cache))
    before = [(k.clone(), v.clone()) for k, v in kv_caches]
    # Block 1 is both a destination and (earlier) a source: sources are read before any write.
    src_to_dst = [(1, 4), (2, 1), (1, 5)]
    copy_blocks(kv_caches, src_to_dst)
    for (key_cache, value_cache), (old_key, old_value) in zip(kv_caches, before, strict=True):
        expected_key, expected_value = old_key.clone(), old_value.clone()
        for src, dst in src_to_dst:
            expected_key[dst] = old_key[src]
            expected_value[dst] = old_value[src]
        assert torch.equal(key_cache, expected_key)
        assert torch.equal(value_cache, expected_value)


def test_copy_blocks_empty_is_noop():
    key_cache, value_cache = _sentinel_caches(KVCacheLayout.FLASH, torch.float32)
    copy_blocks([(key_cache, value_cache)], [])
    assert (key_cache == SENTINEL).all()
