"""/tokenize and /detokenize in vLLM's shapes, behind the same key check as every route."""

from __future__ import annotations

import httpx
import pytest

from pagedattn import LLM
from pagedattn.entrypoints.openai.server import build_app
from tests.entrypoints.server_process import InProcessServer

MODEL = "smollm2"
KEY = "sk-tok"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    llm = LLM(dtype="float32", num_blocks=32, block_size=16, max_model_len=256)
    srv = InProcessServer(build_app(llm.engine, api_key=[KEY], served_model_name=MODEL))
    srv.tokenizer = llm.tokenizer
    yield srv
    srv.stop()


def _post(server, path, body, headers=AUTH):
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)


def test_tokenize_a_prompt_and_back(server):
    r = _post(
        server, "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == server.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"] == server.tokenizer.convert_ids_to_tokens(body["tokens"])
    r = _post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}


def test_tokenize_messages_renders_the_chat_template(server):
    messages = [{"role": "user", "content": "hi"}]
    r = _post(server, "/tokenize", {"messages": messages})
    text = server.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert r.json()["tokens"] == server.tokenizer.encode(text, add_special_tokens=False)
    assert r.json()["token_strs"] is None
    r = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert r.json()["count"] < len(server.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400,
         "prompt"),
        ("/tokenize", {"prompt": "word " * 400}, 400, "prompt"),  # past max_model_len
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": []}, 400, "tokens"),
    ],
)  # fmt: skip
def test_bad_requests_are_openai_errors(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_the_key_is_checked_before_the_body(server):
    for path in ("/tokenize", "/detokenize", "/v1/responses"):
        r = httpx.post(f"{server.base_url}{path}", content=b"not json", timeout=10)
        assert r.status_code == 401, (path, r.text)
