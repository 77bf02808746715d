"""The compiled per-layer step ops equal the PyTorch code they replace, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.attention.layout import PAD_SLOT_ID
from pagedattn.attention.ops import reshape_and_cache
from pagedattn.cpu import extension as cpu_ext
from pagedattn.model.layers import (
    GemmaRMSNorm,
    RMSNorm,
    apply_rotary,
    apply_rotary_,
    gelu_tanh_and_mul,
    silu_and_mul,
)

pytestmark = pytest.mark.skipif(cpu_ext.get_extension() is None, reason="extension unavailable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_write_matches_reshape_and_cache(dtype, slot_dtype):
    torch.manual_seed(0)
    num_blocks, block, heads, dim = 5, 4, 2, 16
    # key/value as strided views of one fused projection output, as in the model.
    fused = torch.randn(7, 3 * heads * dim, dtype=dtype)
    key = fused[:, heads * dim : 2 * heads * dim].view(7, heads, dim)
    value = fused[:, 2 * heads * dim :].view(7, heads, dim)
    # Six slot entries for seven tokens (the tail is padding), one PAD_SLOT_ID in the middle.
    slots = torch.tensor([3, 17, PAD_SLOT_ID, 0, 19, 8], dtype=slot_dtype)
    expected = [torch.full((num_blocks, block, heads, dim), -7.0, dtype=dtype) for _ in range(2)]
    got = [c.clone() for c in expected]
    reshape_and_cache(key, value, expected[0], expected[1], slots)
    backend = CpuBackend(use_extension=True)
    backend.reshape_and_cache(key, value, got[0], got[1], slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    untouched = got[0].view(-1, heads, dim)[[i for i in range(20) if i not in (3, 17, 0, 19, 8)]]
    assert (untouched == -7.0).all()


def test_cache_write_rejects_short_key():
    cache = torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="slot_mapping has 3 entries but key has 2"):
        cpu_ext.load_extension().cache_write(
            torch.ones(2, 1, 16), torch.ones(2, 1, 16), cache, cache.clone(), torch.arange(3)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_equals_apply_rotary(dtype):
    torch.manual_seed(0)
    tokens, q_heads, kv_heads, dim = 9, 6, 2, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = torch.randn(tokens, 1, dim // 2) * 10
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, (q_heads + kv_heads) * dim :].clone()
    qk = qkv[:, : (q_heads + kv_heads) * dim].view(tokens, q_heads + kv_heads, dim)
    assert apply_rotary_(qk, cos, sin) is qk
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * dim :], v_before)  # v untouched


def test_rotary_in_place_fallback_writes_back(monkeypatch):
    monkeypatch.setattr(cpu_ext, "get_extension", lambda: None)
    x = torch.randn(3, 2, 8)
    emb = torch.randn(3, 1, 8)
    expected = apply_rotary(x, emb.cos(), emb.sin())
    assert torch.equal(apply_rotary_(x, emb.cos(), emb.sin()), expected)
    assert torch.equal(x, expected)


def _reference_rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_compiled_rms_norm_and_residual_add(dtype, rows):
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    x = (torch.randn(rows, 576) * 3).to(dtype)
    residual = torch.randn(rows, 576).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(norm(x), _reference_rms_norm(x, norm.weight, norm.eps), **tol)
    expected_sum = residual + x  # HF's order; rounded once to the dtype
    expected = _reference_rms_norm(expected_sum, norm.weight, norm.eps)
    normed, new_residual = norm.add_and_norm(x, residual)
    assert new_residual is residual  # updated in place
    assert torch.equal(new_residual, expected_sum)
    torch.testing.assert_close(normed, expected, **tol)
    # Non-contiguous input (a q/k-norm view) takes the PyTorch path and still works.
    wide = torch.randn(4, 2 * 576).to(dtype)
    view = wide[:, :576]
    assert torch.equal(norm(view), _reference_rms_norm(view, norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_silu_and_mul(dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(37, 2 * 200) * 6).to(dtype)  # I = 200: vector body and scalar tail
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(silu_and_mul(gate_up), expected, **tol)
    assert silu_and_mul(gate_up).shape == (37, 200)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_gelu_tanh_and_mul(dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(37, 2 * 200) * 6).to(dtype)  # I = 200: vector body and scalar tail
    gate_up[0, :4] = torch.tensor([0.0, -30.0, 30.0, 1e-3]).to(dtype)  # tanh's saturation, 0
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up  # HF's GeGLU
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    got = gelu_tanh_and_mul(gate_up)
    assert got.shape == (37, 200) and got.dtype == dtype
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 640), (300, 640), (7, 4, 72)])
def test_compiled_gemma_rms_norm(dtype, shape):
    torch.manual_seed(0)
    norm = GemmaRMSNorm(shape[-1], 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]) * 0.5)
    x = (torch.randn(*shape) * 3).to(dtype)
    # HF's Gemma3RMSNorm: fp32 throughout, scaled by (1 + w), rounded once.
    x32 = x.float()
    expected = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
    expected = (expected * (1.0 + norm.weight.float())).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(norm(x), expected, **tol)
    # A strided view (a q/k norm of the fused qkv output) gives the same numbers.
    wide = torch.cat((x, x), dim=-1)
    torch.testing.assert_close(norm(wide[..., : shape[-1]]), norm(x), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_argmax_first_index_and_nan(dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    logits[1, 10] = logits[1, 900] = 50.0  # a tie: the first wins
    logits[2, 999] = 60.0  # in the scalar tail (1000 = 62 * 16 + 8)
    logits[3, 5] = logits[3, 7] = float("nan")  # NaN is the maximum: the first NaN
    logits[4] = float("-inf")
    logits = logits.to(dtype)
    got = cpu_ext.load_extension().argmax_last_dim(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got.tolist()[1:5] == [10, 999, 5, 0]
    # bf16 logits: their argmax is the float32 copy's (the sampler skips the copy).
    assert torch.equal(got, cpu_ext.load_extension().argmax_last_dim(logits.float()))


def test_step_ops_can_be_switched_off():
    assert cpu_ext.step_ops(enabled=False) is None
    x = torch.randn(4, 64)
    norm = RMSNorm(64, 1e-6, step_ops=False)
    assert torch.equal(norm(x), _reference_rms_norm(x, norm.weight, norm.eps))
    assert cpu_ext.step_ops() is cpu_ext.get_extension()
