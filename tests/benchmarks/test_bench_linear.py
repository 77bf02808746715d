"""bench_linear times every available kernel on the same products and prints one row per size."""

from __future__ import annotations

import torch

from pagedattn.benchmarks import bench_linear


def test_kernels_compute_the_same_products():
    torch.manual_seed(0)
    weights = [torch.randn(40, 24), torch.randn(7, 40)]
    x = {24: torch.randn(5, 24), 40: torch.randn(5, 40)}
    fns = bench_linear.kernels(weights)
    assert "F.linear" in fns
    for name, calls in fns.items():
        for w, call in zip(weights, calls, strict=True):
            expected = x[w.shape[1]] @ w.t()
            # bf16 weights round each weight to 8 bits of mantissa; the rest are fp32.
            tol = 0.05 if "bf16" in name else 1e-5
            torch.testing.assert_close(call(x[w.shape[1]]), expected, atol=tol, rtol=tol)


def test_table_rows(capsys):
    assert (
        bench_linear.main(["--rows", "1,4", "--layers", "1", "--reps", "1", "--vocab", "300"]) == 0
    )
    out = capsys.readouterr().out
    assert "| rows | F.linear ms |" in out
    assert out.count("\n| 1 | ") == 1 and out.count("\n| 4 | ") == 1
