"""The engine with a u8 KV cache: close to the float32 cache's greedy tokens; the same tokens
through both backends, under preemption and on prefix-cache hits (each row's scale and min travel
inside its block)."""

from __future__ import annotations

import pytest
import torch

from pagedattn import LLM, SamplingParams
from tests.model.tiny import make_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _agreed(ref, got) -> int:
    """Tokens before the first divergence, summed over the prompts."""
    total = 0
    for a, b in zip(ref, got, strict=True):
        total += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return total


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in (3, 16, 17, 33)]
    float32 = _tokens(LLM(path, dtype="float32", num_blocks=256, block_size=4), prompts)
    llm = LLM(path, dtype="float32", kv_cache_dtype="u8", num_blocks=256, block_size=4)
    return path, prompts, float32, llm


def test_u8_cache_is_close_to_the_float32_cache(tiny):
    _, prompts, float32, llm = tiny
    runner = llm.engine.runner
    assert runner.kv_cache_dtype == torch.uint8
    assert runner.kv_caches[0][0].shape[-1] == runner.model.head_size + 8  # + scale, min
    assert "KV cache u8" in llm.engine.kv_summary
    # NOTE: lossy: on this random tiny model 31 of 32 greedy tokens come before a divergence
    # (fp8_e4m3 with scales 1.0: 25).
    assert _agreed(float32, _tokens(llm, prompts)) >= 0.9 * 8 * len(prompts)


def test_u8_cache_same_tokens_on_torch_backend_preemption_and_prefix_hits(tiny):
    path, prompts, _, llm = tiny
    u8 = _tokens(llm, prompts)
    hits = llm.get_stats().prefix_cache_hits
    assert _tokens(llm, prompts) == u8
    assert llm.get_stats().prefix_cache_hits > hits  # prompt blocks from the prefix cache
    ref = LLM(path, dtype="float32", kv_cache_dtype="u8", num_blocks=256, block_size=4,
              attn_backend="torch")  # fmt: skip
    assert _tokens(ref, prompts) == u8
    # 13 usable blocks of 4 for prompts that grow to 3 + 6 + 7 + 11 blocks: preemption.
    small = LLM(path, dtype="float32", kv_cache_dtype="u8", num_blocks=14, block_size=4,
                max_num_batched_tokens=16)  # fmt: skip
    assert _tokens(small, prompts) == u8
    assert small.get_stats().num_preemptions > 0
    assert small.get_stats().kv_cache_usage == 0.0
