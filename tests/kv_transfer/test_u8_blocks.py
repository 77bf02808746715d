"""u8 KV blocks through the KV store: each row's scale and min are in the block's bytes, so a
bitwise block round trip via the file store restores the values."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedattn.attention import u8
from pagedattn.attention.layout import KVCacheLayout, allocate_kv_cache
from pagedattn.kv_transfer.connector import KVConnector
from pagedattn.kv_transfer.file_store import FileKVStore
from tests.kv_transfer.caches import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    NUM_LAYERS,
    assert_blocks_equal,
    hashes,
)

HEAD_SIZE = 16
FLASH = KVCacheLayout.FLASH


def u8_caches(seed):
    """NUM_LAYERS (key_cache, value_cache) pairs of u8 rows; random values if seeded."""
    caches = [
        allocate_kv_cache(FLASH, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_SIZE, torch.uint8)
        for _ in range(NUM_LAYERS)
    ]
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for cache in (c for pair in caches for c in pair):
            shape = (*cache.shape[:-1], HEAD_SIZE)
            cache.copy_(u8.quantize(torch.randn(shape, generator=gen) * 5))
    return caches


def test_u8_blocks_round_trip_through_file_store(tmp_path: Path) -> None:
    src = u8_caches(seed=0)
    conn = KVConnector(FileKVStore(tmp_path), "tiny-model", FLASH, torch.uint8, BLOCK_SIZE)
    block_hashes = hashes(3)
    assert conn.save_blocks(src, [3, 5, 7], block_hashes) == 3
    conn.flush()
    dst = u8_caches(seed=None)
    fresh = KVConnector(FileKVStore(tmp_path), "tiny-model", FLASH, torch.uint8, BLOCK_SIZE)
    assert fresh.get_num_new_matched_tokens(block_hashes, 0) == 3 * BLOCK_SIZE
    assert fresh.load_blocks(dst, [10, 11, 12], block_hashes) == 3
    assert_blocks_equal(src, [3, 5, 7], dst, [10, 11, 12])
    key = u8.dequantize(dst[0][0][10])
    assert torch.equal(key, u8.dequantize(src[0][0][3]))  # the scales came along
    # D bytes + 8 (scale, min) per row: 3 blocks of K and V in every layer.
    payload = 3 * 2 * NUM_LAYERS * BLOCK_SIZE * 2 * (HEAD_SIZE + u8.U8_SCALE_BYTES)
    assert payload < conn.stats.bytes_written < payload + 3 * 128
    conn.close()
    fresh.close()
