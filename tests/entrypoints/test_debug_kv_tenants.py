"""/debug/kv with API keys: each tenant sees its own requests; others only as aggregate counts."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedattn import LLM
from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.entrypoints.openai.server import build_app
from tests.entrypoints.server_process import InProcessServer, make_model_dir
from tests.entrypoints.test_failure_isolation import MODEL, POISON, PoisonedEngine

KEY_A, KEY_B = "kv-key-a", "kv-key-b"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("tiny"))
    llm = LLM(str(path), dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
    # NOTE: 20 ms per step keeps a 100-token request in flight for 2 s.
    slow = PoisonedEngine(llm.engine, llm.engine.tokenize(POISON)[-1], step_delay_s=0.02)
    srv = InProcessServer(
        build_app(AsyncLLMEngine(slow), api_key=[KEY_A, KEY_B], served_model_name=MODEL)
    )
    yield srv
    srv.stop()


def _get_kv(server, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.base_url}/debug/kv", headers=headers, timeout=30)


def test_debug_kv_shows_only_the_callers_requests(server):
    body = {"model": MODEL, "prompt": "hello w1 w2 w3", "max_tokens": 100, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY_A}"}
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as resp:
        # NOTE: keep the line iterator: a dropped one closes the connection (a disconnect).
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[len("data: ") :])["id"]
        theirs = _get_kv(server, KEY_B).json()
        mine = _get_kv(server, KEY_A).json()
    assert request_id in mine["block_tables"] and request_id in mine["requests"]
    assert any(request_id in owners for owners in mine["owners"])
    assert mine["other_tenants"] == {"num_requests": 0, "num_blocks": 0}
    assert theirs["block_tables"] == {} and theirs["requests"] == {}
    assert not any(owners for owners in theirs["owners"])
    assert request_id not in json.dumps(theirs)
    assert theirs["other_tenants"]["num_requests"] == 1
    assert theirs["other_tenants"]["num_blocks"] == len(mine["block_tables"][request_id][0])
    assert theirs["stats"]["num_used_blocks"] >= 1  # aggregate counts stay visible
    assert _get_kv(server, None).status_code == 401
