"""/v1/responses with the official `openai` client on the real SmolLM2: plain, streamed, with a
function tool and its result, previous_response_id (and its 404), and the store's bounds."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedattn import LLM
from pagedattn.entrypoints.openai.protocol_base import APIError
from pagedattn.entrypoints.openai.responses_api import ResponseStore
from pagedattn.entrypoints.openai.server import build_app
from tests.entrypoints.server_process import InProcessServer

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


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


def test_plain_response_and_a_continued_one(client):
    first = client.responses.create(
        model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.output[0].type == "message" and first.output_text
    assert first.status in ("completed", "incomplete")
    assert first.usage.output_tokens <= 12 and first.usage.input_tokens > 0
    second = client.responses.create(
        model=MODEL, input="And again.", previous_response_id=first.id, max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    # the first turn (its input and output) is in the second one's prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id


def test_streamed_response_events(client):
    stream = client.responses.create(
        model=MODEL, input="Count: one, two,", max_output_tokens=8, temperature=0, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds[1:4] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta"
    ]  # fmt: skip
    assert "response.output_item.done" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_tool_call_and_its_output(client):
    called = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice="required", max_output_tokens=60, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    answered = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[WEATHER], max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        temperature=0,
    )  # fmt: skip
    assert answered.output[0].type == "message"

    stream = client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"}, stream=True, temperature=0,
    )  # fmt: skip
    events = list(stream)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert set(json.loads(args)) == {"city"}
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[0].item.type == "function_call" and done[0].item.arguments == args


def test_missing_previous_response_is_a_404_and_bad_tools_a_400(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_gone")
    assert err.value.body["code"] == "previous_response_not_found"
    assert err.value.body["param"] == "previous_response_id"
    body = {"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.type"
    body = {"model": MODEL, "input": "x", "max_output_tokens": 2, "frob": 1}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "frob"


def test_store_is_bounded_and_per_tenant():
    store = ResponseStore(max_entries=2, max_chars=10_000)
    msg = [{"role": "user", "content": "x"}]
    for i in range(3):
        store.put("tenant-a", f"r{i}", msg)
    assert len(store) == 2
    with pytest.raises(APIError) as err:
        store.get("tenant-a", "r0")  # evicted
    assert err.value.status_code == 404
    assert store.get("tenant-a", "r2") == msg
    with pytest.raises(APIError):
        store.get("tenant-b", "r2")  # another key's response
    small = ResponseStore(max_entries=100, max_chars=50)
    small.put(None, "big", [{"role": "user", "content": "y" * 100}])
    assert len(small) == 0
