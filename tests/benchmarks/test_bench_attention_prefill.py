"""bench attention's prefill rows: every cpu path on one prompt, agreeing with contiguous SDPA."""

from __future__ import annotations

import argparse

import torch

from pagedattn.benchmarks.bench_attention import bench_prefill, write_report
from pagedattn.cpu import extension as cpu_ext


def test_prefill_rows_agree_and_are_reported(tmp_path):
    args = argparse.Namespace(
        prefill_heads=["9/3x64"], prefill_lens=[100], block_size=16, warmup=0, repeats=1,
        num_seqs=1, threads=2, seed=0, mean_len=10.0,
    )  # fmt: skip
    rows = bench_prefill(args, torch.Generator().manual_seed(0))
    backends = {r["backend"] for r in rows}
    expected = {"cpu-torch", "cpu-ext"} if cpu_ext.get_extension() else {"cpu-torch"}
    assert backends == expected
    for row in rows:
        assert row["length"] == 100 and row["ms"] > 0 and row["gflops"] > 0
        assert row["diff"] < 3e-2  # bf16 outputs against SDPA on the same K/V
    write_report(tmp_path, 10.0, [], [], args, prefill=rows)
    text = (tmp_path / "bench_attention.md").read_text()
    assert "Machine: " in text and "| 9/3x64 | 100 | cpu-torch |" in text
