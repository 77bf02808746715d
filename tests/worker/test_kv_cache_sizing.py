"""KV pool sizing: explicit blocks or bytes win; the default is a capped share of free memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedattn.attention.layout import bytes_per_block
from pagedattn.config import CacheConfig, SchedulerConfig
from pagedattn.worker import kv_cache_sizing
from pagedattn.worker.kv_cache_sizing import DEFAULT_MAX_KV_CACHE_BYTES, plan_kv_cache

# SmolLM2-135M's cache shape: 30 layers, 3 KV heads of 64, float32 (45 KiB per token).
SMOLLM = SimpleNamespace(num_layers=30, num_kv_heads=3, head_size=64)
GIB = 1 << 30


def _plan(free_bytes: int, monkeypatch, max_model_len: int = 8192, **cache_kwargs):
    monkeypatch.setattr(kv_cache_sizing, "free_memory_bytes", lambda device: free_bytes)
    return plan_kv_cache(
        CacheConfig(**cache_kwargs), SchedulerConfig(), SMOLLM, torch.float32, "cpu",
        torch.device("cpu"), max_model_len,
    )  # fmt: skip


def test_the_default_pool_of_a_small_model_is_capped(monkeypatch):
    # 22 GiB free: a 0.2 share was a 4.4 GiB pool for a 135M model.
    plan = _plan(22 * GIB, monkeypatch)
    assert DEFAULT_MAX_KV_CACHE_BYTES - plan.bytes_per_block < plan.num_bytes
    assert plan.num_bytes <= DEFAULT_MAX_KV_CACHE_BYTES


def test_the_default_pool_holds_two_full_length_sequences(monkeypatch):
    plan = _plan(100 * GIB, monkeypatch, max_model_len=32768)
    per_block = bytes_per_block(30, 16, 3, 64, torch.float32)
    assert plan.num_blocks == 2 * (32768 // 16) and plan.num_bytes > DEFAULT_MAX_KV_CACHE_BYTES
    assert plan.bytes_per_block == per_block


def test_a_small_host_gets_its_share_and_explicit_sizes_win(monkeypatch):
    small = _plan(2 * GIB, monkeypatch)
    assert small.num_bytes <= int(2 * GIB * 0.2)
    big = _plan(22 * GIB, monkeypatch, kv_cache_memory=4 * GIB)
    assert big.num_blocks == 4 * GIB // big.bytes_per_block
    assert _plan(22 * GIB, monkeypatch, num_blocks=7).num_blocks == 7


@pytest.mark.parametrize("fraction", [0.05, 0.5])
def test_an_explicit_fraction_is_the_users_share(monkeypatch, fraction):
    plan = _plan(64 * GIB, monkeypatch, kv_cache_memory_fraction=fraction)
    assert plan.num_blocks == int(64 * GIB * fraction) // plan.bytes_per_block
