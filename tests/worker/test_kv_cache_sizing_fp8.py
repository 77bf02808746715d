"""KV pool sizing with an FP8 cache: one byte per element, so more blocks in the same budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedattn.config import CacheConfig, ConfigError, SchedulerConfig
from pagedattn.worker.kv_cache_sizing import plan_kv_cache

SMOLLM = SimpleNamespace(num_layers=30, num_kv_heads=3, head_size=64)


def _plan(kv_cache_dtype: str, backend: str = "cpu", model_dtype=torch.bfloat16, **kwargs):
    return plan_kv_cache(
        CacheConfig(kv_cache_dtype=kv_cache_dtype, **kwargs), SchedulerConfig(), SMOLLM,
        model_dtype, backend, torch.device("cpu"), 8192,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_same_memory_holds_2x_bf16_and_4x_float32_blocks(name):
    budget = 512 << 20
    fp8 = _plan(name, kv_cache_memory=budget)
    bf16 = _plan("bfloat16", kv_cache_memory=budget)
    fp32 = _plan("float32", model_dtype=torch.float32, kv_cache_memory=budget)
    assert fp8.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert fp8.bytes_per_block == 2 * 30 * 16 * 3 * 64  # one byte per element
    assert fp8.num_blocks == 2 * bf16.num_blocks == 4 * fp32.num_blocks
    assert fp8.num_bytes <= budget


def test_fp8_needs_a_backend_that_reads_it():
    assert _plan("fp8", backend="triton", num_blocks=4).dtype == torch.float8_e4m3fn
    with pytest.raises(ConfigError, match="needs an attention backend that reads fp8"):
        _plan("fp8", backend="flash_attn", num_blocks=4)
