"""The cpu backend against dense attention on the unpaged K/V."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention.backends.cpu import CpuBackend

from ..paged_case import assert_matches_dense, make_case, mixed_specs

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 8)])
def test_mixed_batch_matches_dense(dtype, block_size, num_kv_heads, group):
    case = make_case(
        mixed_specs(block_size),
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        dtype=dtype,
        seed=block_size * 10 + group,
    )
    assert_matches_dense(CpuBackend(), case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_pure_decode_batch(dtype, block_size):
    specs = [(5 * block_size, 1), (3 * block_size - 1, 1), (block_size + 1, 1), (1, 1)]
    case = make_case(specs, block_size=block_size, num_kv_heads=3, group=3, dtype=dtype)
    assert case.metadata.is_pure_decode
    assert_matches_dense(CpuBackend(), case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("specs", [[(40, 1), (37, 1), (33, 1)], [(40, 1), (37, 5), (9, 9)]])
def test_window_softcap_shared_prefix(dtype, specs):
    case = make_case(
        specs, block_size=8, num_kv_heads=2, group=3, dtype=dtype, shared_prefix_blocks=3, seed=3
    )
    backend = CpuBackend()
    assert_matches_dense(backend, case, sliding_window=7)
    assert_matches_dense(backend, case, logits_soft_cap=2.0, scale=0.5)
    assert_matches_dense(backend, case, sliding_window=1, logits_soft_cap=5.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("last_len", [24, 9])
def test_decode_equal_lengths_and_padded_tables(dtype, last_len):
    # Equal lengths take the mask-free path; with a shorter last sequence its unused table entry
    # holds a padding value (-1) that must never be dereferenced.
    specs = [(24, 1), (24, 1), (last_len, 1)]
    case = make_case(specs, block_size=8, num_kv_heads=2, group=3, dtype=dtype, seed=5)
    tables = case.metadata.block_tables
    num_used = -(-last_len // 8)
    tables[2, num_used:] = -1
    case.metadata.block_tables = torch.cat([tables, torch.full_like(tables, -1)], dim=1)
    assert_matches_dense(CpuBackend(), case)
