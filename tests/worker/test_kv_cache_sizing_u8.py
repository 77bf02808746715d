"""KV pool sizing with a u8 cache: D bytes plus 8 (float32 scale and min) per token and kv head."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedattn.config import CacheConfig, ConfigError, SchedulerConfig
from pagedattn.worker.kv_cache_sizing import plan_kv_cache

SMOLLM = SimpleNamespace(num_layers=30, num_kv_heads=3, head_size=64)


def _plan(kv_cache_dtype: str, backend: str = "cpu", **kwargs):
    return plan_kv_cache(
        CacheConfig(kv_cache_dtype=kv_cache_dtype, **kwargs), SchedulerConfig(), SMOLLM,
        torch.bfloat16, backend, torch.device("cpu"), 8192,
    )  # fmt: skip


def test_same_memory_holds_2d_over_d_plus_8_times_the_bf16_blocks():
    budget = 512 << 20
    u8 = _plan("u8", kv_cache_memory=budget)
    bf16 = _plan("bfloat16", kv_cache_memory=budget)
    assert u8.dtype == torch.uint8
    assert u8.bytes_per_block == 2 * 30 * 16 * 3 * (64 + 8)  # D bytes + scale + min per row
    # 128 bytes of bf16 per row against 72: 16/9 = 1.78x the blocks (fp8: 2x).
    assert u8.num_blocks == budget // u8.bytes_per_block
    assert 9 * u8.num_blocks // 16 == bf16.num_blocks
    assert u8.num_bytes <= budget


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_u8_is_refused_where_no_kernel_reads_it(backend):
    assert _plan("u8", backend="torch", num_blocks=4).dtype == torch.uint8
    with pytest.raises(ConfigError, match="reads the u8 cache"):
        _plan("u8", backend=backend, num_blocks=4)
