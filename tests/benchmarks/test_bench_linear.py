"""bench_linear times every available kernel on the same products and prints one row per size."""

from __future__ import annotations

import pytest
import torch

from pagedattn.benchmarks import bench_linear


def test_kernels_compute_the_same_products():
    torch.manual_seed(0)
    # NOTE: shapes every kernel takes (the AMX tiles need K % 32 == 0 and N % 16 == 0; int4
    # groups of 32 along K, packed two k tiles at a time).
    weights = [torch.randn(32, 64), torch.randn(64, 128)]
    x = {64: torch.randn(5, 64), 128: torch.randn(5, 128)}
    fns = bench_linear.kernels(weights)
    assert "F.linear" in fns and "int8 weight-only" in fns and "int4 weight-only (torch)" in fns
    for name, calls in fns.items():
        for w, call in zip(weights, calls, strict=True):
            expected = x[w.shape[1]] @ w.t()
            # bf16 rounds each weight to 8 significant bits, int8 to 1/127 of its row's
            # largest; the rest are fp32.
            # int4 to 1/15 of its group's range (sums of 128 such errors: a few units).
            tol = 0.2 if "int8" in name else 0.05 if "bf16" in name else 1e-5
            atol = 4.0 if "int4" in name else tol
            torch.testing.assert_close(call(x[w.shape[1]]), expected, atol=atol, rtol=tol)


def test_table_rows(capsys):
    assert (
        bench_linear.main(["--rows", "1,4", "--layers", "1", "--reps", "1", "--vocab", "300"]) == 0
    )
    out = capsys.readouterr().out
    assert "| rows | F.linear ms |" in out
    assert out.count("\n| 1 | ") == 1 and out.count("\n| 4 | ") == 1


def test_kernels_option_picks_columns(capsys):
    argv = ["--rows", "2", "--layers", "1", "--reps", "1", "--vocab", "64"]
    assert bench_linear.main([*argv, "--kernels", "int8 weight-only"]) == 0
    out = capsys.readouterr().out
    assert "| rows | F.linear ms | int8 weight-only ms |" in out
    try:
        bench_linear.main([*argv, "--kernels", "no such kernel"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("an unknown kernel name must be refused")


def test_w8a8_column_only_with_int8_dot_products_unless_named(monkeypatch):
    if not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        pytest.skip("this torch has no oneDNN int8 GEMM: the column never exists")
    weights = [torch.randn(32, 64)]
    monkeypatch.setattr(bench_linear, "has_int8_dot_hardware", lambda: False)
    assert "int8 W8A8 oneDNN" not in bench_linear.kernels(weights)
    assert "int8 W8A8 oneDNN" in bench_linear.kernels(weights, frozenset({"int8 W8A8 oneDNN"}))
    monkeypatch.setattr(bench_linear, "has_int8_dot_hardware", lambda: True)
    assert "int8 W8A8 oneDNN" in bench_linear.kernels(weights)
