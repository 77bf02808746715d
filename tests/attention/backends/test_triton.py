"""Triton kernels against dense attention; on CPU they run under TRITON_INTERPRET=1 (fp32, tiny).

On a CUDA machine the same cases run compiled on the GPU (not exercised in this repo's CI).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from pagedattn.attention.backends.triton import TritonBackend  # noqa: E402
from pagedattn.attention.layout import PAD_SLOT_ID  # noqa: E402

from ..paged_case import assert_matches_dense, make_case, mixed_specs  # noqa: E402

ON_GPU = torch.cuda.is_available()
if not ON_GPU and isinstance(tl.zeros, JITFunction):
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set (see conftest.py); run "
        "tests/attention/backends/test_triton.py in its own pytest process",
        allow_module_level=True,
    )
DEVICE = "cuda" if ON_GPU else "cpu"


def _backend() -> TritonBackend:
    # Small partitions so that the decode cases span several partitions and exercise the merge.
    return TritonBackend(partition_size=16, block_m=16, block_n=16)


def _to_device(case):
    for name in ("query", "key_cache", "value_cache"):
        setattr(case, name, getattr(case, name).to(DEVICE))
    meta = case.metadata
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return case


class _CpuResult:
    """Moves the backend output back to CPU for comparison with the CPU oracle."""

    def __init__(self, backend: TritonBackend) -> None:
        self.backend = backend

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.backend.forward(*args, **kwargs).cpu()


def _check(case, **kwargs) -> None:
    assert_matches_dense(_CpuResult(_backend()), _to_device(case), **kwargs)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_decode_partitions_match_dense(block_size):
    specs = [(3 * block_size + 5, 1), (2 * block_size, 1), (block_size - 1 or 1, 1), (40, 1)]
    case = make_case(specs, block_size=block_size, num_kv_heads=2, group=3, seed=block_size)
    assert case.metadata.is_pure_decode
    _check(case)


def test_decode_window_softcap_shared_prefix_mqa():
    specs = [(40, 1), (37, 1), (33, 1)]
    case = make_case(specs, block_size=8, num_kv_heads=1, group=8, shared_prefix_blocks=3)
    _check(case, sliding_window=7, logits_soft_cap=3.0)
    _check(case, sliding_window=20)


@pytest.mark.parametrize("block_size,num_kv_heads,group", [(8, 2, 3), (16, 2, 1), (1, 1, 8)])
def test_mixed_prefill_decode_matches_dense(block_size, num_kv_heads, group):
    case = make_case(
        mixed_specs(block_size), block_size=block_size, num_kv_heads=num_kv_heads, group=group
    )
    _check(case)


def test_prefill_window_softcap_shared_prefix():
    specs = [(40, 1), (37, 20), (9, 9)]
    case = make_case(specs, block_size=8, num_kv_heads=2, group=3, shared_prefix_blocks=3)
    _check(case, sliding_window=5, logits_soft_cap=2.0, scale=0.5)


def test_cache_write_only_addressed_slots():
    num_blocks, block_size, num_kv_heads, head_size = 4, 4, 2, 8
    backend = _backend()
    key_cache, value_cache = backend.allocate_kv_cache(
        num_blocks, block_size, num_kv_heads, head_size, torch.float32, DEVICE
    )
    key_cache.fill_(-7.0)
    value_cache.fill_(-7.0)
    key = torch.randn(4, num_kv_heads, head_size)
    value = torch.randn(4, num_kv_heads, head_size)
    slots = torch.tensor([5, PAD_SLOT_ID, 15, 0])
    backend.reshape_and_cache(
        key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE)
    )
    expected_key = torch.full((num_blocks * block_size, num_kv_heads, head_size), -7.0)
    expected_value = expected_key.clone()
    for token, slot in ((0, 5), (2, 15), (3, 0)):
        expected_key[slot], expected_value[slot] = key[token], value[token]
    assert torch.equal(key_cache.cpu().reshape(expected_key.shape), expected_key)
    assert torch.equal(value_cache.cpu().reshape(expected_value.shape), expected_value)
