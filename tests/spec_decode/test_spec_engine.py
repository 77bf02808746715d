"""Speculative decoding through the engine: greedy output token-identical to plain decoding, and
every sampling parameter keeps its meaning (max_tokens, stop strings, seeds, logprobs, grammars,
n > 1)."""

from __future__ import annotations

import pytest

from pagedattn import LLM, SamplingParams
from pagedattn.structured_output import StructuredOutputsParams
from tests.model.tiny import make_tiny_gemma3, make_tiny_llama

SPEC = {
    "speculative_method": "ngram",
    "num_speculative_tokens": 4,
    "ngram_min": 1,
    "ngram_max": 3,
    "speculative_disable_by_batch_size": 64,
}
# Repeated spans: prompt lookup finds matches from the first step on.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6],
    [40, 41, 42, 43, 44] * 4 + [40],
    [3, 90, 91, 3, 90, 91, 3],
    list(range(20, 57)) + list(range(20, 30)),
]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def pair(request, tmp_path_factory):
    maker = make_tiny_llama if request.param == "llama" else make_tiny_gemma3
    path = maker(tmp_path_factory.mktemp(request.param))
    common = {"dtype": "float32", "num_blocks": 256, "block_size": 4}
    return LLM(path, **common), LLM(path, **common, **SPEC)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_is_token_identical(pair):
    plain, spec = pair
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = _tokens(plain.generate(PROMPTS, params))
    before = spec.get_stats().spec_decode.num_draft_tokens
    assert _tokens(spec.generate(PROMPTS, params)) == expected
    stats = spec.get_stats()
    assert stats.spec_decode.num_draft_tokens > before
    assert stats.spec_decode.num_accepted_tokens > 0
    assert stats.kv_cache_usage == 0.0
    assert stats.num_free_blocks == plain.get_stats().num_free_blocks


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 13])
def test_max_tokens_is_never_exceeded(pair, max_tokens):
    plain, spec = pair
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = spec.generate(PROMPTS, params)
    assert all(len(c.token_ids) == max_tokens for o in outs for c in o.outputs)
    assert _tokens(outs) == _tokens(plain.generate(PROMPTS, params))


def test_stop_strings_cut_at_the_same_token(pair):
    plain, spec = pair
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    words = plain.generate(PROMPTS[:1], free)[0].outputs[0].text.split()
    stop = words[len(words) // 2]  # a word the output reaches mid-way
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    want, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    for w, g in zip(want, got, strict=True):
        assert (g.outputs[0].text, g.outputs[0].token_ids) == (
            w.outputs[0].text,
            w.outputs[0].token_ids,
        )
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert want[0].outputs[0].finish_reason == "stop"


def test_seeds_logprobs_and_grammars_keep_their_meaning(pair):
    plain, spec = pair
    cases = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(choice=("w1 w2 w3", "w4 w5")),
        ),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
    ]
    for params in cases:
        want = plain.generate(PROMPTS[:2], params)
        got = spec.generate(PROMPTS[:2], params)
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, params
            assert g.outputs[0].text == w.outputs[0].text
            if params.logprobs is not None:
                assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_n_siblings_each_speculate(pair):
    _, spec = pair
    before = spec.get_stats().spec_decode.num_drafts
    params = SamplingParams(temperature=0.0, n=3, max_tokens=20, ignore_eos=True)
    out = spec.generate(PROMPTS[:1], params)[0]
    assert len(out.outputs) == 3
    assert all(
        c.token_ids == out.outputs[0].token_ids and len(c.token_ids) == 20 for c in out.outputs
    )
    assert spec.get_stats().spec_decode.num_drafts >= before + 3
    sampled = SamplingParams(temperature=1.0, n=3, max_tokens=9, ignore_eos=True)
    assert all(len(c.token_ids) == 9 for c in spec.generate(PROMPTS[:1], sampled)[0].outputs)
