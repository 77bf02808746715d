"""Backend registry: by name and by device."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention.backends.base import default_backend_name, get_attn_backend
from pagedattn.attention.layout import KVCacheLayout


def test_backends_by_name_and_device():
    assert get_attn_backend("torch", "cpu").name == "torch"
    assert get_attn_backend("cpu", "cpu").name == "cpu"
    assert get_attn_backend(None, "cpu").name == "cpu"
    assert default_backend_name("cuda") == "triton"


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attn_backend("nope", "cpu")


def test_flash_cache_shape_and_allocation():
    backend = get_attn_backend("cpu", "cpu")
    assert backend.layout is KVCacheLayout.FLASH
    assert backend.kv_cache_shape(10, 16, 3, 64) == (10, 16, 3, 64)
    key_cache, value_cache = backend.allocate_kv_cache(10, 16, 3, 64, torch.bfloat16, "cpu")
    assert key_cache.shape == value_cache.shape == (10, 16, 3, 64)
    assert key_cache.dtype == torch.bfloat16


def test_missing_optional_backend_is_a_clear_error():
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="'flash_attn' is not available"):
            get_attn_backend("flash_attn", "cuda")
    else:
        pytest.skip("flash_attn is installed")
