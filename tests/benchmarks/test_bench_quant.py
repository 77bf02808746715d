"""bench_quant: agreement counting, and the single-sequence runner equals a full forward."""

from __future__ import annotations

import torch

from pagedattn.benchmarks.bench_quant import SequenceRunner, agreement, weight_bytes
from pagedattn.model.loader import load_model
from tests.model.tiny import make_tiny_llama


def test_agreement_counts_tokens_before_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement(ref, ref) == (2, 1.0)
    assert agreement(ref, [[1, 2, 9, 4], [5, 6, 7, 8]]) == (1, (0.5 + 1.0) / 2)
    assert agreement(ref, [[0, 2, 3, 4], [0, 6, 7, 8]]) == (0, 0.0)


def test_runner_decode_matches_prefill_and_int8_weighs_less(tmp_path):
    path = str(make_tiny_llama(tmp_path))
    model = load_model(path, "float32", "cpu", linear_kernel="torch").model
    tokens = [5, 17, 42, 8, 99, 23, 61]
    full = SequenceRunner(model, 64).forward(tokens, 0)  # [7, V]
    runner = SequenceRunner(model, 64)
    runner.forward(tokens[:4], 0)
    stepped = torch.cat([runner.forward([t], 4 + i) for i, t in enumerate(tokens[4:])])
    torch.testing.assert_close(stepped, full[4:], atol=1e-4, rtol=1e-4)
    out, times = runner.greedy(tokens, 5)
    assert len(out) == 5 and len(times) == 4
    assert runner.mean_nll(tokens) > 0
    fp32 = load_model(path, "float32", "cpu", linear_kernel="onednn").model
    q8 = load_model(path, "float32", "cpu", quantization="int8").model
    assert 0 < weight_bytes(q8) < weight_bytes(fp32) / 3
