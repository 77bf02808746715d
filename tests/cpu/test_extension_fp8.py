"""The compiled kernels on an FP8 KV cache: cache write and paged decode against PyTorch.

Run for every ISA build by tests/cpu/test_kernels_per_isa.py (avx2, avx512; scalar with -m slow).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.attention.backends.torch_ref import TorchRefBackend
from pagedattn.attention.fp8 import dequantize, quantize
from pagedattn.attention.layout import PAD_SLOT_ID
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.ops import reshape_and_cache
from pagedattn.cpu import extension as cpu_ext
from tests.attention.paged_case import mixed_specs
from tests.attention.test_fp8 import fp8_case

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
NAN_CODES = {
    torch.float8_e4m3fn: {0x7F, 0xFF},
    torch.float8_e5m2: {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF},
}
K_SCALE, V_SCALE = 0.02, 0.01


@pytest.fixture(scope="module", autouse=True)
def extension():
    return cpu_ext.load_extension()  # raises (fails the tests) if the build fails


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_write_quantizes_as_torch(cache_dtype, dtype, slot_dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block, heads, dim = 5, 4, 2, 16
    fused = (torch.randn(7, 3 * heads * dim, generator=gen) * 4).to(dtype)
    key = fused[:, heads * dim : 2 * heads * dim].view(7, heads, dim)  # strided rows
    value = fused[:, 2 * heads * dim :].view(7, heads, dim)
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 1e-7], dtype=dtype)  # saturates; a subnormal
    slots = torch.tensor([3, 17, PAD_SLOT_ID, 0, 19, 8], dtype=slot_dtype)
    filler = quantize(torch.full((num_blocks, block, heads, dim), -7.0), cache_dtype)
    expected = [filler.clone(), filler.clone()]
    got = [filler.clone(), filler.clone()]
    reshape_and_cache(key, value, *expected, slots, K_SCALE, V_SCALE)
    CpuBackend(use_extension=True).reshape_and_cache(key, value, *got, slots, K_SCALE, V_SCALE)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))
    assert torch.isfinite(got[0].float()).all()


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("flush_denormals", [False, True])
def test_decode_reads_every_code_exactly(cache_dtype, flush_denormals):
    """One visible token: the output is its value row, so every byte's decoding shows, bit for
    bit against torch's conversion; subnormal codes too, also with denormals flushed (DAZ)."""
    codes = torch.tensor([c for c in range(256) if c not in NAN_CODES[cache_dtype]])
    D = 256
    row = torch.zeros(D, dtype=torch.uint8)
    row[: len(codes)] = codes.to(torch.uint8)
    value_cache = row.view(1, 1, 1, D).view(cache_dtype).clone()
    key_cache = torch.zeros_like(value_cache)
    query = torch.randn(1, 1, D)
    ext = cpu_ext.load_extension()
    try:
        ext.set_flush_denormal_all_threads(flush_denormals)
        out = cpu_ext.paged_decode(
            query, key_cache, value_cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), scale=1.0, v_scale=1.0,
        )  # fmt: skip
    finally:
        ext.set_flush_denormal_all_threads(False)
        torch.set_flush_denormal(False)
    expected = value_cache.view(D).float()
    assert torch.equal(out.view(D), expected)
    subnormals = expected[1:4]  # codes 1..3 are subnormal in both formats
    assert (subnormals > 0).all() and (subnormals < torch.finfo(cache_dtype).smallest_normal).all()


def decode_case(cache_dtype, dtype, block_size, num_kv_heads, group, head_size=32):
    specs = [(5 * block_size + 3, 1), (3 * block_size - 1, 1), (1, 1), (150, 1)]
    case = fp8_case(
        specs, cache_dtype, k_scale=K_SCALE, v_scale=V_SCALE, block_size=block_size,
        num_kv_heads=num_kv_heads, group=group, head_size=head_size,
    )  # fmt: skip
    case.query = case.query.to(dtype)
    return case


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_kv_heads,group", [(16, 2, 1), (1, 3, 3), (32, 1, 8)])
@pytest.mark.parametrize("partition_size", [cpu_ext.DEFAULT_PARTITION_SIZE, 16])
def test_decode_matches_reference(cache_dtype, dtype, block_size, num_kv_heads, group,
                                  partition_size):  # fmt: skip
    case = decode_case(cache_dtype, dtype, block_size, num_kv_heads, group)
    meta, scale = case.metadata, 32**-0.5
    out = cpu_ext.paged_decode(
        case.query, case.key_cache, case.value_cache, meta.block_tables, meta.seq_lens,
        scale=scale, partition_size=partition_size, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    expected = TorchRefBackend().forward(
        case.query.float(), case.key_cache, case.value_cache, meta,
        scale=scale, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    assert out.dtype == dtype
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("head_size", [64, 128])
def test_decode_bf16_queries_wide_heads(cache_dtype, head_size):
    # bf16 queries on AVX512-BF16 builds take the token-pair path (fp8 bytes read as bf16 bits,
    # two tokens per dot product); odd lengths leave a padded pair, the window a partial chunk.
    case = decode_case(cache_dtype, torch.bfloat16, 16, 2, 3, head_size=head_size)
    meta, scale = case.metadata, head_size**-0.5
    for kwargs in ({}, {"sliding_window": 37}, {"logits_soft_cap": 2.0}):
        out = cpu_ext.paged_decode(
            case.query, case.key_cache, case.value_cache, meta.block_tables, meta.seq_lens,
            scale=scale, k_scale=K_SCALE, v_scale=V_SCALE, **kwargs,
        )  # fmt: skip
        expected = TorchRefBackend().forward(
            case.query.float(), case.key_cache, case.value_cache, meta,
            scale=scale, k_scale=K_SCALE, v_scale=V_SCALE, **kwargs,
        )  # fmt: skip
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_decode_window_and_soft_cap(cache_dtype):
    case = decode_case(cache_dtype, torch.float32, 16, 2, 2)
    meta, scale = case.metadata, 32**-0.5
    for kwargs in ({"sliding_window": 20}, {"logits_soft_cap": 2.0}):
        out = cpu_ext.paged_decode(
            case.query, case.key_cache, case.value_cache, meta.block_tables, meta.seq_lens,
            scale=scale, k_scale=K_SCALE, v_scale=V_SCALE, **kwargs,
        )  # fmt: skip
        expected = TorchRefBackend().forward(
            case.query, case.key_cache, case.value_cache, meta,
            scale=scale, k_scale=K_SCALE, v_scale=V_SCALE, **kwargs,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("decode_kernel", ["compiled", "amx", "torch"])
def test_backend_mixed_batch_matches_reference(cache_dtype, decode_kernel):
    """Decode rows (compiled or gathered) and prefill spans (gather + dequantize + SDPA) of the
    cpu backend on an fp8 cache, bf16 queries; "amx" routes fp8 to the vector kernel."""
    case = fp8_case(
        mixed_specs(16), cache_dtype, k_scale=K_SCALE, v_scale=V_SCALE, block_size=16,
        num_kv_heads=2, group=3, head_size=64,
    )  # fmt: skip
    query = case.query.to(torch.bfloat16)
    backend = CpuBackend(use_extension=True, decode_kernel=decode_kernel)
    kwargs = dict(scale=0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    out = backend.forward(query, case.key_cache, case.value_cache, case.metadata, **kwargs)
    expected = TorchRefBackend().forward(
        query.float(), case.key_cache, case.value_cache, case.metadata, **kwargs
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_decode_rejects_other_query_dtypes():
    cache = torch.zeros(1, 16, 1, 16, dtype=torch.float8_e4m3fn)
    meta = AttentionMetadata.build([1], [1], [[0]], 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 queries"):
        cpu_ext.load_extension().paged_decode(
            torch.empty(1, 1, 16, dtype=torch.float16), torch.zeros(1, 1, 16, dtype=torch.float16),
            cache, cache, meta.block_tables.int(), meta.seq_lens.int(), 1.0, 0, 0.0, 512, False,
        )  # fmt: skip


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("block_shape", [(16, 2, 64), (1, 1, 8), (3, 1, 24)])
def test_gather_dequant_matches_torch(cache_dtype, dtype, scale, block_shape):
    """gather_dequant_fp8 == dequantize(index_select) bit for bit: every finite code, shuffled
    and repeated block ids, rows shorter than / not a multiple of the vector width."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.tensor([c for c in range(256) if c not in NAN_CODES[cache_dtype]])
    numel = 20 * math.prod(block_shape)
    raw = codes[torch.randint(len(codes), (numel,), generator=gen)].to(torch.uint8)
    cache = raw.view(20, *block_shape).view(cache_dtype)
    ids = torch.tensor([7, 0, 19, 7, 3, 12])
    out = torch.empty(len(ids), *block_shape, dtype=dtype)
    cpu_ext.gather_dequant_fp8(cache, ids, scale, out)
    assert torch.equal(out, dequantize(cache.index_select(0, ids), scale, dtype))


def test_gather_dequant_rejects_bad_ids():
    cache = torch.zeros(4, 16, 1, 16, dtype=torch.float8_e4m3fn)
    out = torch.empty(1, 16, 1, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ext.gather_dequant_fp8(cache, torch.tensor([4]), 1.0, out)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_backend_gather_paths_agree(cache_dtype):
    """The cpu backend's gathered path (torch decode rows) gives the same bits with the
    compiled gather as with torch's index_select + float8 conversion. (Prefill spans run the
    prefill kernel where the extension builds: tests/attention/backends/test_prefill_cpu.py.)"""
    case = fp8_case(
        [(seq_len, 1) for seq_len, _ in mixed_specs(16)], cache_dtype, k_scale=K_SCALE,
        v_scale=V_SCALE, block_size=16, num_kv_heads=2, group=3, head_size=64,
    )  # fmt: skip
    query = case.query.to(torch.bfloat16)
    kwargs = dict(scale=0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    outs = [
        CpuBackend(use_extension=use, decode_kernel="torch").forward(
            query, case.key_cache, case.value_cache, case.metadata, **kwargs
        )
        for use in (True, False)
    ]
    assert torch.equal(outs[0], outs[1])


needs_amx = pytest.mark.skipif(
    not cpu_ext.amx_available(), reason="the AMX tile path needs a CPU with AMX (and its build)"
)


@needs_amx
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize(
    "num_kv_heads,group,head_size,partition_size",
    [(2, 1, 32, 512), (3, 3, 64, 128), (1, 8, 128, 64), (2, 16, 64, 512)],
)
def test_decode_on_amx_tiles_matches_vector_path_and_reference(
    cache_dtype, num_kv_heads, group, head_size, partition_size
):
    """The fp8 tile path (amx=True, bf16 queries, blocks of 16): partial blocks and chunks,
    several partitions, G up to 16, against the vector (pairs) path and the torch reference."""
    block = 16
    specs = [(5 * block + 3, 1), (3 * block - 1, 1), (1, 1), (150, 1), (64, 1), (700, 1)]
    case = fp8_case(
        specs, cache_dtype, k_scale=K_SCALE, v_scale=V_SCALE, block_size=block,
        num_kv_heads=num_kv_heads, group=group, head_size=head_size,
    )  # fmt: skip
    query, meta, scale = case.query.to(torch.bfloat16), case.metadata, head_size**-0.5

    def run(amx: bool, **kwargs) -> torch.Tensor:
        return cpu_ext.paged_decode(
            query, case.key_cache, case.value_cache, meta.block_tables, meta.seq_lens,
            scale=scale, partition_size=partition_size, amx=amx, k_scale=K_SCALE,
            v_scale=V_SCALE, **kwargs,
        )  # fmt: skip

    for kwargs in ({}, {"logits_soft_cap": 2.0}):
        tiles, vector = run(True, **kwargs), run(False, **kwargs)
        expected = TorchRefBackend().forward(
            query.float(), case.key_cache, case.value_cache, meta,
            scale=scale, k_scale=K_SCALE, v_scale=V_SCALE, **kwargs,
        )  # fmt: skip
        torch.testing.assert_close(tiles.float(), expected, atol=2e-2, rtol=2e-2)
        # The same products summed in another order: bf16 outputs a rounding or two apart.
        torch.testing.assert_close(tiles.float(), vector.float(), atol=1e-2, rtol=1e-2)


@needs_amx
@pytest.mark.parametrize("cache_dtype", FP8)
def test_decode_on_amx_tiles_reads_every_normal_code_exactly(cache_dtype):
    """One visible token of a 16-token block on the tiles: the output is its value row, every
    finite normal code exact (bf16 holds each fp8 value); subnormal codes read as 0, as on the
    BF16 dot products of the vector path."""
    codes = torch.tensor([c for c in range(256) if c not in NAN_CODES[cache_dtype]])
    D = 256
    row = torch.zeros(D, dtype=torch.uint8)
    row[: len(codes)] = codes.to(torch.uint8)
    value_cache = torch.zeros(1, 16, 1, D, dtype=torch.uint8)
    value_cache[0, 0, 0] = row
    value_cache = value_cache.view(cache_dtype)
    key_cache = torch.zeros_like(value_cache)
    query = torch.randn(1, 1, D).to(torch.bfloat16)
    out = cpu_ext.paged_decode(
        query, key_cache, value_cache, torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32), scale=1.0, amx=True,
    )  # fmt: skip
    expected = value_cache[0, 0, 0].float()
    # NOTE: e5m2's infinities are left out: the cache write never stores one (it saturates).
    finite = expected.isfinite()
    normal = finite & (expected.abs() >= torch.finfo(cache_dtype).smallest_normal)
    assert torch.equal(out.view(D).float()[normal], expected[normal])
    assert (out.view(D).float()[finite & ~normal] == 0).all()
