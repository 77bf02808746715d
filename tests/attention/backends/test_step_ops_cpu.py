"""The compiled per-layer step ops equal the PyTorch code they replace, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedattn.attention.backends import cpu_ext
from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.attention.metadata import PAD_SLOT_ID
from pagedattn.attention.ops import reshape_and_cache
from pagedattn.model.layers import RMSNorm, apply_rotary, apply_rotary_

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


@pytest.mark.parametrize("shape", [(1, 64), (32, 576), (5, 3, 100)])
def test_fused_rms_norm_is_bitwise_the_reference(shape):
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    x = torch.randn(*shape) * 3
    x32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    assert torch.equal(norm(x), norm.weight * x32)
    assert isinstance(norm, nn.Module)
