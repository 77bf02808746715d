"""A request whose token makes the model raise fails alone, through the real engine and server.

The model's forward raises whenever a poison token id is in the batch; the engine retries the
step one request at a time, so only the poisoned request fails (a JSON 500 / an error event)
while the others finish and every block returns to the pool.
"""

from __future__ import annotations

import json
import threading

import httpx

from pagedattn import LLM
from pagedattn.entrypoints.openai.server import build_app
from tests.entrypoints.server_process import InProcessServer, make_model_dir

MODEL = "tiny"
POISON = "w13"


def test_poisoned_token_fails_only_its_request(tmp_path):
    path = make_model_dir(tmp_path / "tiny")
    llm = LLM(str(path), dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
    engine = llm.engine
    poison_id = engine.tokenizer.encode(POISON, add_special_tokens=False)[-1]
    model = engine.runner.model
    forward = model.forward

    def poisoned_forward(input_ids, *args, **kwargs):
        if bool((input_ids == poison_id).any()):
            raise RuntimeError("poisoned token in the batch")
        return forward(input_ids, *args, **kwargs)

    model.forward = poisoned_forward
    server = InProcessServer(build_app(engine, served_model_name=MODEL))
    url = f"{server.base_url}/v1/completions"
    try:
        results = {}

        def healthy(i: int) -> None:
            body = {"model": MODEL, "prompt": f"hello w{i}", "max_tokens": 30,
                    "ignore_eos": True, "temperature": 0}  # fmt: skip
            results[i] = httpx.post(url, json=body, timeout=60)

        threads = [threading.Thread(target=healthy, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        bad = {"model": MODEL, "prompt": f"hello {POISON}", "max_tokens": 30}
        resp = httpx.post(url, json=bad, timeout=60)
        with httpx.stream("POST", url, json={**bad, "stream": True}, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        for t in threads:
            t.join()
        assert resp.status_code == 500, resp.text
        assert resp.json()["error"]["type"] == "server_error"
        assert "poisoned" in resp.json()["error"]["message"]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "server_error"
        for r in results.values():
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 30
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    finally:
        server.stop()
    stats = engine.get_stats()
    assert stats.kv_cache_usage == 0 and not engine.has_unfinished_requests()
