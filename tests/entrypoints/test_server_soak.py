"""A bounded soak: valid, invalid, disconnecting and poisoned clients at once, on loopback.

Afterwards every valid request completed in full, `/health` is 200 and every KV block is free.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from pagedattn import LLM
from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.entrypoints.openai.server import _GracefulServer, build_app
from tests.entrypoints.server_process import InProcessServer, make_model_dir
from tests.entrypoints.test_failure_isolation import MODEL, POISON, PoisonedEngine

SOAK_SECONDS = 20.0
NUM_CLIENTS = 8
INVALID_BODIES = [
    {"model": MODEL, "prompt": [True, 2]},
    {"model": MODEL, "prompt": "hi", "seed": 2**64 - 1, "n": 2, "temperature": 1},
    {"model": MODEL, "prompt": "hi", "max_tokens": 10_000},
    {"model": "other", "prompt": "hi"},
    {"model": MODEL, "prompt": ["hello", ""], "max_tokens": 50},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("tiny"))
    return LLM(str(path), dtype="float32", num_blocks=96, block_size=16, max_model_len=256)


async def _valid(client: httpx.AsyncClient, rng: random.Random, tally: dict) -> None:
    max_tokens = rng.randint(2, 24)
    body = {"model": MODEL, "prompt": f"hello w{rng.randint(0, 9)} w{rng.randint(20, 40)}",
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": rng.choice([0, 1.0]),
            "n": rng.choice([1, 1, 2])}  # fmt: skip
    if rng.random() < 0.5:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == max_tokens * body["n"]
    else:
        body.update(stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            events = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == max_tokens * body["n"], events[-3:]
    tally["valid"] += 1


async def _invalid(client: httpx.AsyncClient, rng: random.Random, tally: dict) -> None:
    resp = await client.post("/v1/completions", json=rng.choice(INVALID_BODIES))
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["message"]
    tally["invalid"] += 1


async def _disconnect(client: httpx.AsyncClient, rng: random.Random, tally: dict) -> None:
    body = {"model": MODEL, "prompt": "hello w3", "max_tokens": 200, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        num = 0
        async for line in resp.aiter_lines():
            num += line.startswith("data: ")
            if num >= rng.randint(1, 3):
                break
    tally["disconnect"] += 1


async def _poisoned(client: httpx.AsyncClient, rng: random.Random, tally: dict) -> None:
    body = {"model": MODEL, "prompt": f"hello {POISON}", "max_tokens": 30, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    tally["poisoned"] += 1


async def _client(base_url: str, seed: int, deadline: float, tally: dict) -> None:
    rng = random.Random(seed)
    kinds = [_valid] * 5 + [_invalid] * 2 + [_disconnect] + ([_poisoned] if seed == 0 else [])
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        while time.monotonic() < deadline:
            await rng.choice(kinds)(client, rng, tally)


def test_soak_mixed_clients_leave_a_healthy_server_and_a_free_pool(llm):
    poison_id = llm.engine.tokenize(POISON)[-1]
    pool_free = llm.engine.get_stats().num_free_blocks
    app = build_app(AsyncLLMEngine(PoisonedEngine(llm.engine, poison_id)), served_model_name=MODEL)
    server = InProcessServer(app, server_cls=_GracefulServer)
    tally = {"valid": 0, "invalid": 0, "disconnect": 0, "poisoned": 0}
    try:
        deadline = time.monotonic() + SOAK_SECONDS

        async def main() -> None:
            await asyncio.gather(
                *(_client(server.base_url, i, deadline, tally) for i in range(NUM_CLIENTS))
            )

        asyncio.run(main())
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        t0 = time.monotonic()
        while llm.engine.has_unfinished_requests() and time.monotonic() - t0 < 10:
            time.sleep(0.05)  # disconnected streams are aborted between steps
        stats = llm.engine.get_stats()
        assert not llm.engine.has_unfinished_requests()
        assert stats.num_free_blocks == pool_free, f"blocks leaked: {stats}"
    finally:
        server.stop()
    assert min(tally.values()) >= 1, tally
