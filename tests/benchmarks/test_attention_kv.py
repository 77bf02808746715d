"""bench attention's KV dtype rows: caches copied onto pool memory, every kernel timed."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedattn.attention import u8
from pagedattn.benchmarks import attention_kv
from pagedattn.benchmarks.bench_attention import HEAD_CONFIGS, build_decode_batch, interleaved_ms
from pagedattn.cpu import extension as cpu_ext


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
def test_in_pool_is_an_equal_copy_on_its_own_memory(dtype):
    values = torch.randn(6, 16, 3, 64)
    cache = u8.quantize(values) if dtype == torch.uint8 else values.to(dtype)
    pooled = attention_kv._in_pool(cache)
    assert pooled.shape == cache.shape and pooled.dtype == cache.dtype
    assert pooled.data_ptr() != cache.data_ptr()
    assert torch.equal(pooled.view(torch.uint8), cache.view(torch.uint8))


def test_kv_dtype_rows_time_every_cache_against_bf16():
    if cpu_ext.get_extension() is None:
        pytest.skip("the compiled extension did not build here")
    args = argparse.Namespace(
        kv_cache_dtype=["fp8_e4m3", "u8"], heads=["9/3x64"], kv_contexts=[48], num_seqs=3,
        block_size=16, warmup=0, repeats=1,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    rows = attention_kv.kv_dtype_rows(args, gen, build_decode_batch, interleaved_ms, HEAD_CONFIGS)
    kernels = {r["kernel"]: r for r in rows}
    amx = {"bf16-amx", "fp8_e4m3-amx", "u8-amx"} if cpu_ext.amx_available() else set()
    expected = {"bf16", "fp8_e4m3", "u8"} | amx
    assert set(kernels) == expected
    assert kernels["bf16"]["diff"] == 0.0 and kernels["bf16"]["speedup"] <= 1.0
    # Outputs of unit-variance random K/V: u8 within a few of its steps, fp8 within its mantissa.
    assert kernels["u8"]["diff"] < 0.05 and kernels["fp8_e4m3"]["diff"] < 0.15
    if amx:
        assert kernels["u8-amx"]["diff"] < 0.05 and kernels["fp8_e4m3-amx"]["diff"] < 0.15
    assert all(r["ms"] > 0 for r in rows)
