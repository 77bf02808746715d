"""One request failing inside the engine fails only that request; an engine fault stops the server.

The engine here is the real tiny-model engine behind a wrapper that plays the engine's contract
for a failed request: `step()` returns it finished, with `error` set and finish_reason "error"
(its blocks freed), and goes on with the others. A fault is an exception out of `step()`.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from pagedattn import LLM
from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedattn.entrypoints.openai.server import EXIT_ENGINE_FAULT, _GracefulServer, build_app
from tests.entrypoints.server_process import InProcessServer, make_model_dir

POISON = "w13"  # a word of the tiny vocabulary; a prompt holding it fails in the engine
MODEL = "tiny"


class PoisonedEngine:
    """Delegates to a real LLMEngine; requests whose prompt holds POISON fail at their 2nd step."""

    def __init__(
        self,
        engine,
        poison_id: int,
        fault_after_steps: int | None = None,
        step_delay_s: float = 0.0,
    ) -> None:
        self._engine = engine
        self._step_delay_s = step_delay_s
        self._poison_id = poison_id
        self._poisoned: dict[str, int] = {}
        self._fault_after_steps = fault_after_steps
        self.num_steps = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request_id, prompt, params=None, **kwargs):
        self._engine.add_request(request_id, prompt, params, **kwargs)
        if self._poison_id in self._engine.tokenize(prompt):
            self._poisoned[request_id] = 0

    def abort_request(self, request_ids):
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self._poisoned.pop(rid, None)
        self._engine.abort_request(ids)

    def step(self):
        self.num_steps += 1
        time.sleep(self._step_delay_s)  # NOTE: a slow engine keeps requests in flight for a test
        if self._fault_after_steps is not None and self.num_steps > self._fault_after_steps:
            raise RuntimeError("injected engine fault")
        outputs = [o for o in self._engine.step() if o.request_id not in self._poisoned]
        for rid in list(self._poisoned):
            self._poisoned[rid] += 1
            if self._poisoned[rid] >= 2:
                del self._poisoned[rid]
                self._engine.abort_request(rid)
                outputs.append(_failed_output(rid))
        return outputs


def _failed_output(request_id: str) -> RequestOutput:
    comp = CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")
    out = RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[1],
        outputs=[comp],
        finished=True,
        metrics=RequestMetrics(arrival_time=time.monotonic()),
    )
    out.error = "injected failure: poisoned token in the batch"
    return out


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("tiny"))
    return LLM(str(path), dtype="float32", num_blocks=128, block_size=16, max_model_len=256)


def _serve(llm, **engine_kwargs) -> tuple[InProcessServer, PoisonedEngine]:
    poison_id = llm.engine.tokenize(POISON)[-1]
    fake = PoisonedEngine(llm.engine, poison_id, **engine_kwargs)
    app = build_app(AsyncLLMEngine(fake), served_model_name=MODEL)
    return InProcessServer(app, server_cls=_GracefulServer), fake


def _body(prompt: str, stream: bool = False, max_tokens: int = 40) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True, "temperature": 0}  # fmt: skip


def _sse(resp: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]


def test_a_failed_request_gets_an_error_and_the_others_finish(llm):
    server, _ = _serve(llm)
    try:
        url = f"{server.base_url}/v1/completions"
        results = {}

        def healthy(i: int) -> None:
            results[i] = httpx.post(url, json=_body(f"hello w{i}"), timeout=60)

        threads = [threading.Thread(target=healthy, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        bad = httpx.post(url, json=_body(f"hello {POISON}"), timeout=60)
        with httpx.stream("POST", url, json=_body(f"x {POISON}", stream=True), timeout=60) as r:
            assert r.status_code == 200
            events = _sse(r)
        for t in threads:
            t.join()
        assert bad.status_code == 500
        assert bad.headers["content-type"].startswith("application/json")
        error = bad.json()["error"]
        assert error["type"] == "server_error" and "poisoned" in error["message"]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "server_error"
        for resp in results.values():
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 40
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert llm.engine.get_stats().kv_cache_usage == 0, "a failed request leaked blocks"
    finally:
        server.stop()


def test_an_engine_fault_fails_health_and_stops_the_server_non_zero(llm):
    server, fake = _serve(llm, fault_after_steps=3)
    try:
        url = f"{server.base_url}/v1/completions"
        resp = httpx.post(url, json=_body("hello w1", max_tokens=30), timeout=60)
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "engine_unavailable"
        server.thread.join(30)
        assert not server.thread.is_alive(), "the server kept running after an engine fault"
        assert isinstance(server.error, SystemExit)
        assert server.error.code == EXIT_ENGINE_FAULT
    finally:
        server.stop()
    # The wrapped engine is left holding nothing: the fault handler aborted every request.
    assert not llm.engine.has_unfinished_requests()
