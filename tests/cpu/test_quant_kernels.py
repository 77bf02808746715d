"""The GGUF block kernels (csrc/quant_cpu.cpp) against gguf's dequantiser and a matmul.

Weights are random valid blocks of each type (random bytes, with finite fp16 scales, as
llama.cpp's tests make them). Decode rows (1..8) quantise the activations per block to int8 as
the kernel does (Q8_0 or Q8_K rounding, reproduced here), so the reference is exact up to the
order of float sums; prefill rows (37) dequantise tiles and are compared with x @ W^T itself.
tests/cpu/test_kernels_per_isa.py runs this module at every ISA level the CPU executes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedattn.cpu import extension, features
from pagedattn.cpu.linear import QuantizedParts, pack_quantized
from pagedattn.cpu.quant import GGUF_TYPES, QuantizedTensor, quantize

gguf = pytest.importorskip("gguf")
# The layers here dequantise tiles from this many rows (the plan measures it for a model).
TILES_FROM = 16
from gguf.quants import dequantize  # noqa: E402

ext = extension.get_extension()
pytestmark = pytest.mark.skipif(
    ext is None or not hasattr(ext, "QuantLinear"), reason="no compiled extension"
)

# Byte offsets of each block's fp16 fields (d, m / dmin).
HALF_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,)}
HALF_FIELDS |= {12: (0, 2), 13: (0, 2), 14: (208,), 20: (0,), 23: (0,)}
K_TYPES = (10, 11, 12, 13, 14, 23)


def random_blocks(type_id: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes] of random valid blocks (finite scales, Q8_0 without -128)."""
    _, block, size = next(v for v in GGUF_TYPES.values() if v[0] == type_id)
    nb = cols // block
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    for offset in HALF_FIELDS[type_id]:
        spread = 0.1 if offset == 2 and type_id in (3, 7) else 0.02
        half = (rng.standard_normal((rows, nb)) * spread).astype(np.float16)
        raw[:, :, offset : offset + 2] = half.view(np.uint8).reshape(rows, nb, 2)
    if type_id == 8:
        q = raw[:, :, 2:].view(np.int8)
        q[q == -128] = -127
    return raw.reshape(rows, nb * size)


def reference_weight(blocks: np.ndarray, type_id: int) -> torch.Tensor:
    raw = dequantize(blocks, gguf.GGMLQuantizationType(type_id))
    return torch.from_numpy(np.ascontiguousarray(raw, dtype=np.float32))


def int8_rounded(x: torch.Tensor, type_id: int) -> torch.Tensor:
    """x [M, K] after the kernel's per-block int8 rounding (blocks of 32, or 256: K types)."""
    block = 256 if type_id in K_TYPES else 32
    xb = x.reshape(x.shape[0], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(x.shape)


def relative_error(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    scale = (x.abs() @ w.abs().T).max().item()
    return (y - ref).abs().max().item() / scale


def packed(blocks: np.ndarray, type_id: int, cols: int, bias=None):
    t = QuantizedTensor(type_id, torch.from_numpy(blocks), cols)
    return pack_quantized(QuantizedParts((t,), (0,), t.shape[0], cols), bias, TILES_FROM)


@pytest.mark.parametrize("kind", list(GGUF_TYPES))
def test_dequantize_matches_gguf(kind):
    type_id = GGUF_TYPES[kind][0]
    cols = 512 if type_id in K_TYPES else 96
    blocks = random_blocks(type_id, 7, cols, np.random.default_rng(1))
    got = ext.quant_dequantize(torch.from_numpy(blocks), type_id, cols)
    assert torch.equal(got, reference_weight(blocks, type_id))


@pytest.mark.parametrize("kind", list(GGUF_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 37])
@pytest.mark.parametrize("layout", ["x8", "rows"])
def test_linear_matches_dequantised_matmul(kind, rows, layout):
    """Every type's layer, its rows interleaved 8 at a time or as stored (a row count not a
    multiple of 8: the row-major kernels)."""
    type_id = GGUF_TYPES[kind][0]
    cols, out = (512, 24) if type_id in K_TYPES else (160, 40)
    out = out if layout == "x8" else 13
    rng = np.random.default_rng(rows)
    blocks = random_blocks(type_id, out, cols, rng)
    w = reference_weight(blocks, type_id)
    x = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32))
    layer = packed(blocks, type_id, cols)
    assert layer.a.layouts() == [layout]
    y = layer(x)
    # Both paths (dot kernels below TILES_FROM rows, tiles from there) multiply the int8
    # activations, as llama.cpp does at every batch size.
    ref = int8_rounded(x, type_id) @ w.T
    assert y.shape == (rows, out) and y.dtype == torch.float32
    assert relative_error(y, ref, x, w) < 2e-6
    # the int8 activations stay close to the float product
    assert relative_error(y, x @ w.T, x, w) < 1e-2


@pytest.mark.parametrize(
    "kind", ["q4_1", "q5_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_0", "iq4_xs", "iq4_nl"]
)
@pytest.mark.parametrize("interleave", [True, False])
def test_a_row_computes_the_same_at_every_row_count(kind, interleave):
    """A token's output must not depend on how many rows its step had (issue 52: a prefix-
    cached rerun runs fewer rows). The dot kernels give bit-identical rows for any count and
    grouping (over 64 rows they take activations in chunks); the tiles differ from them by float
    rounding only: the tiles used to multiply float activations, ~1e-2 away."""
    type_id = GGUF_TYPES[kind][0]
    cols, out = (512, 24) if type_id in K_TYPES else (160, 40)
    rng = np.random.default_rng(5)
    blocks = random_blocks(type_id, out, cols, rng)
    x = torch.from_numpy(rng.standard_normal((150, cols)).astype(np.float32))
    weight = QuantizedTensor(type_id, torch.from_numpy(blocks), cols)
    dot = pack_quantized(QuantizedParts((weight,), (0,), out, cols), None, 1 << 30, interleave)
    assert dot.a.layouts() == ["x8" if interleave else "rows"]
    full = dot(x)
    for rows in (1, 3, 64, 67, 129):
        assert torch.equal(dot(x[-rows:]), full[-rows:])
    tiles = packed(blocks, type_id, cols)(x)  # 150 rows >= TILES_FROM
    w = reference_weight(blocks, type_id)
    assert relative_error(tiles, full, x, w) < 2e-6


@pytest.mark.parametrize("rows", [3, 20])
def test_fused_parts_row_order_bias_and_bf16(rows):
    """Two parts of different types, the first stored in a permuted row order, plus a bias."""
    rng = np.random.default_rng(7)
    cols = 256
    a, b = random_blocks(3, 6, cols, rng), random_blocks(14, 10, cols, rng)
    order = torch.randperm(6, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    parts = (
        QuantizedTensor(3, torch.from_numpy(a), cols, order),
        QuantizedTensor(14, torch.from_numpy(b), cols),
    )
    bias = torch.linspace(-1, 1, 16)
    layer = pack_quantized(QuantizedParts(parts, (0, 6), 16, cols), bias, TILES_FROM)
    w = torch.cat((parts[0].dequantize(), parts[1].dequantize()))  # rows in the layer's order
    assert torch.equal(w[order.long()], reference_weight(a, 3))
    x = torch.randn(rows, cols)
    y = layer(x)
    exact = x @ w.T + bias
    assert relative_error(y, exact, x, w) < 1e-2  # int8 activations on both paths
    y16 = layer(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    assert relative_error(y16.float(), exact, x, w) < 2e-2


@pytest.mark.parametrize("type_id", [10, 11, 12, 13, 14, 23, 8, 2, 3, 6, 7, 20])
def test_interleaved_parts_are_held_once_and_agree_with_the_rows_as_stored(type_id):
    """Parts of 8n rows of every type are repacked 8 rows interleaved (quant_x8_cpu.h,
    quant_x8_legacy_cpu.h) and the stored rows dropped; a part of another row count, or with
    interleave off (a tied embedding's table), keeps its blocks. Fused with such a part, in a
    permuted row order, the interleaved part agrees with the row-major dot kernel up to the
    order of float sums, at every row count (one kernel for decode and prefill: bit-identical
    rows whatever the step's size)."""
    rng = np.random.default_rng(11)
    cols = 512
    a, b = random_blocks(type_id, 16, cols, rng), random_blocks(14, 10, cols, rng)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    released = []
    parts = (
        QuantizedTensor(type_id, torch.from_numpy(a), cols, order, lambda: released.append(1)),
        QuantizedTensor(14, torch.from_numpy(b), cols),
    )
    weight = QuantizedParts(parts, (0, 16), 26, cols)
    x8 = pack_quantized(weight, None, TILES_FROM)
    stored = pack_quantized(weight, None, 1 << 30, interleave=False)
    assert x8.a.layouts() == ["x8", "rows"] and stored.a.layouts() == ["rows", "rows"]
    # the repacked part's blocks as stored are let go (a file's pages released once), the
    # part computed on as stored is kept as it is
    assert released == [1]
    assert x8.b.parts[0].data.is_meta and x8.b.parts[0].name == parts[0].name
    assert x8.b.parts[1] is parts[1] and stored.b.parts[0] is parts[0]
    # Q4_K's and Q5_K's scales held as bytes: +4 B per superblock, Q3_K's: +4, IQ4_XS's: +2;
    # the others as stored
    per_block = {10: 84, 11: 114, 12: 148, 13: 180, 14: 210, 23: 138}.get(type_id)
    per_block = per_block or {8: 34, 2: 18, 3: 20, 6: 22, 7: 24, 20: 18}[type_id]
    per_row = per_block * cols // (256 if type_id in K_TYPES else 32)
    assert x8.a.nbytes() == 16 * per_row + b.nbytes
    assert stored.a.nbytes() == a.nbytes + b.nbytes
    w = torch.cat((parts[0].dequantize(), parts[1].dequantize()))
    x = torch.from_numpy(rng.standard_normal((70, cols)).astype(np.float32))
    full = x8(x)
    assert relative_error(full, stored(x), x, w) < 2e-6
    # the fused Q6_K part rounds its activations per 256 values, the first part as its type does
    ref = torch.cat((int8_rounded(x, type_id) @ w[:16].T, int8_rounded(x, 14) @ w[16:].T), 1)
    assert relative_error(full, ref, x, w) < 2e-6
    for rows in (1, 2, 3, 5, 9):
        assert torch.equal(x8(x[:rows])[:, :16], full[:rows, :16])


@pytest.mark.parametrize("type_id", [10, 11, 12, 13, 14, 23, 8, 2, 3, 6, 7, 20])
def test_a_layers_rows_dequantise_as_the_table(type_id):
    """A tied embedding looks its tokens up in the LM head's layer (QuantLinear.rows): the same
    values as the table's rows as stored, whether the layer repacked them or not."""
    rng = np.random.default_rng(4)
    blocks = random_blocks(type_id, 24, 512, rng)
    layer = packed(blocks, type_id, 512).a
    ids = torch.tensor([[23, 0, 9], [8, 8, 15]])
    got = layer.rows(ids, torch.float32)
    assert got.shape == (2, 3, 512)
    assert torch.equal(got, reference_weight(blocks, type_id)[ids])
    with pytest.raises(RuntimeError, match="token id"):
        layer.rows(torch.tensor([24]), torch.float32)


def test_embedding_rows():
    rng = np.random.default_rng(3)
    blocks = random_blocks(14, 12, 256, rng)
    ids = torch.tensor([[3, 0, 11], [3, 3, 5]])
    got = ext.quant_embedding(torch.from_numpy(blocks), 14, 256, ids, torch.float32)
    assert got.shape == (2, 3, 256)
    assert torch.equal(got, reference_weight(blocks, 14)[ids])
    with pytest.raises(RuntimeError, match="token id"):
        ext.quant_embedding(torch.from_numpy(blocks), 14, 256, torch.tensor([12]), torch.float32)


def test_rejects_a_wrong_row_size():
    blocks = torch.zeros(4, 17, dtype=torch.uint8)
    with pytest.raises(ValueError, match="blocks"):
        QuantizedTensor(2, blocks, 32)
    with pytest.raises(RuntimeError, match="bytes"):
        ext.quant_dequantize(blocks, 2, 32)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k"])
def test_quantize_round_trip(kind):
    """quantize() writes blocks gguf reads back, and close to the weight."""
    w = torch.randn(8, 512) * 0.05
    q = quantize(w, kind)
    back = reference_weight(q.data.numpy(), q.type_id)
    assert torch.equal(q.dequantize(), back)
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < {"q8_0": 0.01, "q5_0": 0.05, "q5_1": 0.05}.get(kind, 0.12), rel


def test_kernel_isa_matches_build():
    want = {"avx512": ("avx2", "avx512vnni"), "avx2": ("avx2",), "scalar": ("scalar",)}
    isa = ext.isa()
    assert ext.quant_kernel_isa() in want.get(isa, ("scalar",)), (isa, features.vector_isa())
