"""Triton kernels on an FP8 KV cache against the torch reference (interpreter on CPU, fp32)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from pagedattn.attention.backends.torch_ref import TorchRefBackend  # noqa: E402
from pagedattn.attention.backends.triton import TritonBackend  # noqa: E402
from pagedattn.attention.fp8 import quantize  # noqa: E402
from pagedattn.attention.layout import PAD_SLOT_ID  # noqa: E402

from ..paged_case import mixed_specs  # noqa: E402
from ..test_fp8 import fp8_case  # noqa: E402

if not torch.cuda.is_available() and isinstance(tl.zeros, JITFunction):
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set (see conftest.py); run "
        "tests/attention/backends/test_triton_fp8.py in its own pytest process",
        allow_module_level=True,
    )
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.02, 0.01


def _run(case, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    backend = TritonBackend(partition_size=16, block_m=16, block_n=16)
    meta = case.metadata
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    args = (case.query.to(DEVICE), case.key_cache.to(DEVICE), case.value_cache.to(DEVICE), meta)
    kwargs = dict(scale=32**-0.5, k_scale=K_SCALE, v_scale=V_SCALE, **kwargs)
    out = backend.forward(*args, **kwargs).cpu()
    return out, TorchRefBackend().forward(*args, **kwargs).cpu()


@pytest.mark.parametrize("cache_dtype", FP8)
def test_decode_partitions_match_reference(cache_dtype):
    specs = [(3 * 8 + 5, 1), (16, 1), (7, 1), (40, 1)]
    case = fp8_case(
        specs, cache_dtype, k_scale=K_SCALE, v_scale=V_SCALE, block_size=8, num_kv_heads=2,
        group=3,
    )  # fmt: skip
    out, expected = _run(case, sliding_window=20)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_mixed_prefill_matches_reference(cache_dtype):
    case = fp8_case(
        mixed_specs(8), cache_dtype, k_scale=K_SCALE, v_scale=V_SCALE, block_size=8,
        num_kv_heads=2, group=2,
    )  # fmt: skip
    out, expected = _run(case, logits_soft_cap=3.0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_cache_write_quantizes_into_addressed_slots(cache_dtype):
    backend = TritonBackend()
    key_cache, value_cache = backend.allocate_kv_cache(4, 4, 2, 16, cache_dtype, DEVICE)
    key, value = torch.randn(4, 2, 16) * 3, torch.randn(4, 2, 16)
    slots = torch.tensor([5, PAD_SLOT_ID, 15, 0])
    backend.reshape_and_cache(
        key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE), 0.5, 0.25
    )
    raw_key = key_cache.cpu().view(torch.uint8).reshape(16, 2, 16)
    raw_value = value_cache.cpu().view(torch.uint8).reshape(16, 2, 16)
    for token, slot in ((0, 5), (2, 15), (3, 0)):
        assert torch.equal(raw_key[slot], quantize(key[token], cache_dtype, 0.5).view(torch.uint8))
        assert torch.equal(
            raw_value[slot], quantize(value[token], cache_dtype, 0.25).view(torch.uint8)
        )
    assert raw_key.count_nonzero(dim=(1, 2)).gt(0).sum() <= 3
