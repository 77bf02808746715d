"""The compiled panel GEMM (linear_packed) against F.linear, on the build this process loaded.

The panels come from pagedattn.cpu.linear.pack_panels, whose layout tests/cpu/test_linear.py pins
(panel p, row k holds W[32p + j, k], zero past N; bf16 rows interleave columns j and 16 + j).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedattn.cpu import extension as cpu_ext
from pagedattn.cpu.linear import pack_panels as pack


@pytest.fixture(scope="module")
def ext():
    return cpu_ext.load_extension()


def test_build_reports_its_vectors(ext):
    assert ext.isa() in ("avx512", "avx2", "neon", "sve", "scalar")
    expected = {"avx512": 16, "avx2": 8, "neon": 4, "scalar": 8}.get(ext.isa())
    assert expected is None or ext.vector_width() == expected
    assert ext.linear_packed_vectorized() == (ext.isa() != "scalar")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 13, 32, 131])
@pytest.mark.parametrize("n,k", [(64, 40), (70, 33), (5, 16)])  # whole, ragged and tiny panels
def test_linear_packed_matches_f_linear(ext, x_dtype, w_dtype, rows, n, k):
    torch.manual_seed(rows * n + k)
    weight = torch.randn(n, k).to(w_dtype)
    bias = torch.randn(n)
    x = torch.randn(rows, k).to(x_dtype)
    expected = F.linear(x.double(), weight.double(), bias.double())
    for b in (bias, None):
        got = ext.linear_packed(x, pack(weight), n, b)
        assert got.dtype == x_dtype and got.shape == (rows, n)
        want = expected if b is not None else expected - bias.double()
        tol = 1e-4 if x_dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_linear_packed_sums_in_order_in_fp32(ext):
    # One fused multiply-add per k in order: a [1, K] x [K, N] product equals the same fp32 loop.
    torch.manual_seed(0)
    x, weight = torch.randn(1, 50), torch.randn(40, 50)
    got = ext.linear_packed(x, pack(weight), 40, None)
    expected = torch.zeros(40, dtype=torch.float64)
    for kk in range(50):  # fma rounds once per term: emulate in float64, round each step
        expected = (expected + x[0, kk].double() * weight[:, kk].double()).float().double()
    torch.testing.assert_close(got[0].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 40), (70, 300), (1030, 64)])
def test_a_row_is_the_same_whatever_rows_share_the_call(ext, w_dtype, n, k):
    # 1, 5 and 40 rows take different paths through the panels (one row streams two panels at
    # a time where a thread claims several; 5 rows make two micro-kernel calls; on AVX2 and NEON
    # a bf16 panel is widened to fp32 once for 40 rows' 14 blocks). Each row's sum runs the same
    # fused multiply-adds in the same order, so its bits cannot depend on the path.
    torch.manual_seed(n + k)
    weight, bias = torch.randn(n, k).to(w_dtype), torch.randn(n)
    x = torch.randn(40, k)
    packed = pack(weight)
    whole = ext.linear_packed(x, packed, n, bias)
    for rows in (1, 5):
        for start in (0, 17, 40 - rows):
            part = ext.linear_packed(x[start : start + rows].contiguous(), packed, n, bias)
            assert torch.equal(part, whole[start : start + rows])
