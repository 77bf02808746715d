"""Issue 52: request bodies as a newcomer sends them (the README's curl without a content-type,
malformed JSON, a UTF-16 file), and answers a client can read (JSON, no internal paths)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from pagedattn.entrypoints.openai.http import TenantAuth, make_app


class Body(BaseModel):
    name: str


@pytest.fixture(scope="module")
def client():
    app = make_app("bodies", TenantAuth(None), max_request_bytes=1 << 16)

    @app.post("/echo")
    async def echo(body: Body) -> dict:
        return {"name": body.name}

    with TestClient(app) as c:
        yield c


def _error(response) -> dict:
    assert response.headers["content-type"].startswith("application/json"), response.text
    return response.json()["error"]


def test_json_without_a_content_type_is_read_as_json(client):
    data = json.dumps({"name": "a"}).encode()
    response = client.post("/echo", content=data, headers={"content-type": ""})
    assert response.status_code == 200 and response.json() == {"name": "a"}


def test_curl_d_without_a_header_is_read_as_json(client):
    # NOTE: `curl -d '{...}'` sends application/x-www-form-urlencoded unless -H says otherwise.
    headers = {"content-type": "application/x-www-form-urlencoded"}
    response = client.post("/echo", content=b'{"name": "b"}', headers=headers)
    assert response.status_code == 200 and response.json() == {"name": "b"}


def test_malformed_json_says_the_body_is_not_valid_json(client):
    headers = {"content-type": "application/json"}
    response = client.post("/echo", content=b'{"name": "a",}', headers=headers)
    assert response.status_code == 400
    message = _error(response)["message"]
    assert message.startswith("the request body is not valid JSON"), message
    assert "valid dictionary" not in message


def test_a_json_array_body_says_it_is_not_an_object(client):
    response = client.post("/echo", json=["name"])
    assert response.status_code == 400
    assert "not a JSON object" in _error(response)["message"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_a_utf16_body_is_refused(client, encoding):
    data = json.dumps({"name": "a"}).encode(encoding)
    response = client.post("/echo", content=data, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["code"] == "invalid_encoding" and "UTF-8" in error["message"]


def test_grammar_errors_carry_no_xgrammar_source_path(tmp_path):
    from transformers import AutoTokenizer

    from pagedattn.structured_output.compiler import GrammarCache
    from pagedattn.structured_output.params import InvalidStructuredOutputsError
    from pagedattn.structured_output.params import StructuredOutputsParams as Params
    from tests.model.tiny import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    cache = GrammarCache(tokenizer, len(tokenizer))
    try:
        for params in (Params(regex="["), Params(grammar="root ::= missing")):
            with pytest.raises(InvalidStructuredOutputsError) as info:
                cache.compile(params)
            message = str(info.value)
            assert "/cpp/" not in message and ".cc:" not in message, message
            assert "cannot be compiled" in message
    finally:
        cache.close()
