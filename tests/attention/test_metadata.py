"""AttentionMetadata.build: query spans, positions and slot mapping."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention.metadata import AttentionMetadata


def test_build_mixed_batch():
    # seq 0: decode at position 34 (35 tokens, table [7, 3, 12]); seq 1: chunk of 3 of 5 tokens.
    meta = AttentionMetadata.build([1, 3], [35, 5], [[7, 3, 12], [2]], block_size=16)
    assert meta.num_actual_tokens == 4
    assert meta.query_start_loc_cpu == [0, 1, 4]
    assert meta.query_lens_cpu == [1, 3]
    assert meta.max_query_len == 3 and meta.max_seq_len == 35
    assert not meta.is_pure_decode
    assert meta.slot_mapping.tolist() == [12 * 16 + 2, 2 * 16 + 2, 2 * 16 + 3, 2 * 16 + 4]
    assert meta.block_tables.tolist() == [[7, 3, 12], [2, 0, 0]]
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert meta.seq_lens.tolist() == [35, 5]


def test_build_rejects_too_few_blocks():
    with pytest.raises(ValueError, match="inconsistent"):
        AttentionMetadata.build([1], [33], [[0, 1]], block_size=16)
