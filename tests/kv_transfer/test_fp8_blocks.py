"""FP8 KV blocks through the KV store: codec format, and a bitwise round trip via the file store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedattn.attention.fp8 import quantize
from pagedattn.attention.layout import KVCacheLayout, allocate_kv_cache
from pagedattn.kv_transfer.codec import BlockFormat, BlockKeySpace, decode_block, encode_block
from pagedattn.kv_transfer.connector import KVConnector
from pagedattn.kv_transfer.file_store import FileKVStore
from tests.kv_transfer.caches import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    NUM_LAYERS,
    assert_blocks_equal,
    hashes,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


HEAD_SIZE = 16  # the classic fp8 layout needs a multiple of x = 16


def fp8_caches(dtype, layout, seed):
    """NUM_LAYERS (key_cache, value_cache) pairs of fp8 blocks; random codes if seeded."""
    caches = [
        allocate_kv_cache(layout, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_SIZE, dtype)
        for _ in range(NUM_LAYERS)
    ]
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for key_cache, value_cache in caches:
            key_cache.copy_(quantize(torch.randn(key_cache.shape, generator=gen) * 50, dtype))
            value_cache.copy_(quantize(torch.randn(value_cache.shape, generator=gen) * 50, dtype))
    return caches


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_format_is_one_byte_per_element_and_keyed_apart(dtype):
    fp8 = BlockFormat(dtype, 3, (BLOCK_SIZE, 2, 8), (BLOCK_SIZE, 2, 8))
    bf16 = BlockFormat(torch.bfloat16, 3, (BLOCK_SIZE, 2, 8), (BLOCK_SIZE, 2, 8))
    assert fp8.element_size == 1 and 2 * fp8.payload_bytes == bf16.payload_bytes
    space = BlockKeySpace("m", "flash", dtype, BLOCK_SIZE)
    key = space.key(b"\x01")
    assert key != BlockKeySpace("m", "flash", torch.bfloat16, BLOCK_SIZE).key(b"\x01")
    assert ("fp8_e4m3" if dtype == torch.float8_e4m3fn else "fp8_e5m2") in key
    value = encode_block(fp8, key, bytes(fp8.payload_bytes))
    assert decode_block(value, fp8, key) is not None
    other = torch.float8_e5m2 if dtype == torch.float8_e4m3fn else torch.float8_e4m3fn
    assert decode_block(value, BlockFormat(other, 3, fp8.key_shape, fp8.value_shape), key) is None


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_fp8_blocks_round_trip_through_file_store(tmp_path: Path, dtype, layout) -> None:
    src = fp8_caches(dtype, layout, seed=0)
    conn = KVConnector(FileKVStore(tmp_path), "tiny-model", layout, dtype, BLOCK_SIZE)
    block_hashes = hashes(3)
    assert conn.save_blocks(src, [3, 5, 7], block_hashes) == 3
    conn.flush()
    dst = fp8_caches(dtype, layout, seed=None)
    fresh = KVConnector(FileKVStore(tmp_path), "tiny-model", layout, dtype, BLOCK_SIZE)
    assert fresh.get_num_new_matched_tokens(block_hashes, 0) == 3 * BLOCK_SIZE
    assert fresh.load_blocks(dst, [10, 11, 12], block_hashes) == 3
    assert_blocks_equal(src, [3, 5, 7], dst, [10, 11, 12])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (10, 11, 12)]
    assert all(not k.view(torch.uint8)[untouched].any() for k, _ in dst)
    # One byte per element: the payload of 3 blocks is 3 * K and V * layers * elements.
    payload = 3 * 2 * NUM_LAYERS * BLOCK_SIZE * 2 * HEAD_SIZE
    assert payload < conn.stats.bytes_written < payload + 3 * 128
    conn.close()
    fresh.close()
