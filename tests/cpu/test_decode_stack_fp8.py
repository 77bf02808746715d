"""The compiled decode stack over an FP8 or u8 KV cache: the Python layers' logits, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention import u8
from pagedattn.cpu import extension as cpu_ext
from pagedattn.model.layers import PagedAttention
from tests.cpu.test_decode_stack import _count_stack_steps, _load
from tests.model.paged_driver import PagedDriver
from tests.model.tiny import make_tiny_llama

pytestmark = pytest.mark.skipif(
    cpu_ext.get_extension() is None, reason="the compiled CPU extension cannot be built here"
)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_reads_fp8_with_the_layers_scales(tmp_path, monkeypatch, cache_dtype, dtype):
    model = _load(make_tiny_llama(tmp_path), dtype, "torch")
    stack = model.decode_stack
    assert stack is not None
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, PagedAttention)):
        layer.k_scale, layer.v_scale = 0.01 * (i + 1), 0.004 * (i + 2)  # per layer, not 1.0
    _assert_stack_matches_layers(
        model, stack, monkeypatch, lambda t: t.to(cache_dtype), lambda t: t.view(torch.uint8)
    )


def test_scales_to_calculate_are_set_by_the_layers_before_the_stack_runs(tmp_path, monkeypatch):
    """--calculate-kv-scales sets the scales in PagedAttention.forward, which the stack bypasses:
    a first step the stack could run (one token per sequence) must run the layers instead."""
    model = _load(make_tiny_llama(tmp_path), "float32", "torch")
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for layer in layers:
        layer.calculate_kv_scales = True
    calls = _count_stack_steps(monkeypatch)
    driver = PagedDriver(model, seed=1, backend="cpu")
    driver.kv_caches = [
        (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in driver.kv_caches
    ]
    got = driver.step([(0, [7]), (1, [9])])  # one token each: a step the stack can run
    assert calls == []  # the layers ran, and set their scales
    assert all(not a.calculate_kv_scales and a.k_scale != 1.0 for a in layers)
    driver.step([(s, [int(g[-1].argmax())]) for s, g in enumerate(got)])
    assert calls == [2]  # then the stack takes the decode steps


def test_stack_reads_u8_as_the_layers_do(tmp_path, monkeypatch):
    model = _load(make_tiny_llama(tmp_path), "bfloat16", "torch")
    stack = model.decode_stack
    assert stack is not None
    _assert_stack_matches_layers(model, stack, monkeypatch, u8.quantize, lambda t: t)


def _assert_stack_matches_layers(model, stack, monkeypatch, to_cache, as_bytes) -> None:
    """Four steps on the compiled stack and on the Python layers, from caches converted by
    ``to_cache``: equal logits at every step, every decode step on the stack, equal caches."""
    calls = _count_stack_steps(monkeypatch)
    with_stack, python = (PagedDriver(model, seed=1, backend="cpu") for _ in range(2))
    for driver in (with_stack, python):
        driver.kv_caches = [(to_cache(k), to_cache(v)) for k, v in driver.kv_caches]
    gen = torch.Generator().manual_seed(0)
    chunks = [
        (s, torch.randint(5, 128, (n,), generator=gen).tolist()) for s, n in enumerate((9, 3))
    ]
    for step in range(4):
        model.decode_stack = stack
        got = with_stack.step(chunks)
        model.decode_stack = None
        want = python.step(chunks)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"step {step}: the stack's logits differ"
        chunks = [(s, [int(g[-1].argmax())]) for s, g in enumerate(got)]
    assert calls == [2] * 3  # every decode step ran on the stack
    for a, b in zip(with_stack.kv_caches, python.kv_caches, strict=True):
        assert torch.equal(as_bytes(a[0]), as_bytes(b[0]))
