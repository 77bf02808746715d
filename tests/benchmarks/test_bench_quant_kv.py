"""bench quant --kv-cache-dtype: per-token-head int8/u8 writes, and fp8 runners on a tiny model."""

from __future__ import annotations

import pytest
import torch

from pagedattn.benchmarks.bench_quant import KVRunner, configure, fake_quant_per_token_head
from pagedattn.model.loader import load_model
from tests.model.tiny import make_tiny_llama


@pytest.mark.parametrize("kind,levels", [("int8", 255), ("u8", 256)])
def test_per_token_head_quantization_error_is_half_a_step(kind, levels):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.rand(5, 3, 1, generator=gen) * 10
    y = fake_quant_per_token_head(x, kind)
    span = (
        x.abs().amax(-1, keepdim=True) * 2
        if kind == "int8"
        else (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True))
    )
    step = span / (levels - 1)
    assert ((y - x).abs() <= step / 2 + 1e-6).all()
    # Each (token, head) has its own scale: a row 1000x smaller keeps its relative precision.
    x[0, 0] *= 1e-3
    y = fake_quant_per_token_head(x, kind)
    assert (y[0, 0] - x[0, 0]).abs().max() < 1e-3 * step.max()


def test_kv_dtypes_configure_the_layers_and_the_cache(tmp_path):
    model = load_model(str(make_tiny_llama(tmp_path)), "float32", "cpu").model
    tokens = [5, 17, 42, 8, 99, 23, 61]
    ref = KVRunner(model, 32, configure(model, "model")[0]).forward(tokens, 0)
    for name in ("fp8_e4m3", "fp8_e5m2", "u8"):
        dtype, layers = configure(model, name)
        runner = KVRunner(model, 32, dtype)
        assert runner.kv_caches[0][0].dtype == dtype
        assert (dtype == torch.uint8) == (name == "u8")  # u8: the engine's real u8 cache
        logits = runner.forward(tokens, 0)
        assert (logits - ref).abs().max() < 0.5  # close, not equal: the cache is lossy
        assert not torch.equal(logits, ref)
        computed = all(layer.k_scale != 1.0 for layer in layers)
        assert computed == (name == "fp8_e4m3")  # e4m3: scales from the first prefill
    configure(model, "model")  # back to plain writes, scales 1.0
    assert torch.equal(KVRunner(model, 32, torch.float32).forward(tokens, 0), ref)
