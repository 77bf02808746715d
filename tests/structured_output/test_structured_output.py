"""Structured output: grammars compiled once per spec, bitmasks in the sampler, matchers advanced.

On SmolLM2's real tokenizer (49,152 tokens) with random logits: whatever the logits say, the
sampled text must follow the grammar, and a grammar that cannot compile is a clear error.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedattn.model.gguf_loader import GGUFCheckpoint
from pagedattn.model.loader import packaged_model_path
from pagedattn.sampling_params import SamplingParams
from pagedattn.structured_output import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
    new_matcher,
)
from pagedattn.structured_output.compiler import grammar_cache
from pagedattn.worker.sampler import Sampler
from pagedattn.worker.sampling_metadata import build_sampling_metadata, make_generator

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "object", "properties": {"unit": {"enum": ["cm", "in"]}},
                 "required": ["unit"], "additionalProperties": False},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}  # fmt: skip
MAX_STEPS = 60


@pytest.fixture(scope="module")
def tokenizer():
    try:
        path = packaged_model_path("smollm2-135m-instruct")
    except Exception as exc:  # pragma: no cover - the package is a test dependency
        pytest.skip(f"SmolLM2 is not installed: {exc}")
    return GGUFCheckpoint(path).tokenizer()


@pytest.fixture(scope="module")
def vocab_size(tokenizer):
    return len(tokenizer)


def _decode_run(tokenizer, vocab_size, params_list, seed=0, unconstrained_rows=()):
    """Sample MAX_STEPS tokens for a batch from random logits; per row, its tokens."""
    matchers = [new_matcher(p, tokenizer, vocab_size) for p in params_list]
    gens = [make_generator(seed + i) for i in range(len(params_list))]
    sampler = Sampler()
    tokens: list[list[int]] = [[] for _ in params_list]
    done = [False] * len(params_list)
    rng = torch.Generator().manual_seed(seed)
    for _ in range(MAX_STEPS):
        rows = [i for i, d in enumerate(done) if not d]
        if not rows:
            break
        logits = torch.randn(len(rows), vocab_size, generator=rng) * 4
        meta = build_sampling_metadata(
            [params_list[i] for i in rows], [tokens[i] for i in rows], [[] for _ in rows],
            [gens[i] for i in rows], vocab_size, matchers=[matchers[i] for i in rows],
        )  # fmt: skip
        out = sampler(logits, meta)
        for j, row in enumerate(rows):
            tokens[row].append(int(out.sampled_token_ids[j]))
        for j in out.terminated_rows:
            done[rows[j]] = True
    return tokens, done


def _text(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_choice_and_nested_schema_hold_whatever_the_logits(tokenizer, vocab_size):
    choice = SamplingParams(
        temperature=1.0,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe later"]),
    )
    schema = SamplingParams(
        temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    free = SamplingParams(temperature=1.0)
    tokens, done = _decode_run(tokenizer, vocab_size, [choice, schema, free, choice])
    assert done[0] and done[1] and done[3], "a constrained row never completed its grammar"
    assert not done[2], "an unconstrained row was stopped by the grammar machinery"
    assert _text(tokenizer, tokens[0]) in ("yes", "no", "maybe later")
    assert _text(tokenizer, tokens[3]) in ("yes", "no", "maybe later")
    value = json.loads(_text(tokenizer, tokens[1]))
    assert value["color"] in ("red", "green", "blue")
    assert value["size"]["unit"] in ("cm", "in") and set(value["size"]) == {"unit"}
    assert isinstance(value["ok"], bool) and set(value) == {"color", "size", "ok"}
    # Unconstrained: the random logits pick tokens all over the vocabulary.
    assert len(set(tokens[2])) > MAX_STEPS // 2


def test_regex_constraint(tokenizer, vocab_size):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{2}"))
    tokens, done = _decode_run(tokenizer, vocab_size, [params], seed=3)
    assert done[0]
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", _text(tokenizer, tokens[0]))


def test_grammars_are_cached_by_spec(tokenizer, vocab_size):
    cache = grammar_cache(tokenizer, vocab_size)
    spec = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    )
    same = StructuredOutputsParams(json=json.dumps(spec.json))  # JSON text, same schema
    before = cache.num_compiles
    first = cache.compile(spec)
    assert cache.compile(same) is first
    assert cache.num_compiles == before + 1


@pytest.mark.parametrize(
    "spec",
    [
        {"regex": "(unclosed"},
        {"grammar": "root ::= undefined_rule"},
        {"json": {"type": "no-such-type"}},
    ],
)
def test_a_grammar_that_cannot_compile_is_a_clear_error(tokenizer, vocab_size, spec):
    with pytest.raises(InvalidStructuredOutputsError, match="cannot be compiled"):
        new_matcher(
            SamplingParams(structured_outputs=StructuredOutputsParams(**spec)),
            tokenizer,
            vocab_size,
        )


@pytest.mark.parametrize(
    "kwargs", [{}, {"regex": "a", "grammar": 'root ::= "a"'}, {"json": "{not json"}]
)
def test_spec_needs_exactly_one_valid_constraint(kwargs):
    with pytest.raises(InvalidStructuredOutputsError):
        StructuredOutputsParams(**kwargs)
