"""The server under concurrent streaming load, and its graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess, make_model_dir, read_metrics, wait_idle

NUM_CLIENTS = 64
LOAD_SECONDS = 8.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc = ServerProcess(model_dir, log, "--max-model-len", "128", "--num-blocks", "512")
    yield proc
    proc.stop()


async def _client_loop(client, model: str, rng: random.Random, deadline: float) -> list[int]:
    """Stream requests back to back until the deadline; the token count of each."""
    counts = []
    while time.monotonic() < deadline:
        max_tokens = rng.randint(4, 24)
        prompt = " ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(3, 30)))
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert finish == "length"
        assert usage.completion_tokens == max_tokens
        counts.append(usage.completion_tokens)
    return counts


def _watch_running(base_url: str, stop: threading.Event, peaks: list[float]) -> None:
    while not stop.is_set():
        peaks.append(read_metrics(base_url)["pagedattn_num_requests_running"])
        time.sleep(0.2)


def test_concurrent_streams_all_finish_without_leaks(server):
    async def main() -> list[list[int]]:
        # NOTE: idle pooled connections expire after 1 s, before uvicorn's 5 s keep-alive
        # timeout: reusing one the server is closing at that moment fails with a ReadError.
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, keepalive_expiry=1.0)
        http = httpx.AsyncClient(limits=limits, timeout=120)
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, http_client=http
        )
        model = (await client.models.list()).data[0].id
        deadline = time.monotonic() + LOAD_SECONDS
        rngs = [random.Random(i) for i in range(NUM_CLIENTS)]
        try:
            return await asyncio.gather(*(_client_loop(client, model, r, deadline) for r in rngs))
        finally:
            await http.aclose()

    stop, peaks = threading.Event(), []
    watcher = threading.Thread(target=_watch_running, args=(server.base_url, stop, peaks))
    watcher.start()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        watcher.join()
    assert all(len(r) >= 1 for r in results), "a client finished no request"
    # Continuous batching: requests share the running batch rather than run one at a time.
    assert max(peaks) >= 4, peaks
    m = wait_idle(server.base_url)
    assert m["pagedattn_kv_cache_usage_perc"] == 0
    assert m["pagedattn_kv_cache_free_blocks"] == m["pagedattn_kv_cache_total_blocks"]
    assert m["pagedattn_num_requests_waiting"] == 0
    assert m["pagedattn_generation_tokens_total"] >= sum(map(sum, results))
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_sigterm_finishes_in_flight_request_and_exits_0(server):
    # NOTE: last in this file: it stops the module's server (the fixture's stop() then no-ops).
    proc = server
    client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="none", max_retries=0)
    try:
        model = client.models.list().data[0].id
        stream = client.completions.create(
            model=model, prompt="hello", max_tokens=60, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [next(iter(stream))]
        proc.proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.proc.wait(timeout=30) == 0, proc.log_tail()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{proc.base_url}/health", timeout=2)
    finally:
        proc.stop()
