"""With --reasoning-parser, an output constraint applies after the think block (xgrammar)."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedattn import LLM
from pagedattn.entrypoints.openai.reasoning_grammar import after_reasoning
from pagedattn.entrypoints.openai.server import build_app
from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)
from tests.entrypoints.server_process import InProcessServer

xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"animal": {"enum": ["cat", "dog"]}},
    "required": ["animal"],
    "additionalProperties": False,
}


def _matcher(params: StructuredOutputsParams):
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    info = xgr.TokenizerInfo(chars)
    compiled = xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_ebnf(params.grammar))
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)


def _accepts(params: StructuredOutputsParams, text: str) -> bool:
    """Whether `text` is a whole output the constraint allows."""
    m = _matcher(params)
    return m.accept_string(text) and m.is_terminated()


@pytest.mark.parametrize(
    ("parser", "text", "ok"),
    [
        ("deepseek_r1", '<think>a < b, so: cat</think>\n{"animal": "cat"}', True),
        ("deepseek_r1", 'opened by the template</think>{"animal": "dog"}', True),
        ("deepseek_r1", '{"animal": "dog"}', False),  # R1 must close its block first
        ("deepseek_r1", '<think>x</think>{"animal": "owl"}', False),  # the schema still holds
        ("qwen3", '<think>\nhm\n</think>\n\n{"animal": "dog"}', True),
        ("qwen3", '{"animal": "cat"}', True),  # thinking off: no block
        ("qwen3", "<think>x</think>not json", False),
    ],
)
def test_the_constraint_follows_the_think_block(parser, text, ok):
    params = after_reasoning(StructuredOutputsParams(json=SCHEMA), parser)
    assert _accepts(params, text) is ok


def test_choice_regex_and_recursive_schemas():
    choice = after_reasoning(StructuredOutputsParams(choice=("yes", "no")), "qwen3")
    assert _accepts(choice, "<think>hmm</think>no") and not _accepts(choice, "maybe")
    recursive = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    with pytest.raises(InvalidStructuredOutputsError, match="recursive"):
        after_reasoning(StructuredOutputsParams(json=recursive), "qwen3")


@pytest.fixture(scope="module")
def server():
    llm = LLM(dtype="float32", num_blocks=64, block_size=16, max_model_len=512)
    app = build_app(llm.engine, served_model_name="m", reasoning_parser="qwen3")
    srv = InProcessServer(app)
    yield srv
    srv.stop()


def test_json_schema_with_a_reasoning_parser_parses_and_effort_is_honoured(server):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Pick an animal, answer in JSON."}],
        "max_tokens": 40,
        "temperature": 0,
        "reasoning_effort": "none",
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    }
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"])["animal"] in ("cat", "dog")
    bad = {**body, "reasoning_effort": "extreme"}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
