"""The engine with an FP8 KV cache: dtype from the option, per-layer scales computed and used."""

from __future__ import annotations

import pytest
import torch

from pagedattn import LLM, SamplingParams
from pagedattn.config import ConfigError
from pagedattn.model.layers import PagedAttention
from tests.model.tiny import make_tiny_llama

PROMPTS = [[5, 9, 11, 7, 3, 8, 21, 30, 4, 6, 12, 14, 15, 16, 17, 18, 19, 20, 22], [3, 4, 5]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


def _layers(llm) -> list[PagedAttention]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, PagedAttention)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_computed_scales_map_calibration_amax_to_448(tiny, backend):
    llm = LLM(
        tiny, dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True,
        num_blocks=256, block_size=4, attn_backend=backend,
    )  # fmt: skip
    runner = llm.engine.runner
    assert runner.kv_cache_dtype == torch.float8_e4m3fn
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    for layer, (key_cache, value_cache) in zip(_layers(llm), runner.kv_caches, strict=True):
        assert 0 < layer.k_scale != 1.0 and 0 < layer.v_scale != 1.0
        assert not layer.calculate_kv_scales  # once, before any request
        # The calibration prefill's largest |K| and |V| were stored as the format's largest value.
        assert key_cache.float().abs().max() == 448.0
        assert value_cache.float().abs().max() == 448.0
    pool = llm.engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks  # the calibration kept none
    out = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)


def test_scales_do_not_depend_on_the_first_request(tiny):
    """A one-token first prompt used to set the scales from one token's amax (issue 52): now
    every start calibrates on the same built-in text, so the scales are the same whatever the
    first request, and span more than one token's values."""
    scales = []
    for first in ([7], PROMPTS[0]):
        llm = LLM(
            tiny, dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True,
            num_blocks=256, block_size=4,
        )  # fmt: skip
        llm.generate([first], GREEDY)
        scales.append([(layer.k_scale, layer.v_scale) for layer in _layers(llm)])
    assert scales[0] == scales[1]
    one_token = LLM(tiny, dtype="float32", kv_cache_dtype="fp8", num_blocks=256, block_size=4)
    layer = _layers(one_token)[0]
    layer.calculate_kv_scales = True
    one_token.generate([[7]], GREEDY)
    assert scales[0][0][0] > layer.k_scale  # the old rule: one token's smaller amax


def test_compiled_and_reference_backends_agree_on_fp8(tiny):
    """The cpu backend (compiled decode, dequantizing prefill) and the torch reference read the
    same fp8 bytes with the same scales: the same greedy tokens."""
    outs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(
            tiny, dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True,
            num_blocks=256, block_size=4, attn_backend=backend,
        )  # fmt: skip
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert outs["cpu"] == outs["torch"]


def test_default_scales_are_one_and_e5m2_name(tiny):
    llm = LLM(tiny, dtype="bfloat16", kv_cache_dtype="fp8_e5m2", num_blocks=64, block_size=4)
    assert llm.engine.runner.kv_cache_dtype == torch.float8_e5m2
    llm.generate(PROMPTS, GREEDY)
    assert all(layer.k_scale == layer.v_scale == 1.0 for layer in _layers(llm))
    # /debug/kv and the dashboard show the element type and a block's bytes.
    snapshot = llm.engine.kv_snapshot()
    runner = llm.engine.runner
    layers = len(runner.kv_caches)
    assert snapshot["kv_cache_dtype"] == "float8_e5m2"
    assert snapshot["bytes_per_block"] == 2 * layers * runner.kv_caches[0][0][0].numel()


def test_unknown_kv_dtype_is_rejected(tiny):
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp4'"):
        LLM(tiny, kv_cache_dtype="fp4", num_blocks=16)
