"""Tool calling on /v1/chat/completions with the official `openai` client, on the real SmolLM2.

SmolLM2's chat template has no tool support, so the tools reach it through the generic tool
prompt and its replies are read with the Hermes parser; `required` and named choices are
constrained, so their arguments always parse and match the schema.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedattn import LLM
from pagedattn.entrypoints.openai.server import build_app
from tests.entrypoints.server_process import InProcessServer

jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def server():
    llm = LLM(dtype="float32", num_blocks=96, block_size=16, max_model_len=1024)
    app = build_app(llm.engine, served_model_name=MODEL, enable_auto_tool_choice=True)
    srv = InProcessServer(app)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_and_named_calls_parse_and_match_the_schema(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments)

    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=40,
        temperature=0,
    )  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_call("get_time", call.function.arguments)


def test_streamed_tool_call_deltas_have_openai_shape(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": None, "args": ""})
                if tc.function.name:
                    assert entry["name"] is None and entry["args"] == "", "name comes first"
                    entry["name"] = tc.function.name
                entry["args"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "get_weather"
    _check_call("get_weather", calls[0]["args"])


def test_auto_choice_answers_with_a_parsed_call_or_text(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=60,
        temperature=0,
    )  # fmt: skip
    message = out.choices[0].message
    if message.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        assert message.tool_calls[0].function.name == "get_weather"
        json.loads(message.tool_calls[0].function.arguments)
    else:
        assert isinstance(message.content, str) and "<tool_call>" not in message.content


def test_a_tool_result_turn_answers_in_text(client):
    arguments = '{"city": "Paris", "unit": "celsius"}'
    result = '{"temperature": 21, "sky": "clear"}'
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]  # fmt: skip
    out = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=30,
        temperature=0,
    )  # fmt: skip
    assert out.choices[0].message.tool_calls in (None, [])
    assert out.choices[0].message.content
    assert out.usage.prompt_tokens > 40  # the call and its result are in the prompt


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
BAD_PROPERTY = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 3}}}},
}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [BAD_TOOL]}, "tools.0.function.parameters"),
        ({"tools": [BAD_PROPERTY]}, "tools.0.function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER] * 2}, "tools"),
        ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "name": f"f{i}"}}
                    for i in range(65)]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"lora_request": {"lora_name": "a", "lora_path": "/tmp"}}, "lora_request"),
    ],
)  # fmt: skip
def test_bad_tool_and_unsupported_fields_are_400s_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_unknown_fields_are_accepted_and_named_in_a_header(server):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "frobnicate": 1, "zork": {}}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-ignored-fields"] == "frobnicate,zork"
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={**body, "frobnicate": None}, timeout=60
    )
    assert "x-ignored-fields" in r.headers
    plain = {"model": MODEL, "messages": ASK, "max_tokens": 2}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=plain, timeout=60)
    assert "x-ignored-fields" not in r.headers
