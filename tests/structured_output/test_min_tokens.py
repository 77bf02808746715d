"""Structured output with min_tokens: the grammar wins; min_tokens holds back EOS only while the
grammar allows something else (issue 21, M1)."""

from __future__ import annotations

import re

import pytest
import torch

from pagedattn.model.gguf_loader import GGUFCheckpoint
from pagedattn.model.loader import packaged_model_path
from pagedattn.sampling_params import SamplingParams
from pagedattn.structured_output import StructuredOutputsParams, new_matcher
from pagedattn.worker.sampler import Sampler
from pagedattn.worker.sampling_metadata import build_sampling_metadata, make_generator

MAX_STEPS = 24


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("xgrammar")
    try:
        path = packaged_model_path("smollm2-135m-instruct")
    except Exception as exc:  # pragma: no cover - the package is a test dependency
        pytest.skip(f"SmolLM2 is not installed: {exc}")
    return GGUFCheckpoint(path).tokenizer()


def _run(tokenizer, params: SamplingParams, num_rows: int) -> list[list[int]]:
    """Decode num_rows siblings from random logits (EOS favoured) until each grammar ends."""
    vocab_size, eos = len(tokenizer), tokenizer.eos_token_id
    matchers = [new_matcher(params, tokenizer, vocab_size) for _ in range(num_rows)]
    gens = [make_generator(7 + i) for i in range(num_rows)]
    sampler, rng = Sampler(), torch.Generator().manual_seed(0)
    tokens: list[list[int]] = [[] for _ in range(num_rows)]
    live = list(range(num_rows))
    for _ in range(MAX_STEPS):
        if not live:
            break
        logits = torch.randn(len(live), vocab_size, generator=rng) * 4
        logits[:, eos] = 50.0  # the model wants to stop at every step
        meta = build_sampling_metadata(
            [params] * len(live), [tokens[i] for i in live], [[] for _ in live],
            [gens[i] for i in live], vocab_size, [eos], matchers=[matchers[i] for i in live],
        )  # fmt: skip
        out = sampler(logits, meta)
        for j, row in enumerate(live):
            tokens[row].append(int(out.sampled_token_ids[j]))
        live = [row for j, row in enumerate(live) if j not in out.terminated_rows]
    assert not live, "a grammar never completed"
    return tokens


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_bounded_grammar_ends_before_min_tokens_for_every_sibling(tokenizer, temperature):
    spec = StructuredOutputsParams(regex="[0-9]{3}")
    params = SamplingParams(
        n=2, temperature=temperature, seed=3, min_tokens=8, structured_outputs=spec
    )
    for ids in _run(tokenizer, params, num_rows=2):
        assert ids[-1] == tokenizer.eos_token_id
        assert re.fullmatch("[0-9]{3}", tokenizer.decode(ids[:-1]))


def test_min_tokens_holds_back_eos_while_the_grammar_allows_more(tokenizer):
    spec = StructuredOutputsParams(regex="[0-9]+")
    params = SamplingParams(temperature=0.8, seed=3, min_tokens=6, structured_outputs=spec)
    (ids,) = _run(tokenizer, params, num_rows=1)
    # EOS is favoured at every step, yet comes only once min_tokens tokens are out.
    assert len(ids) == 7 and ids[-1] == tokenizer.eos_token_id
    assert re.fullmatch("[0-9]+", tokenizer.decode(ids[:-1]))
