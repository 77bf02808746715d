"""A bounded soak: valid, invalid, disconnecting and poisoned clients at once, on loopback.

Afterwards every valid request completed in full, `/health` is 200 and every KV block is free.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from pagedattn import LLM
from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.entrypoints.openai.server import _GracefulServer, build_app
from tests.entrypoints.server_process import (
    InProcessServer,
    ServerProcess,
    make_model_dir,
    wait_idle,
)
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


# ---- 64 clients over the single server's front door, in its own process ----------------------
# Backpressure the docs name: 503 `server_busy` (a busy worker pool) and 429. Any other 5xx fails.
NUM_CLIENTS_FRONT_DOOR = 64
BACKPRESSURE = {503: "server_busy", 429: None}


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _pool(base_url: str) -> dict:
    return httpx.get(f"{base_url}/debug/kv", timeout=30.0).json()["stats"]


def _count(resp: httpx.Response, tally: Counter) -> bool:
    """Count the answer's status; a 5xx that is not documented backpressure is counted apart."""
    tally[resp.status_code] += 1
    if resp.status_code < 500 and resp.status_code != 429:
        return True
    code = resp.json().get("error", {}).get("code")
    if BACKPRESSURE.get(resp.status_code, "") not in (None, code):
        tally["5xx_other"] += 1
    return False


async def _front_door_client(base_url: str, seed: int, deadline: float, tally: Counter) -> None:
    """Valid (plain and streamed), invalid and disconnecting requests, statuses counted."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        while time.monotonic() < deadline:
            kind = rng.choice(["plain"] * 3 + ["stream"] * 2 + ["invalid"] * 2 + ["disconnect"])
            tally["requests"] += 1
            if kind == "invalid":
                resp = await client.post("/v1/completions", json=rng.choice(INVALID_BODIES))
                if _count(resp, tally):
                    assert resp.status_code in (400, 404), resp.text
                continue
            max_tokens = rng.randint(2, 24) if kind != "disconnect" else 200
            body = {"model": MODEL, "prompt": f"hello w{rng.randint(0, 9)} w{rng.randint(20, 40)}",
                    "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip
            if kind == "plain":
                resp = await client.post("/v1/completions", json=body)
                if _count(resp, tally):
                    assert resp.json()["usage"]["completion_tokens"] == max_tokens, resp.text
                continue
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    await r.aread()
                    _count(r, tally)
                    continue
                tally[200] += 1
                stop_after = rng.randint(1, 3) if kind == "disconnect" else None
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                    if stop_after is not None and len(events) >= stop_after:
                        tally["disconnected"] += 1
                        break
                else:
                    assert events[-1] == "data: [DONE]", events[-3:]


def _front_door_soak(tmp_path: Path, seconds: float) -> dict:
    """Soak a `pagedattn` server process with 64 clients; return what was measured."""
    server = ServerProcess(
        make_model_dir(tmp_path), tmp_path / "server.log", "--served-model-name", MODEL,
        "--num-blocks", "96", "--block-size", "16", "--max-model-len", "256",
        "--kv-cache-prefault",
    )  # fmt: skip
    try:
        warm = Counter()
        asyncio.run(_clients(server.base_url, 8, 3.0, warm))  # import every path once
        wait_idle(server.base_url, timeout=30.0)
        pool0, rss0 = _pool(server.base_url), _rss_bytes(server.proc.pid)
        tally = Counter()
        asyncio.run(_clients(server.base_url, NUM_CLIENTS_FRONT_DOOR, seconds, tally))
        assert httpx.get(f"{server.base_url}/health", timeout=30.0).status_code == 200
        metrics = wait_idle(server.base_url, timeout=30.0)
        time.sleep(1.0)
        pool1, rss1 = _pool(server.base_url), _rss_bytes(server.proc.pid)
    finally:
        server.stop()
    return {"tally": tally, "pool0": pool0, "pool1": pool1, "rss0": rss0, "rss1": rss1,
            "failed": metrics["pagedattn_failed_requests_total"]}  # fmt: skip


async def _clients(base_url: str, num: int, seconds: float, tally: Counter) -> None:
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(_front_door_client(base_url, i, deadline, tally) for i in range(num)))


def _check_front_door(result: dict) -> None:
    tally, pool0, pool1 = result["tally"], result["pool0"], result["pool1"]
    print(f"soak: {dict(tally)}; free blocks {pool0['num_free_blocks']} -> "
          f"{pool1['num_free_blocks']}; RSS {result['rss0'] / 2**20:.1f} -> "
          f"{result['rss1'] / 2**20:.1f} MiB")  # fmt: skip
    assert tally["5xx_other"] == 0, tally
    assert tally[200] >= 16 and tally["disconnected"] > 0, tally  # few per client on 2 busy cores
    assert pool1["num_free_blocks"] == pool0["num_free_blocks"], (pool0, pool1)
    assert pool1["num_used_blocks"] == 0 and pool1["num_requests"] == 0, pool1
    assert abs(result["rss1"] - result["rss0"]) <= 0.05 * result["rss0"], result
    assert result["failed"] == 0, result


def test_soak_64_clients_front_door_no_5xx_no_leaked_blocks_rss_back(tmp_path):
    _check_front_door(_front_door_soak(tmp_path, seconds=10.0))


@pytest.mark.slow
def test_soak_64_clients_front_door_long(tmp_path):
    _check_front_door(_front_door_soak(tmp_path, seconds=180.0))
