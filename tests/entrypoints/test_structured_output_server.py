"""Structured output through the server on the real SmolLM2 (float32): the output always parses.

Needs the engine's model runner to keep one Matcher per constrained request
(`pagedattn.structured_output.new_matcher`) and pass them to `build_sampling_metadata`.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from pagedattn import LLM
from pagedattn.entrypoints.openai.server import build_app
from tests.entrypoints.server_process import InProcessServer

MODEL = "smollm2"
SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"enum": ["cat", "dog", "owl"]},
        "home": {"type": "object", "properties": {"kind": {"enum": ["house", "tree"]},
                 "floors": {"type": "integer", "minimum": 1, "maximum": 9}},
                 "required": ["kind", "floors"], "additionalProperties": False},
    },
    "required": ["animal", "home"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def server():
    llm = LLM(dtype="float32", num_blocks=64, block_size=16, max_model_len=512)
    srv = InProcessServer(build_app(llm.engine, served_model_name=MODEL))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _check(value: dict) -> None:
    assert value["animal"] in ("cat", "dog", "owl")
    assert value["home"]["kind"] in ("house", "tree") and 1 <= value["home"]["floors"] <= 9
    assert set(value) == {"animal", "home"} and set(value["home"]) == {"kind", "floors"}


def test_json_schema_on_chat_and_completions_batched_with_free_text(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format=fmt, max_tokens=60, temperature=0.8, seed=1, n=2,
    )  # fmt: skip
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice
        _check(json.loads(choice.message.content))
    done = client.completions.create(
        model=MODEL, prompt=["A pet:", "Once upon a time"], max_tokens=60,
        extra_body={"guided_json": SCHEMA},
    )  # fmt: skip
    for choice in done.choices:
        _check(json.loads(choice.text))


def test_choice_regex_and_json_object(client):
    resp = client.completions.create(
        model=MODEL, prompt="Is the sky blue?", max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert resp.choices[0].text in ("yes", "no")
    resp = client.completions.create(
        model=MODEL, prompt="A date:", max_tokens=16,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}},
    )  # fmt: skip
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", resp.choices[0].text)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Any JSON object"}],
        response_format={"type": "json_object"}, max_tokens=40,
    )  # fmt: skip
    text = resp.choices[0].message.content
    assert text.lstrip().startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= nothing_defined"}, "guided_grammar"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_a_grammar_that_cannot_compile_is_a_400(server, extra, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}
    resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
