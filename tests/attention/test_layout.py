"""Cache layouts, sizes and the SPEC's address-translation worked example."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedattn.attention.layout import (
    KVCacheLayout,
    allocate_kv_cache,
    bytes_per_block,
    cache_x,
    check_cache_dtype,
    classic_key_offset,
    gather_kv,
    kv_block_stride,
    kv_cache_shapes,
    kv_head_stride,
    slot_mapping,
    translate,
)
from pagedattn.attention.ops import reshape_and_cache


def test_spec_worked_example_matches_real_strides():
    block_table, block_size, num_kv_heads, head_size = [7, 3, 12], 16, 32, 128
    assert cache_x(torch.float16) == 8
    assert translate(block_table, 20, block_size) == (1, 4, 3)
    assert kv_block_stride(num_kv_heads, head_size, block_size) == 65536
    assert kv_head_stride(head_size, block_size) == 2048
    offset = classic_key_offset(
        block_table, 20, 5, 0, block_size, num_kv_heads, head_size, torch.float16
    )
    assert offset == 3 * 65536 + 5 * 2048 + 4 * 8 == 206880
    key_shape, value_shape = kv_cache_shapes(
        KVCacheLayout.CLASSIC, 13, block_size, num_kv_heads, head_size, torch.float16
    )
    key_cache = torch.empty(key_shape, dtype=torch.float16, device="meta")
    value_cache = torch.empty(value_shape, dtype=torch.float16, device="meta")
    assert key_cache.stride()[:2] == (65536, 2048)
    assert value_cache.stride()[:2] == (65536, 2048)
    # Element (block 3, head 5, vector 0, offset 4, lane 0) sits at the same offset.
    strides = key_cache.stride()
    assert 3 * strides[0] + 5 * strides[1] + 4 * strides[3] == 206880


@pytest.mark.parametrize("dim", [0, 7, 8, 127])
def test_classic_offset_addresses_the_written_element(dim):
    block_table, block_size, num_kv_heads, head_size = [4, 0, 2], 4, 2, 16
    key_cache, value_cache = allocate_kv_cache(
        KVCacheLayout.CLASSIC, 5, block_size, num_kv_heads, head_size, torch.bfloat16
    )
    key = torch.zeros(1, num_kv_heads, head_size)
    key[0, 1, dim % head_size] = 42.0
    slot = block_table[9 // block_size] * block_size + 9 % block_size
    reshape_and_cache(key, key.clone(), key_cache, value_cache, torch.tensor([slot]))
    offset = classic_key_offset(
        block_table, 9, 1, dim % head_size, block_size, num_kv_heads, head_size, torch.bfloat16
    )
    assert key_cache.reshape(-1)[offset] == 42.0
    assert key_cache.count_nonzero() == 1


def test_translate_rejects_token_past_table():
    with pytest.raises(IndexError, match="needs block_idx 3"):
        translate([7, 3, 12], 48, 16)


def test_flash_and_classic_gather_agree():
    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, head_size, seq_len = 8, 3, 16, 21
    key = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
    value = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
    table = torch.tensor([5, 1, 3], dtype=torch.int32)
    pos = torch.arange(seq_len)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    for layout in KVCacheLayout:
        caches = allocate_kv_cache(layout, 6, block_size, num_kv_heads, head_size, torch.float32)
        reshape_and_cache(key, value, *caches, slots)
        got_key, got_value = gather_kv(*caches, table, seq_len)
        torch.testing.assert_close(got_key, key, rtol=0, atol=0)
        torch.testing.assert_close(got_value, value, rtol=0, atol=0)


def test_bytes_per_block_and_budget():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16, B=16: 2*30*16*3*64*2 bytes.
    per_block = bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    assert per_block == 368640


def test_slot_mapping_matches_translate_for_every_token():
    tables = np.array([[7, 3, 12], [2, 0, 0]])
    seq_of_token = np.array([0, 0, 0, 1, 1])
    positions = np.array([0, 20, 47, 0, 5])
    slots = slot_mapping(tables, seq_of_token, positions, 16)
    for slot, seq, pos in zip(slots.tolist(), seq_of_token, positions, strict=True):
        addr = translate(tables[seq].tolist(), int(pos), 16)
        assert slot == addr.block_id * 16 + addr.offset
    assert slots.tolist() == [112, 52, 207, 32, 37]
    with pytest.raises(IndexError, match="past the block tables"):
        slot_mapping(tables, np.array([0]), np.array([48]), 16)
    one = slot_mapping(np.array([[5, 2, 9]]), np.zeros(3, dtype=np.int64), np.arange(3), 1)
    assert one.tolist() == [5, 2, 9]


def test_cache_dtypes_per_device():
    check_cache_dtype(torch.float32, "cpu")
    check_cache_dtype(torch.bfloat16, "cpu")
    check_cache_dtype(torch.float16, "cuda")
    with pytest.raises(ValueError, match="float16 is not supported on cpu"):
        check_cache_dtype(torch.float16, "cpu")


def test_classic_layout_needs_head_size_multiple_of_x():
    with pytest.raises(ValueError, match="multiple of x=8"):
        kv_cache_shapes(KVCacheLayout.CLASSIC, 4, 16, 2, 12, torch.bfloat16)
