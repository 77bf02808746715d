"""Defects found by an adversarial test of `pagedattn serve` (issue #15), each fixed and kept fixed.

One subprocess server with API keys, a 64 KiB body limit and the tiny model.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from pagedattn.entrypoints.openai.preprocess import PromptPreprocessor
from pagedattn.entrypoints.openai.server import redact_query_secrets
from tests.entrypoints.server_process import ServerProcess, make_model_dir, read_metrics, wait_idle

KEY_A, KEY_B = "hard-key-a", "hard-key-b"
MAX_REQUEST_BYTES = 64 * 1024
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--max-model-len", "256", "--num-blocks", "128", "--block-size", "16",
            "--api-key", KEY_A, KEY_B, "--served-model-name", MODEL,
            "--max-request-bytes", str(MAX_REQUEST_BYTES), "--log-level", "info"]  # fmt: skip
    proc = ServerProcess(model_dir, log, *args)
    yield proc
    proc.stop()


def _headers(key: str | None = KEY_A) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _post(server, path: str, body=None, key: str | None = KEY_A, raw: bytes | None = None):
    headers = _headers(key)
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{server.base_url}{path}", content=raw, headers=headers, timeout=30)
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)


def _assert_error(resp: httpx.Response, status: int, param: str | None, err_type: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == err_type and error["param"] == param and error["message"]
    return error


# ---- defect 1 (boundary side) and 9: loose validation ---------------------------------------

BAD_COMPLETIONS = {
    "huge seed with n=2": ({"n": 2, "temperature": 1, "seed": 18446744073709551615}, "seed"),
    "negative seed": ({"seed": -1}, "seed"),
    "max_tokens true": ({"max_tokens": True}, "max_tokens"),
    "max_tokens float": ({"max_tokens": 4.0}, "max_tokens"),
    "prompt of bools": ({"prompt": [True, 2]}, "prompt"),
    "prompt negative id": ({"prompt": [5, -1]}, "prompt"),
    "empty prompt list": ({"prompt": []}, "prompt"),
    "temperature string": ({"temperature": "1"}, "temperature"),
    "n true": ({"n": True}, "n"),
    "stream string": ({"stream": "yes"}, "stream"),
    "best_of below n": ({"n": 3, "best_of": 2}, "best_of"),
    "stop not a string": ({"stop": 5}, "stop"),
    "too many stops": ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    "logit_bias out of range": ({"logit_bias": {"5": 101}}, "logit_bias"),
    "logit_bias bad key": ({"logit_bias": {"abc": 1}}, "logit_bias"),
    "logit_bias beyond vocab": ({"logit_bias": {"999999": 1}}, "logit_bias"),
    "top_k bool": ({"top_k": True}, "top_k"),
}


@pytest.mark.parametrize("case", sorted(BAD_COMPLETIONS))
def test_loose_values_are_rejected_with_param(server, case):
    extra, param = BAD_COMPLETIONS[case]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **extra}
    _assert_error(_post(server, "/v1/completions", body), 400, param, "invalid_request_error")


@pytest.mark.parametrize("value", [b"Infinity", b"NaN", b"-Infinity"])
def test_non_finite_floats_are_rejected(server, value):
    raw = b'{"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": %s}' % value
    _assert_error(_post(server, "/v1/completions", raw=raw), 400, "temperature",
                  "invalid_request_error")  # fmt: skip


def test_wrong_model_is_404_model_not_found(server):
    for path, body in [
        ("/v1/completions", {"model": "gpt-4", "prompt": "hello"}),
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
        ),
    ]:
        error = _assert_error(_post(server, path, body), 404, "model", "invalid_request_error")
        assert error["code"] == "model_not_found"


def test_docs_need_a_key_when_keys_are_set(server):
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 401, path
        assert httpx.get(f"{server.base_url}{path}", headers=_headers()).status_code == 200, path
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# ---- defect 5: lone surrogates --------------------------------------------------------------


def test_lone_surrogate_is_a_400_not_a_500(server):
    raw = b'{"model": "tiny", "prompt": "\\ud800abc", "max_tokens": 2}'
    _assert_error(_post(server, "/v1/completions", raw=raw), 400, "prompt",
                  "invalid_request_error")  # fmt: skip
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udfff"}]}'
    _assert_error(_post(server, "/v1/chat/completions", raw=raw), 400, "messages.0.content",
                  "invalid_request_error")  # fmt: skip
    raw = b'{"model": "tiny", "prompt": "hello", "stop": ["\\ud800"]}'
    _assert_error(_post(server, "/v1/completions", raw=raw), 400, "stop", "invalid_request_error")


# ---- defect 4: body size, and the key before the body ---------------------------------------


def _raw_request(server, head: bytes, body: bytes = b"", timeout: float = 5.0) -> bytes:
    """Send a request by hand (head, then maybe part of a body); the response, read until the
    server closes the connection or its body is complete."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head + body)
        reply = b""
        while True:
            chunk = sock.recv(65536)
            reply += chunk
            head_end = reply.find(b"\r\n\r\n")
            if not chunk or (head_end >= 0 and _body_complete(reply, head_end)):
                return reply


def _body_complete(reply: bytes, head_end: int) -> bool:
    for line in reply[:head_end].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(reply) - head_end - 4 >= int(value)
    return False


def test_no_key_is_refused_before_the_body_is_read(server):
    # Declares 300 MB and sends none of it: the answer must come without waiting for the body.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 300000000\r\n\r\n")  # fmt: skip
    t0 = time.monotonic()
    reply = _raw_request(server, head)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert b"invalid_api_key" in reply
    assert time.monotonic() - t0 < 3.0


def test_declared_oversized_body_is_413_at_once(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY_A.encode() + b"\r\n"
            b"Content-Length: 300000000\r\n\r\n")  # fmt: skip
    reply = _raw_request(server, head)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large"


def test_streamed_oversized_body_is_413(server):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    headers = {**_headers(), "Content-Type": "application/json"}
    url = f"{server.base_url}/v1/completions"
    resp = httpx.post(url, content=chunks(), headers=headers, timeout=30)
    _assert_error(resp, 413, None, "invalid_request_error")
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# ---- defect 3: the prompt size limit --------------------------------------------------------


def test_prompt_over_the_size_limit_is_rejected_before_tokenising(server):
    prompt = "hello " * 10000  # 60 KB: under the body limit, far more than 256 tokens could hold
    error = _assert_error(
        _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt}),
        400, "prompt", "invalid_request_error",
    )  # fmt: skip
    assert "characters" in error["message"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    _assert_error(_post(server, "/v1/chat/completions", body), 400, "messages",
                  "invalid_request_error")  # fmt: skip


class _RecordingTokenizer:
    """A tokenizer that records which thread encodes, and can be made slow."""

    chat_template = "x"

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __deepcopy__(self, memo) -> _RecordingTokenizer:
        return self  # the pool's copies record into the same list

    def get_vocab(self) -> dict[str, int]:
        return {"ab": 0, "abcd": 1}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        import threading

        self.threads.append(threading.current_thread().name)
        return [1] * (len(text) // 4 + 1)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        return "".join(m["content"] for m in messages)


def test_tokenisation_runs_in_the_worker_pool_and_limits_come_first():
    import asyncio

    from pagedattn.engine.errors import InvalidRequestError

    tok = _RecordingTokenizer()
    pre = PromptPreprocessor(tok, max_model_len=100)
    # NOTE: the pool's tokenizers are copies of `tok`; they share its `threads` list.
    assert pre.max_prompt_chars == 400  # max_model_len x the longest token (4 characters)

    async def main():
        loop_thread = __import__("threading").current_thread().name
        ids = await pre.encode("abcd" * 10)
        chat = await pre.render_chat([{"role": "user", "content": "abcd" * 5}], "m")
        with pytest.raises(InvalidRequestError, match="characters"):
            await pre.encode("a" * 401)
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await pre.encode([3] * 100)
        return loop_thread, ids, chat

    try:
        loop_thread, ids, chat = asyncio.run(main())
    finally:
        pre.close()
    assert len(ids) == 11 and len(chat) == 6
    threads = tok.threads
    assert len(threads) == 2  # the over-long prompt never reached the tokenizer
    assert all(t.startswith("pagedattn-tokenize") and t != loop_thread for t in threads)


# ---- defect 2: a rejected multi-prompt request --------------------------------------------


def test_rejected_multi_prompt_request_runs_none_of_its_prompts(server):
    before = wait_idle(server.base_url, headers=_headers())
    # Prompt 1 fits the context alone but not with max_tokens: the engine rejects it after
    # prompt 0 was accepted, so prompt 0 must be aborted.
    body = {"model": MODEL, "prompt": ["hello", "w1 " * 200], "max_tokens": 100,
            "ignore_eos": True}  # fmt: skip
    _assert_error(_post(server, "/v1/completions", body), 400, "max_tokens",
                  "invalid_request_error")  # fmt: skip
    body = {"model": MODEL, "prompt": ["hello", ""], "max_tokens": 100, "ignore_eos": True}
    _assert_error(_post(server, "/v1/completions", body), 400, "prompt", "invalid_request_error")
    after = wait_idle(server.base_url, headers=_headers())
    assert after["pagedattn_kv_cache_usage_perc"] == 0
    # NOTE: prompt 0 running to its end would add 100 generated tokens per request.
    grown = after["pagedattn_generation_tokens_total"] - before["pagedattn_generation_tokens_total"]
    assert grown < 20, f"a rejected request's other prompt ran on ({grown} tokens)"


# ---- defect 7: secrets in logs, /debug/kv across tenants ----------------------------------


def test_query_secrets_never_reach_the_access_log(server):
    secret = "sk-very-secret-value"
    assert httpx.get(f"{server.base_url}/dashboard?api_key={secret}").status_code == 200
    httpx.get(f"{server.base_url}/v1/models?token={secret}&x=1", headers=_headers())
    deadline = time.monotonic() + 5
    while "/dashboard" not in server.log_file.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log_file.read_text()
    assert "/dashboard" in log, "the access log is off: the test proves nothing"
    assert secret not in log
    assert (
        redact_query_secrets("/x?api_key=s&b=2&token=t")
        == "/x?api_key=[REDACTED]&b=2&token=[REDACTED]"
    )


def test_health_after_all_of_the_above(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    m = read_metrics(server.base_url, _headers())
    assert m["pagedattn_num_requests_running"] == 0


# ---- OpenAI fields ---------------------------------------------------------------------------


def test_echo_user_best_of_and_cached_tokens(server):
    body = {"model": MODEL, "prompt": "hello w1 w2", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "echo": True, "user": "someone", "best_of": 2, "n": 1}  # fmt: skip
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    plain = _post(server, "/v1/completions", {**body, "echo": False, "user": None}).json()
    assert len(data["choices"]) == 1
    assert data["choices"][0]["text"] == "hello w1 w2" + plain["choices"][0]["text"]
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    body.update(stream=True, stream_options={"include_usage": True}, best_of=None)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      headers=_headers(), timeout=30) as r:  # fmt: skip
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == data["choices"][0]["text"]
    assert "cached_tokens" in events[-1]["usage"]["prompt_tokens_details"]


def test_echo_with_logprobs_covers_the_prompt(server):
    body = {"model": MODEL, "prompt": "hello w1 w2", "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "echo": True, "logprobs": 1}  # fmt: skip
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    lp = data["choices"][0]["logprobs"]
    num_prompt = data["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == num_prompt + 2
    assert lp["token_logprobs"][0] is None  # nothing comes before the first prompt token
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"])
