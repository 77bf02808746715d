"""Shutdown past `--shutdown-timeout`: clients in flight get an error they can parse, not a cut."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.server_process import ServerProcess, make_model_dir, read_metrics

MODEL = "tiny"


@pytest.fixture
def server(tmp_path):
    # NOTE: a larger tiny model and long outputs, so that the requests are still running at the
    # 0.3 s deadline however fast decode steps get (with the compiled decode stack, the 2-layer
    # tiny model finished 8 x 240 tokens before it).
    model_dir = make_model_dir(tmp_path / "tiny", max_position_embeddings=4096, hidden_size=256,
                               intermediate_size=512, num_hidden_layers=4, head_dim=64)  # fmt: skip
    args = ["--max-model-len", "2048", "--num-blocks", "2400", "--served-model-name", MODEL,
            "--shutdown-timeout", "0.3", "--log-level", "info"]  # fmt: skip
    proc = ServerProcess(model_dir, tmp_path / "server.log", *args)
    yield proc
    proc.stop()


def _body(stream: bool) -> dict:
    return {"model": MODEL, "prompt": "hello w1 w2", "max_tokens": 2000, "n": 8,
            "ignore_eos": True, "temperature": 1.0, "stream": stream}  # fmt: skip


def test_requests_in_flight_at_the_deadline_get_errors(server):
    url = f"{server.base_url}/v1/completions"
    whole: dict = {}

    def non_streaming() -> None:
        whole["resp"] = httpx.post(url, json=_body(False), timeout=60)

    thread = threading.Thread(target=non_streaming)
    thread.start()
    deadline = time.monotonic() + 10
    while read_metrics(server.base_url)["pagedattn_num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the non-streaming request never started"
        time.sleep(0.02)
    events = []
    with httpx.stream("POST", url, json=_body(True), timeout=60) as resp:
        lines = resp.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        events += [line for line in lines if line.startswith("data: ")]
    thread.join(30)
    assert time.monotonic() - t0 < 10
    assert server.proc.wait(30) == 0
    # The stream: an error event, then [DONE].
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"]
    # The non-streaming client: a JSON 503, not a text/plain 500.
    resp = whole["resp"]
    assert resp.status_code == 503, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["error"]["code"] == "engine_unavailable"
    log = server.log_file.read_text()
    assert "Traceback" not in log and "Task exception" not in log, log[-3000:]
