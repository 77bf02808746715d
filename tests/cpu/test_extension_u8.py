"""The compiled kernels on a u8 KV cache (per-token-head scale and min): cache write, gather and
paged decode against the PyTorch reference (attention.u8).

Run for every ISA build by tests/cpu/test_kernels_per_isa.py (avx2, avx512; scalar with -m slow).
"""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention import u8
from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.attention.backends.torch_ref import TorchRefBackend
from pagedattn.attention.layout import PAD_SLOT_ID, KVCacheLayout, allocate_kv_cache
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.ops import reshape_and_cache
from pagedattn.cpu import extension as cpu_ext
from tests.attention.paged_case import make_case, mixed_specs


@pytest.fixture(scope="module", autouse=True)
def extension():
    return cpu_ext.load_extension()  # raises (fails the tests) if the build fails


def u8_case(specs, *, block_size, num_kv_heads, group, head_size):
    """make_case in fp32, its K/V (and other rows' garbage) written into a u8 cache."""
    case = make_case(
        specs, dtype=torch.float32, block_size=block_size, num_kv_heads=num_kv_heads,
        group=group, head_size=head_size,
    )  # fmt: skip
    key_cache, value_cache = allocate_kv_cache(
        KVCacheLayout.FLASH, case.key_cache.shape[0], block_size, num_kv_heads, head_size,
        torch.uint8,
    )  # fmt: skip
    # NOTE: garbage rows elsewhere, so reading a wrong slot changes the output.
    gen = torch.Generator().manual_seed(1)
    shape = (*key_cache.shape[:-1], head_size)
    key_cache.copy_(u8.quantize(torch.randn(shape, generator=gen) * 30))
    value_cache.copy_(u8.quantize(torch.randn(shape, generator=gen) * 30))
    seq_lens = [len(k) for k in case.keys]
    full = AttentionMetadata.build(seq_lens, seq_lens, case.metadata.block_tables.tolist(),
                                   block_size)  # fmt: skip
    reshape_and_cache(torch.cat(case.keys), torch.cat(case.values), key_cache, value_cache,
                      full.slot_mapping)  # fmt: skip
    case.key_cache, case.value_cache = key_cache, value_cache
    return case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_write_same_bytes_as_torch_and_round_trips(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block, heads, dim = 5, 4, 2, 32
    fused = (torch.randn(7, 3 * heads * dim, generator=gen) * 4).to(dtype)
    key = fused[:, heads * dim : 2 * heads * dim].view(7, heads, dim)  # strided rows
    value = fused[:, 2 * heads * dim :].view(7, heads, dim)
    key[1, 1] = 2.5  # a constant row: scale 0, read back exactly
    slots = torch.tensor([3, 17, PAD_SLOT_ID, 0, 19, 8], dtype=slot_dtype)
    filler = u8.quantize(torch.full((num_blocks, block, heads, dim), -7.0))
    expected = [filler.clone(), filler.clone()]
    got = [filler.clone(), filler.clone()]
    reshape_and_cache(key, value, *expected, slots)
    CpuBackend(use_extension=True).reshape_and_cache(key, value, *got, slots)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == (num_blocks, block, heads, dim + u8.U8_SCALE_BYTES)
        assert torch.equal(g, e)
    # Round trip: within half a step (scale / 2) of every element of its row.
    rows = got[0].view(-1, heads, dim + 8)[slots.long()[slots >= 0]]
    back = u8.dequantize(rows)
    src = key[:6][slots >= 0].float()
    step = rows[..., dim:].contiguous().view(torch.float32)[..., :1]
    assert ((back - src).abs() <= step / 2 * 1.001 + 1e-6).all()
    assert torch.equal(back[1, 1], src[1, 1])  # token 1 (slot 17), head 1: the constant row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_size,partition_size",
    [(16, 2, 1, 32, 512), (1, 3, 3, 16, 16), (32, 1, 8, 64, 16), (16, 3, 3, 64, 512)],
)
def test_decode_matches_reference(dtype, block_size, num_kv_heads, group, head_size,
                                  partition_size):  # fmt: skip
    specs = [(5 * block_size + 3, 1), (3 * block_size - 1, 1), (1, 1), (150, 1)]
    case = u8_case(specs, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                   head_size=head_size)  # fmt: skip
    query, meta, scale = case.query.to(dtype), case.metadata, head_size**-0.5
    out = cpu_ext.paged_decode(
        query, case.key_cache, case.value_cache, meta.block_tables, meta.seq_lens,
        scale=scale, partition_size=partition_size,
    )  # fmt: skip
    expected = TorchRefBackend().forward(
        query.float(), case.key_cache, case.value_cache, meta, scale=scale
    )
    assert out.dtype == dtype
    atol = 5e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("head_size,context", [(128, 700), (256, 1100)])
def test_decode_long_context_wide_heads(head_size, context):
    """Head sizes 128/256 (several vectors per row, the AVX-512 tiles of 8 vectors) and contexts
    over several partitions, bf16 queries, against the torch reference."""
    case = u8_case([(context, 1), (context // 3, 1)], block_size=16, num_kv_heads=2, group=4,
                   head_size=head_size)  # fmt: skip
    query, meta, scale = case.query.to(torch.bfloat16), case.metadata, head_size**-0.5
    out = cpu_ext.paged_decode(
        query, case.key_cache, case.value_cache, meta.block_tables, meta.seq_lens, scale=scale,
        partition_size=256,
    )  # fmt: skip
    expected = TorchRefBackend().forward(
        query.float(), case.key_cache, case.value_cache, meta, scale=scale
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_largest_byte_dot_product(dtype):
    """D = 256, key rows of bytes 255 but one and of bytes 0 but one, against an equal positive
    query: the largest byte dot product a head of 256 takes (the integer path of bf16 queries
    keeps it inside int32: 256 * 255 * 32767 < 2^31 for an int16 query) and the min-only score."""
    head_size, block = 256, 16
    row = torch.full((head_size,), 1.0)
    row[0] = -1.0  # bytes 255 everywhere but element 0 (byte 0)
    keys = torch.stack([row, torch.full((head_size,), -1.0)] * (block // 2))  # [16, D]
    keys[1, 0] = 1.0  # not constant: scale > 0, every other byte 0
    values = torch.randn(block, head_size, generator=torch.Generator().manual_seed(0))
    key_cache, value_cache = allocate_kv_cache(
        KVCacheLayout.FLASH, 1, block, 1, head_size, torch.uint8
    )  # fmt: skip
    key_cache.copy_(u8.quantize(keys.view(1, block, 1, head_size)))
    value_cache.copy_(u8.quantize(values.view(1, block, 1, head_size)))
    query = torch.full((1, 1, head_size), 0.25, dtype=dtype)
    meta = AttentionMetadata.build([1], [block], [[0]], block)
    scale = 0.05
    out = cpu_ext.paged_decode(
        query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale=scale
    )
    expected = TorchRefBackend().forward(query.float(), key_cache, value_cache, meta, scale=scale)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_window_and_soft_cap(dtype):
    # bf16 queries take the x86 integer path (int16 queries and weights), odd windows a padded pair
    case = u8_case([(40, 1), (77, 1)], block_size=16, num_kv_heads=2, group=2, head_size=32)
    query, meta, scale = case.query.to(dtype), case.metadata, 32**-0.5
    for kwargs in ({"sliding_window": 21}, {"logits_soft_cap": 2.0}):
        out = cpu_ext.paged_decode(
            query, case.key_cache, case.value_cache, meta.block_tables, meta.seq_lens,
            scale=scale, **kwargs,
        )  # fmt: skip
        expected = TorchRefBackend().forward(
            query.float(), case.key_cache, case.value_cache, meta, scale=scale, **kwargs
        )
        atol = 5e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_shape", [(16, 2, 64), (3, 1, 24)])
def test_gather_dequant_matches_torch(dtype, block_shape):
    """gather_dequant_u8 == u8.dequantize(index_select) bit for bit, repeated and shuffled ids,
    rows not a multiple of the vector width."""
    gen = torch.Generator().manual_seed(0)
    cache = u8.quantize(torch.randn(20, *block_shape, generator=gen) * 5)
    ids = torch.tensor([7, 0, 19, 7, 3, 12])
    out = torch.empty(len(ids), *block_shape, dtype=dtype)
    cpu_ext.gather_dequant_u8(cache, ids, out)
    assert torch.equal(out, u8.dequantize(cache.index_select(0, ids), dtype))


@pytest.mark.parametrize(
    "use_extension,decode_kernel", [(True, "compiled"), (True, "torch"), (False, "torch")]
)
def test_backend_mixed_batch_matches_reference(use_extension, decode_kernel):
    """Decode rows and prefill spans (gather + dequantize + SDPA) of the cpu backend on a u8
    cache with bf16 queries against the torch reference: compiled kernel and gather, compiled
    gather only, and plain PyTorch."""
    case = u8_case(mixed_specs(16), block_size=16, num_kv_heads=2, group=3, head_size=64)
    query = case.query.to(torch.bfloat16)
    backend = CpuBackend(use_extension=use_extension, decode_kernel=decode_kernel)
    out = backend.forward(query, case.key_cache, case.value_cache, case.metadata, scale=0.125)
    expected = TorchRefBackend().forward(
        query.float(), case.key_cache, case.value_cache, case.metadata, scale=0.125
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


needs_amx = pytest.mark.skipif(
    not cpu_ext.amx_available(), reason="the AMX tile path needs a CPU with AMX (and its build)"
)


@needs_amx
@pytest.mark.parametrize(
    "num_kv_heads,group,head_size,partition_size",
    [(2, 1, 64, 512), (3, 3, 64, 128), (1, 8, 128, 512), (2, 4, 256, 256), (2, 2, 192, 64)],
)
def test_decode_on_amx_tiles_matches_vector_path_and_reference(
    num_kv_heads, group, head_size, partition_size
):
    """The u8 tile path (amx=True, bf16 queries, blocks of 16): contexts of partial blocks and
    chunks, several partitions, against the vector integer path (the same integers; only float
    roundings differ) and the torch reference."""
    block = 16
    specs = [(5 * block + 3, 1), (3 * block - 1, 1), (1, 1), (150, 1), (64, 1), (700, 1)]
    case = u8_case(specs, block_size=block, num_kv_heads=num_kv_heads, group=group,
                   head_size=head_size)  # fmt: skip
    query, meta, scale = case.query.to(torch.bfloat16), case.metadata, head_size**-0.5

    def run(amx: bool) -> torch.Tensor:
        return cpu_ext.paged_decode(
            query, case.key_cache, case.value_cache, meta.block_tables, meta.seq_lens,
            scale=scale, partition_size=partition_size, amx=amx,
        )  # fmt: skip

    tiles, vector = run(True), run(False)
    expected = TorchRefBackend().forward(
        query.float(), case.key_cache, case.value_cache, meta, scale=scale
    )
    torch.testing.assert_close(tiles.float(), expected, atol=2e-2, rtol=2e-2)
    # bf16 outputs one rounding apart at most: the integer sums are the same.
    torch.testing.assert_close(tiles.float(), vector.float(), atol=1e-2, rtol=1e-2)


@needs_amx
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_decode_on_amx_tiles_largest_products(sign):
    """D = 256 on the tiles: key bytes 255 (and 0) against a query at the int16 limit of either
    sign (int8 halves +-127), the largest int32 score the split takes, and a query whose low
    bytes run over every signed value (-128 .. 127)."""
    head_size, block = 256, 16
    row = torch.full((head_size,), 1.0)
    row[0] = -1.0
    keys = torch.stack([row, torch.full((head_size,), -1.0)] * (block // 2))
    keys[1, 0] = 1.0
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(block, head_size, generator=gen) * 100  # value bytes up to 255
    key_cache, value_cache = allocate_kv_cache(
        KVCacheLayout.FLASH, 1, block, 1, head_size, torch.uint8
    )  # fmt: skip
    key_cache.copy_(u8.quantize(keys.view(1, block, 1, head_size)))
    value_cache.copy_(u8.quantize(values.view(1, block, 1, head_size)))
    meta = AttentionMetadata.build([1, 1], [block, block], [[0], [0]], block)
    ramp = torch.linspace(-1.0, 1.0, head_size)  # every low byte
    query = torch.stack([torch.full((head_size,), 0.25 * sign), ramp]).view(2, 1, head_size)
    query = query.to(torch.bfloat16)
    out = cpu_ext.paged_decode(
        query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale=0.05, amx=True
    )
    expected = TorchRefBackend().forward(query.float(), key_cache, value_cache, meta, scale=0.05)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


@needs_amx
def test_decode_on_amx_tiles_with_soft_cap():
    """A logit soft cap on the tiles (applied to the chunk's scores before its max)."""
    case = u8_case([(150, 1), (37, 1)], block_size=16, num_kv_heads=2, group=3, head_size=64)
    query, meta, scale = case.query.to(torch.bfloat16), case.metadata, 64**-0.5
    out = cpu_ext.paged_decode(
        query, case.key_cache, case.value_cache, meta.block_tables, meta.seq_lens, scale=scale,
        logits_soft_cap=2.0, amx=True,
    )  # fmt: skip
    expected = TorchRefBackend().forward(
        query.float(), case.key_cache, case.value_cache, meta, scale=scale, logits_soft_cap=2.0
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    uncapped = TorchRefBackend().forward(
        query.float(), case.key_cache, case.value_cache, meta, scale=scale
    )
    assert (uncapped - expected).abs().max() > 0.05  # the cap changes the output


@needs_amx
def test_backend_amx_kernel_runs_a_u8_cache_on_the_tiles():
    """decode_kernel="amx" with a u8 cache: the mixed batch (decode rows on the tiles, prefill
    spans gathered) matches the reference."""
    case = u8_case(mixed_specs(16), block_size=16, num_kv_heads=2, group=3, head_size=64)
    query = case.query.to(torch.bfloat16)
    backend = CpuBackend(use_extension=True, decode_kernel="amx")
    out = backend.forward(query, case.key_cache, case.value_cache, case.metadata, scale=0.125)
    expected = TorchRefBackend().forward(
        query.float(), case.key_cache, case.value_cache, case.metadata, scale=0.125
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
