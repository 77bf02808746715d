"""FP8 KV cache in PyTorch: quantize / dequantize, the cache ops, the layouts and the reference."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention.backends.torch_ref import TorchRefBackend, dense_attention
from pagedattn.attention.fp8 import (
    FP8_DTYPES,
    FP8_MAX,
    compute_scale,
    dequantize,
    quantize,
)
from pagedattn.attention.layout import (
    KVCacheLayout,
    allocate_kv_cache,
    bytes_per_block,
    cache_x,
    classic_key_offset,
    gather_kv,
    kv_cache_shapes,
    translate,
)
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.ops import copy_blocks, reshape_and_cache
from tests.attention.paged_case import make_case, mixed_specs

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Relative spacing of the formats (3 and 2 mantissa bits): round to nearest is within half.
REL_STEP = {torch.float8_e4m3fn: 2.0**-3, torch.float8_e5m2: 2.0**-2}


def test_names_follow_vllm():
    assert FP8_DTYPES["fp8"] == FP8_DTYPES["fp8_e4m3"] == torch.float8_e4m3fn
    assert FP8_DTYPES["fp8_e5m2"] == torch.float8_e5m2
    assert FP8_MAX[torch.float8_e4m3fn] == 448.0 and FP8_MAX[torch.float8_e5m2] == 57344.0


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_and_rounds_as_torch(dtype):
    limit = FP8_MAX[dtype]
    x = torch.tensor([1e9, -1e9, limit * 1.01, 3.0, -0.3, 1e-9, 0.0])
    q = quantize(x, dtype)
    assert q.dtype == dtype and torch.isfinite(q.float()).all()
    assert q.float()[:3].tolist() == [limit, -limit, limit]
    # Below saturation it is torch's own conversion (round to nearest even), bit for bit.
    assert torch.equal(q[3:].view(torch.uint8), x[3:].to(dtype).view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
def test_round_trip_within_half_a_step(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 3
    scale = compute_scale(x, dtype)
    back = dequantize(quantize(x, dtype, scale), scale)
    err = (back - x).abs()
    # Normal range: relative error <= half a step; the subnormal range: an absolute floor.
    tiny = torch.finfo(dtype).smallest_normal * scale
    assert (err <= x.abs() * REL_STEP[dtype] / 2 + tiny).all()


@pytest.mark.parametrize("dtype", FP8)
def test_compute_scale_maps_amax_to_fp8_max(dtype):
    x = torch.tensor([[0.5, -7.0], [2.0, 3.0]])
    scale = compute_scale(x, dtype)
    assert scale == pytest.approx(7.0 / FP8_MAX[dtype])
    assert quantize(x, dtype, scale).float().abs().max() == FP8_MAX[dtype]
    assert compute_scale(torch.zeros(3), dtype) > 0  # never 0: the cache divides by it


def test_fp8_address_example_x_is_16():
    """The article's worked example with an FP8 cache: x = 16 / sizeof(fp8) = 16."""
    block_table, block_size, num_kv_heads, head_size = [7, 3, 12], 16, 32, 128
    dtype = torch.float8_e4m3fn
    assert cache_x(dtype) == 16 and cache_x(torch.float16) == 8
    assert translate(block_table, 20, block_size) == (1, 4, 3)
    offset = classic_key_offset(block_table, 20, 5, 0, block_size, num_kv_heads, head_size, dtype)
    assert offset == 3 * 65536 + 5 * 2048 + 4 * 16 == 206912  # elements = bytes for fp8
    dim17 = classic_key_offset(block_table, 20, 5, 17, block_size, num_kv_heads, head_size, dtype)
    assert dim17 == 206912 + 1 * block_size * 16 + 1
    key_shape, _ = kv_cache_shapes(
        KVCacheLayout.CLASSIC, 13, block_size, num_kv_heads, head_size, dtype
    )
    assert key_shape == (13, 32, 8, 16, 16)
    # Half the bytes of the fp16 example's block: 16-byte loads hold 16 elements, not 8.
    assert bytes_per_block(1, 16, 32, 128, dtype) * 2 == bytes_per_block(
        1, 16, 32, 128, torch.float16
    )


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("dim", [0, 15, 16, 31])
def test_classic_fp8_offset_addresses_the_written_byte(dtype, dim):
    block_table, block_size, num_kv_heads, head_size = [4, 0, 2], 4, 2, 32
    key_cache, value_cache = allocate_kv_cache(
        KVCacheLayout.CLASSIC, 5, block_size, num_kv_heads, head_size, dtype
    )
    key = torch.zeros(1, num_kv_heads, head_size)
    key[0, 1, dim] = 42.0
    slot = block_table[9 // block_size] * block_size + 9 % block_size
    reshape_and_cache(key, key.clone(), key_cache, value_cache, torch.tensor([slot]), 2.0, 1.0)
    offset = classic_key_offset(block_table, 9, 1, dim, block_size, num_kv_heads, head_size, dtype)
    raw = key_cache.view(torch.uint8).reshape(-1)
    assert raw[offset] == torch.tensor(21.0).to(dtype).view(torch.uint8)  # 42 / k_scale 2
    assert raw.count_nonzero() == 1


@pytest.mark.parametrize("dtype", FP8)
def test_flash_and_classic_fp8_gather_agree(dtype):
    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, head_size, seq_len = 8, 3, 32, 21
    key = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
    value = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
    table = torch.tensor([5, 1, 3], dtype=torch.int32)
    pos = torch.arange(seq_len)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    gathered = []
    for layout in KVCacheLayout:
        caches = allocate_kv_cache(layout, 6, block_size, num_kv_heads, head_size, dtype)
        reshape_and_cache(key, value, *caches, slots, 0.01, 0.02)
        got_key, got_value = gather_kv(*caches, table, seq_len)
        assert torch.equal(got_key.view(torch.uint8), quantize(key, dtype, 0.01).view(torch.uint8))
        assert torch.equal(
            got_value.view(torch.uint8), quantize(value, dtype, 0.02).view(torch.uint8)
        )
        gathered.append(got_key)
    assert torch.equal(gathered[0].view(torch.uint8), gathered[1].view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
def test_copy_blocks_copies_fp8_bytes(dtype):
    caches = [allocate_kv_cache(KVCacheLayout.FLASH, 4, 2, 1, 16, dtype) for _ in range(2)]
    for key_cache, value_cache in caches:
        key_cache[1] = quantize(torch.randn(2, 1, 16), dtype)
        value_cache[1] = quantize(torch.randn(2, 1, 16), dtype)
    copy_blocks(caches, [(1, 3)])
    for key_cache, value_cache in caches:
        assert torch.equal(key_cache[3].view(torch.uint8), key_cache[1].view(torch.uint8))
        assert torch.equal(value_cache[3].view(torch.uint8), value_cache[1].view(torch.uint8))


def fp8_case(specs, dtype, *, k_scale, v_scale, block_size, layout=KVCacheLayout.FLASH, **kw):
    """make_case in fp32, with its K/V (and garbage elsewhere) written into an fp8 cache."""
    case = make_case(specs, dtype=torch.float32, layout=layout, block_size=block_size, **kw)
    key_cache, value_cache = allocate_kv_cache(
        layout, case.key_cache.shape[0], block_size, *case.keys[0].shape[1:], dtype
    )
    # NOTE: garbage in unused slots (finite), so reading a wrong slot changes the output.
    gen = torch.Generator().manual_seed(1)
    key_cache.copy_(quantize(torch.randn(key_cache.shape, generator=gen) * 30, dtype, k_scale))
    value_cache.copy_(quantize(torch.randn(value_cache.shape, generator=gen) * 30, dtype, v_scale))
    seq_lens = [len(k) for k in case.keys]
    tables = case.metadata.block_tables.tolist()
    full = AttentionMetadata.build(seq_lens, seq_lens, tables, block_size)
    keys, values = torch.cat(case.keys), torch.cat(case.values)
    reshape_and_cache(keys, values, key_cache, value_cache, full.slot_mapping, k_scale, v_scale)
    case.key_cache, case.value_cache = key_cache, value_cache
    return case


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_reference_dequantizes_with_the_scales(dtype, layout):
    """torch ref over an fp8 cache == dense attention over the dequantized K/V (fp32), and
    within fp8's precision of attention over the unquantized K/V."""
    k_scale, v_scale = 0.02, 0.01  # randn / scale stays below 448: no saturation
    case = fp8_case(
        mixed_specs(4), dtype, k_scale=k_scale, v_scale=v_scale, layout=layout,
        block_size=4, num_kv_heads=2, group=2,
    )  # fmt: skip
    scale = 32**-0.5
    out = TorchRefBackend(layout).forward(
        case.query, case.key_cache, case.value_cache, case.metadata,
        scale=scale, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    loc = case.metadata.query_start_loc_cpu
    worst = 0.0
    for s, (key, value) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.query[loc[s] : loc[s + 1]]
        kq = dequantize(quantize(key, dtype, k_scale), k_scale)
        vq = dequantize(quantize(value, dtype, v_scale), v_scale)
        torch.testing.assert_close(
            out[loc[s] : loc[s + 1]], dense_attention(q, kq, vq, scale=scale), rtol=0, atol=1e-6
        )
        exact = dense_attention(q, key, value, scale=scale)
        worst = max(worst, float((out[loc[s] : loc[s + 1]] - exact).abs().max()))
    assert worst < 8 * REL_STEP[dtype]  # scores err ~ step * |q.k|; outputs are O(1)
    # Without the scales the same bytes mean something else.
    wrong = TorchRefBackend(layout).forward(
        case.query, case.key_cache, case.value_cache, case.metadata, scale=scale
    )
    assert (wrong - out).abs().max() > 0.1
