"""The reference backend against dense attention on the unpaged K/V, both layouts."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention.backends.torch_ref import TorchRefBackend
from pagedattn.attention.layout import KVCacheLayout

from ..paged_case import assert_matches_dense, make_case, mixed_specs

LAYOUTS = [KVCacheLayout.FLASH, KVCacheLayout.CLASSIC]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 8)])
def test_mixed_batch_matches_dense(layout, block_size, num_kv_heads, group):
    case = make_case(
        mixed_specs(block_size),
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        layout=layout,
        seed=block_size * 10 + group,
    )
    assert_matches_dense(TorchRefBackend(layout), case)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_softcap_shared_prefix(layout, dtype):
    specs = [(40, 1), (37, 5), (9, 9), (16, 1)]
    case = make_case(
        specs,
        block_size=8,
        num_kv_heads=2,
        group=3,
        dtype=dtype,
        layout=layout,
        shared_prefix_blocks=3,
    )
    backend = TorchRefBackend(layout)
    assert_matches_dense(backend, case, sliding_window=7)
    assert_matches_dense(backend, case, logits_soft_cap=2.0, scale=0.5)
    assert_matches_dense(backend, case, sliding_window=1, logits_soft_cap=5.0)
