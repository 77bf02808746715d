"""Paged KV caches for the kv_transfer tests: random contents, block hashes, bitwise checks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.attention.backends.torch_ref import TorchRefBackend
from pagedattn.attention.layout import KVCacheLayout
from pagedattn.core.kv_cache_utils import hash_request_tokens

BLOCK_SIZE = 4
NUM_LAYERS = 3
NUM_BLOCKS = 16


def make_caches(
    seed: int | None, layout: KVCacheLayout = KVCacheLayout.FLASH, dtype=torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (key_cache, value_cache) per layer from the backend's allocator; random if seeded."""
    # NOTE: use_extension=False: the allocator is the same, and no C++ build is triggered.
    flash = layout is KVCacheLayout.FLASH
    backend = CpuBackend(use_extension=False) if flash else TorchRefBackend(layout)
    caches = [
        backend.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, 2, 8, dtype, "cpu")
        for _ in range(NUM_LAYERS)
    ]
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for key_cache, value_cache in caches:
            key_cache.copy_(torch.randn(key_cache.shape, generator=gen).to(dtype))
            value_cache.copy_(torch.randn(value_cache.shape, generator=gen).to(dtype))
    return caches


def hashes(num_blocks: int, salt: str | None = None) -> list[bytes]:
    tokens = list(range(100, 100 + num_blocks * BLOCK_SIZE))
    return hash_request_tokens(BLOCK_SIZE, tokens, "seed", cache_salt=salt)


def assert_blocks_equal(src, src_ids: Sequence[int], dst, dst_ids: Sequence[int]) -> None:
    for (k_src, v_src), (k_dst, v_dst) in zip(src, dst, strict=True):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(k_src[s].view(torch.uint8), k_dst[d].view(torch.uint8))
            assert torch.equal(v_src[s].view(torch.uint8), v_dst[d].view(torch.uint8))
