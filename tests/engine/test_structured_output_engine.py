"""Structured output through the engine: grammar-constrained rows batched with free ones."""

from __future__ import annotations

import json

import pytest

from pagedattn import LLM, SamplingParams
from pagedattn.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "size": {"type": "string", "enum": ["small", "medium", "large"]},
        "stats": {
            "type": "object",
            "properties": {"rank": {"type": "integer"}},
            "required": ["rank"],
        },
    },
    "required": ["city", "size", "stats"],
}


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_blocks=128)


def test_constrained_and_free_requests_in_one_batch(llm):
    chat = llm.chat
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    constrained = SamplingParams(
        temperature=0,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    choice = SamplingParams(
        temperature=0.8,
        seed=3,
        n=2,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=("yes", "no")),
    )
    free = SamplingParams(temperature=0, max_tokens=12)
    outs = chat([messages, messages, messages], [constrained, choice, free])
    data = json.loads(outs[0].outputs[0].text)
    assert set(data) == {"city", "size", "stats"} and data["size"] in ("small", "medium", "large")
    assert isinstance(data["stats"]["rank"], int)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[1].outputs) == 2
    assert all(c.text in ("yes", "no") for c in outs[1].outputs)
    # Every sibling's text is its own tokens' text (a fork's first token is not doubled).
    for out in outs:
        for c in out.outputs:
            assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert outs[2].outputs[0].text and outs[2].error is None
    assert llm.get_stats().kv_cache_usage == 0.0
