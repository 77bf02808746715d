"""bench_decode_step runs each configuration in its own process and prints one table row each."""

from __future__ import annotations

from pagedattn.benchmarks import bench_decode_step
from tests.model.tiny import make_tiny_llama


def test_ablation_rows(tmp_path, capsys):
    model = make_tiny_llama(tmp_path)
    argv = ["--model", str(model), "--batch", "4", "--prompt-len", "8", "--max-tokens", "6"]
    argv += ["--measure", "3", "--configs", "default,no_step_ops", "--rounds", "1"]
    assert bench_decode_step.main(argv) == 0
    out = capsys.readouterr().out
    assert "| default | everything on (linear kernels: the kernel tuner's measured plan) |" in out
    assert "| no_step_ops | PyTorch norm/rope/SwiGLU/cache writes |" in out
    assert "1.00x" in out  # the default row against itself
