"""MKL packed linear layers compute what F.linear computes, for any batch size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedattn.attention.backends.cpu_ext import flush_denormals_all_threads
from pagedattn.model.packed_linear import mkl_packing_available, pack_linear_layers

pytestmark = pytest.mark.skipif(not mkl_packing_available(), reason="torch built without MKL")


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 32, 300])
def test_packed_linear_matches_f_linear(num_tokens):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 48, bias=False))
    x = torch.randn(num_tokens, 96)
    with torch.no_grad():
        expected = model(x)
        assert pack_linear_layers(model) == 2
        assert all(hasattr(m, "packed_weight") for m in model)
        got = model(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_layers_are_left_alone():
    model = nn.Linear(16, 16).bfloat16()
    assert pack_linear_layers(model) == 0
    assert not hasattr(model, "packed_weight")


def test_flush_denormals_reaches_the_worker_threads():
    assert flush_denormals_all_threads()
    x = torch.full((1 << 20,), 1e-39)  # a denormal float32, large enough to run in parallel
    # An intra-op parallel kernel: every thread must now treat denormal inputs as zero.
    assert torch.count_nonzero(x * 1.0).item() == 0
