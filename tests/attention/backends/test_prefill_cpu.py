"""The compiled prefill kernel (csrc/attention_prefill_cpu.h) against the dense fp64 oracle.

Spans longer than its key chunks (64) and query tiles (32), GQA groups whose rows do not fill
whole vectors, head sizes that are not a multiple of its blocks, windows and soft caps that cut
through chunks, cached prefixes, and the bad inputs it must refuse."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention import u8
from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.cpu import extension as cpu_ext

from ..paged_case import assert_matches_dense, make_case

pytestmark = pytest.mark.skipif(
    cpu_ext.get_extension() is None, reason="the compiled CPU extension does not build here"
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "specs,block_size,num_kv_heads,group,head_size",
    [
        ([(200, 200)], 16, 2, 3, 64),  # a whole prompt: 7 tiles, 4 chunks
        ([(150, 70), (65, 65)], 8, 1, 5, 80),  # a cached prefix; 80 = 64 + 16
        ([(97, 97)], 1, 3, 1, 16),  # one-token blocks, MHA (a tile's rows fill 2 vectors)
        ([(130, 33)], 32, 2, 4, 128),
    ],
)
def test_long_spans_match_dense(dtype, specs, block_size, num_kv_heads, group, head_size):
    case = make_case(
        specs,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_size=head_size,
        dtype=dtype,
        seed=head_size + group,
    )
    backend = CpuBackend(use_extension=True)
    assert_matches_dense(backend, case, scale=head_size**-0.5)
    assert_matches_dense(backend, case, scale=head_size**-0.5, sliding_window=45)
    assert_matches_dense(backend, case, scale=0.3, sliding_window=70, logits_soft_cap=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_gathered_sdpa_path(dtype):
    # The same span through the kernel and through the gather + SDPA fallback.
    case = make_case(
        [(300, 260)], block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=dtype
    )
    kwargs = dict(scale=0.125, sliding_window=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0)
    args = (case.query, case.key_cache, case.value_cache, case.metadata.block_tables[0], 300)
    compiled = CpuBackend(use_extension=True)._prefill(*args, **kwargs)
    gathered = CpuBackend(use_extension=False)._prefill(*args, **kwargs)
    atol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(compiled.float(), gathered.float(), atol=atol, rtol=atol)


def test_rows_do_not_depend_on_the_span():
    # A query's output is the same whether it is prefilled with the whole prompt or after a
    # cached prefix: the kernel's tiles and chunks start where the span does.
    case = make_case([(180, 180)], block_size=16, num_kv_heads=2, group=3, head_size=64)
    table = case.metadata.block_tables[0]
    kwargs = dict(scale=0.125)
    whole = cpu_ext.paged_prefill(
        case.query, case.key_cache, case.value_cache, table, 180, **kwargs
    )
    tail = cpu_ext.paged_prefill(
        case.query[100:], case.key_cache, case.value_cache, table, 180, **kwargs
    )
    torch.testing.assert_close(tail, whole[100:], atol=1e-6, rtol=1e-6)


def test_bad_inputs_are_refused():
    case = make_case([(40, 40)], block_size=8, num_kv_heads=2, group=2, head_size=32)
    table = case.metadata.block_tables[0]
    args = (case.query, case.key_cache, case.value_cache)
    with pytest.raises(RuntimeError, match="block table holds"):
        cpu_ext.paged_prefill(*args, table[:3], 40, scale=1.0)
    bad = table.clone()
    bad[2] = case.key_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        cpu_ext.paged_prefill(*args, bad, 40, scale=1.0)
    with pytest.raises(RuntimeError, match="exceeds seq_len"):
        cpu_ext.paged_prefill(*args, table, 39, scale=1.0)
    with pytest.raises(RuntimeError, match="share one dtype"):
        cpu_ext.paged_prefill(case.query.bfloat16(), *args[1:], table, 40, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        cpu_ext.paged_prefill(*args, table, 40, scale=1.0, sliding_window=0)


@pytest.mark.parametrize("query_dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8])
def test_quantized_caches_match_the_gathered_path(query_dtype, cache_dtype):
    # fp8 (with scales) and u8 caches read as stored: the same values the fallback dequantizes.
    case = make_case([(150, 120)], block_size=16, num_kv_heads=2, group=3, head_size=64)
    if cache_dtype == torch.uint8:
        key_cache, value_cache = u8.quantize(case.key_cache), u8.quantize(case.value_cache)
        k_scale = v_scale = 1.0
    else:
        k_scale, v_scale = 0.02, 0.03
        key_cache = (case.key_cache / k_scale).to(cache_dtype)
        value_cache = (case.value_cache / v_scale).to(cache_dtype)
    query = case.query.to(query_dtype)
    table = case.metadata.block_tables[0]
    kwargs = dict(scale=0.125, sliding_window=40, logits_soft_cap=None)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    compiled = cpu_ext.paged_prefill(query, key_cache, value_cache, table, 150, **kwargs, **scales)
    gathered = CpuBackend(use_extension=False)._prefill(
        query, key_cache, value_cache, table, 150, **kwargs, **scales
    )
    atol = 1e-5 if query_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(compiled.float(), gathered.float(), atol=atol, rtol=atol)
