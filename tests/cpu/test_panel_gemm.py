"""The compiled panel GEMM (linear_packed) against F.linear, on the build this process loaded.

The panels are packed here, independently of pagedattn.cpu.linear, so the test pins the C++
kernel's layout: panel p, row k holds W[32p + j, k] (zero past N); bf16 rows interleave columns
j and 16 + j in lanes 2j and 2j + 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedattn.cpu import extension as cpu_ext

PANEL = 32


@pytest.fixture(scope="module")
def ext():
    return cpu_ext.load_extension()


def pack(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = torch.zeros(num_panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    panels = padded.view(num_panels, PANEL, k).transpose(1, 2)  # [P, K, 32]
    if weight.dtype == torch.bfloat16:
        pairs = torch.stack((panels[..., : PANEL // 2], panels[..., PANEL // 2 :]), dim=-1)
        panels = pairs.reshape(num_panels, k, PANEL)  # [P, K, 16 pairs x 2]
    return panels.contiguous()


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
