"""Issue 52: no tenant can hold the grammar compiler.

A compile past its deadline is killed (it runs in a child process), a cached grammar never
waits behind another tenant's compile, counted repeats are capped before compiling, and
/health reflects the engine, not one busy compile.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedattn import LLM
from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.entrypoints.openai.server import build_app
from pagedattn.structured_output.compiler import grammar_cache_if_built
from pagedattn.structured_output.limits import MAX_REPEAT
from tests.entrypoints.server_process import InProcessServer

KEY_A, KEY_B = "grammar-key-a", "grammar-key-b"
MODEL = "smollm2"
DEADLINE_S = 4.0
# A 34-character schema whose compile runs for minutes (nested counted repeats, 1,000 in all:
# within the repeat cap, so only the deadline stops it).
SLOW_SCHEMA = {"type": "string", "pattern": "([a-z]{1,40}){1,25}"}


@pytest.fixture(scope="module")
def server():
    # NOTE: SmolLM2's real vocabulary, so that a json_object answer can be generated.
    llm = LLM(dtype="float32", num_blocks=64, block_size=16, max_model_len=512)
    app = build_app(
        AsyncLLMEngine(llm.engine),
        api_key=[KEY_A, KEY_B],
        served_model_name=MODEL,
        health_stall_s=1.0,
        grammar_timeout_s=DEADLINE_S,
    )
    srv = InProcessServer(app)
    srv.serving = app.state.serving
    # NOTE: start the compile process now: its start (importing xgrammar) is not a compile.
    srv.serving.grammars.pool._executor.submit(_start_worker, srv.serving).result(timeout=300)
    yield srv
    srv.stop()


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _start_worker(serving) -> None:
    from pagedattn.structured_output.compiler import grammar_cache

    grammar_cache(serving.grammars.tokenizer, serving.grammars.vocab_size).worker().start()


def _chat(server, key: str, response_format: dict) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "response_format": response_format,
    }
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(
        f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=120
    )


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_a_regex_repeat_over_the_cap_is_refused_at_once_naming_the_field_and_cap(server):
    t0 = time.monotonic()
    r = _chat(server, KEY_A, _schema({"type": "string", "pattern": "[a-z]{1,50000}"}))
    assert time.monotonic() - t0 < 1.0
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "constraint_too_large" and error["param"] == "response_format"
    assert "pattern" in error["message"] and "{1,50000}" in error["message"]
    assert str(MAX_REPEAT) in error["message"]


def test_a_compile_past_its_deadline_is_killed_and_holds_no_one(server):
    cached = {"type": "json_object"}
    assert _chat(server, KEY_B, cached).status_code == 200  # compiled once, now cached
    cache = grammar_cache_if_built(
        server.serving.grammars.tokenizer, server.serving.engine.vocab_size
    )
    worker = cache.worker()
    num_killed = worker.num_killed
    slow: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: slow.update(r=_chat(server, KEY_A, _schema(SLOW_SCHEMA)))
    )
    t0 = time.monotonic()
    thread.start()
    time.sleep(1.3)  # past --health-stall-s (1 s) while the compile runs
    # While it compiles: /health is 200, and a cached grammar of another tenant is served at once.
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200, health.text
    t1 = time.monotonic()
    assert _chat(server, KEY_B, cached).status_code == 200
    assert time.monotonic() - t1 < DEADLINE_S / 2
    assert thread.is_alive()
    thread.join(60)
    r = slow["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "constraint_timeout", r.text
    assert time.monotonic() - t0 < DEADLINE_S + 3
    assert worker.num_killed == num_killed + 1
    assert _children(worker._proc.pid) == []  # the compile was stopped, not left running
    # Right after: another tenant's new constraint compiles at once on a fresh child.
    t2 = time.monotonic()
    fresh = _chat(
        server, KEY_B, _schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    )
    assert fresh.status_code == 200, fresh.text
    assert time.monotonic() - t2 < 5.0
