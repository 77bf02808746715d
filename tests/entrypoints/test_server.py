"""The OpenAI-compatible server, live on a tiny model, through the official `openai` client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pagedattn.entrypoints.openai.server import TenantAuth
from tests.entrypoints.server_process import ServerProcess, make_model_dir, read_metrics, wait_idle

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
PROMPT = "The quick brown fox jumps over the lazy dog"
# Long enough to fill several 16-token blocks, so a second request can hit the prefix cache.
LONG_PROMPT = " ".join(f"w{i}" for i in range(40))
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--max-model-len", "256", "--num-blocks", "256", "--block-size", "16",
            "--api-key", KEY_A, KEY_B]  # fmt: skip
    proc = ServerProcess(model_dir, log, *args)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY_A, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _post(server, path: str, body, key: str | None = KEY_A, raw: bytes | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{server.base_url}{path}", content=raw, headers=headers, timeout=30)
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)


def test_completion_counts_tokens(client, model, tokenizer):
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    num_prompt = len(tokenizer.encode(PROMPT))
    assert resp.usage.prompt_tokens == num_prompt
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == num_prompt + 8
    assert len(tokenizer.encode(choice.text)) <= 8  # special tokens are skipped in the text


def test_chat_completion(client, model):
    messages = [{"role": "user", "content": PROMPT}]
    resp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, extra_body=NO_EOS
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.usage.completion_tokens == 6
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_equals_whole_response_and_ends_with_usage(client, model, kind):
    kwargs = dict(model=model, max_tokens=10, temperature=0, extra_body=NO_EOS)
    if kind == "chat":
        create = client.chat.completions.create
        kwargs["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        create = client.completions.create
        kwargs["prompt"] = PROMPT
    whole = create(**kwargs)
    chunks = list(create(**kwargs, stream=True, stream_options={"include_usage": True}))
    if kind == "chat":
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = whole.choices[0].message.content
    else:
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = whole.choices[0].text
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_with_seed(client, model):
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=3, extra_body=NO_EOS
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == 16
    assert resp.choices[0].text != resp.choices[1].text
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=3,
        extra_body=NO_EOS, stream=True,
    )  # fmt: skip
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in resp.choices}


def test_seed_reproducibility(client, model):
    def run(seed: int) -> str:
        return client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
            extra_body=NO_EOS,
        ).choices[0].text  # fmt: skip

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_stop_sequence_cuts_text(client, model):
    full = (
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=NO_EOS
        )
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), f"degenerate generated text {full!r}"
    for stream in (False, True):
        resp = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
            extra_body=NO_EOS, stream=stream,
        )  # fmt: skip
        if stream:
            chunks = list(resp)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = resp.choices[0].text, resp.choices[0].finish_reason
        assert text == full[: full.index(stop)]
        assert reason == "stop"


def test_logprobs(client, model):
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert sampled <= 0
        assert 1 <= len(top) <= 2
        assert sampled == pytest.approx(max(top.values()))  # greedy picks the most likely
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_EOS,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_batch_of_prompts(client, model):
    resp = client.completions.create(
        model=model, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    single = client.completions.create(
        model=model, prompt="Hello", max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    assert resp.choices[1].text == single.choices[0].text


BAD_BODIES = {
    "missing prompt": ({"model": "{model}"}, "prompt"),
    "missing model": ({"prompt": "hi"}, "model"),
    "max_tokens 0": ({"model": "{model}", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens too big": ({"model": "{model}", "prompt": "hi", "max_tokens": 1000}, "max_tokens"),
    "temperature < 0": ({"model": "{model}", "prompt": "hi", "temperature": -0.5}, "temperature"),
    "top_p 0": ({"model": "{model}", "prompt": "hi", "top_p": 0}, "top_p"),
    "top_p > 1": ({"model": "{model}", "prompt": "hi", "top_p": 1.5}, "top_p"),
    "prompt too long": ({"model": "{model}", "prompt": "word " * 400}, "prompt"),
    "empty prompt": ({"model": "{model}", "prompt": ""}, "prompt"),
    "n 0": ({"model": "{model}", "prompt": "hi", "n": 0}, "n"),
    "empty stop string": ({"model": "{model}", "prompt": "hi", "stop": [""]}, "stop"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_completion_input_gets_400(server, client, model, case):
    body, param = BAD_BODIES[case]
    body = {k: (model if v == "{model}" else v) for k, v in body.items()}
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    ok = client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert ok.choices[0].text is not None


@pytest.mark.parametrize(
    "path,raw",
    [
        ("/v1/completions", b'{"model": "x", "prompt": '),
        ("/v1/chat/completions", b"not json"),
    ],
)
def test_malformed_json_gets_400(server, client, model, path, raw):
    resp = _post(server, path, None, raw=raw)
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=model, prompt="hi", max_tokens=1).usage is not None


def test_bad_chat_input_gets_400(server, model):
    for body, param in [
        ({"model": model, "messages": []}, "messages"),
        ({"model": model, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": model, "messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
    ]:
        resp = _post(server, "/v1/chat/completions", body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


def test_api_key_required(server, model):
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    for key in (None, "wrong-key"):
        resp = _post(server, "/v1/completions", body, key=key)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    assert _post(server, "/v1/completions", body, key=KEY_B).status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def _cached_tokens(client, model, **extra) -> int:
    resp = client.completions.create(
        model=model, prompt=LONG_PROMPT, max_tokens=1, temperature=0, extra_body=extra
    )
    return resp.usage.prompt_tokens_details.cached_tokens


def test_prefix_cache_is_per_tenant(server, model):
    client_a = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY_A, max_retries=0)
    client_b = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY_B, max_retries=0)
    _cached_tokens(client_a, model)
    assert _cached_tokens(client_a, model) >= 32  # tenant A hits its own cached blocks
    hits_before = read_metrics(server.base_url, AUTH)["pagedattn_prefix_cache_hits_total"]
    assert _cached_tokens(client_b, model) == 0
    assert read_metrics(server.base_url, AUTH)["pagedattn_prefix_cache_hits_total"] == hits_before
    # A client-chosen salt cannot reach another tenant's namespace, only split its own.
    assert _cached_tokens(client_b, model, cache_salt="anything") == 0
    assert _cached_tokens(client_a, model, cache_salt="sub") == 0
    assert _cached_tokens(client_a, model, cache_salt="sub") >= 32


def test_tenant_salts():
    keyed = TenantAuth(["a", "b"], secret=b"s")
    salt_a = keyed.authenticate("Bearer a")
    salt_b = keyed.authenticate("Bearer b")
    assert salt_a != salt_b and salt_a == keyed.authenticate("bearer a")
    assert keyed.cache_salt(salt_a, None) == salt_a
    assert keyed.cache_salt(salt_a, "x") != keyed.cache_salt(salt_b, "x")
    assert keyed.cache_salt(salt_b, salt_a) != salt_a
    open_server = TenantAuth(None, secret=b"s")
    assert open_server.authenticate(None) is None
    assert open_server.cache_salt(None, None) is None
    assert open_server.cache_salt(None, "x") == open_server.cache_salt(None, "x")
    assert open_server.cache_salt(None, "x") != open_server.cache_salt(None, "y")


def test_disconnect_mid_stream_frees_blocks(server, model):
    body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 210, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    aborted_before = read_metrics(server.base_url, AUTH).get(
        f'pagedattn_request_success_total{{finished_reason="abort",model_name="{model}"}}', 0.0
    )
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30
    ) as resp:
        lines = resp.iter_lines()
        num_events = 0
        for line in lines:
            num_events += line.startswith("data: ")
            if num_events == 3:
                break
        running = read_metrics(server.base_url, AUTH)
        assert running["pagedattn_kv_cache_usage_perc"] > 0
    t0 = time.monotonic()
    metrics = wait_idle(server.base_url, headers=AUTH)
    assert metrics["pagedattn_kv_cache_usage_perc"] == 0, f"blocks leaked: {metrics}"
    assert metrics["pagedattn_num_requests_running"] == 0
    assert time.monotonic() - t0 < 5.0
    aborted = metrics[
        f'pagedattn_request_success_total{{finished_reason="abort",model_name="{model}"}}'
    ]
    assert aborted == aborted_before + 1


def test_metrics_exposes_engine_state(server, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body=NO_EOS)
    m = wait_idle(server.base_url, headers=AUTH)
    for name in (
        "pagedattn_kv_cache_free_blocks",
        "pagedattn_kv_cache_cached_blocks",
        "pagedattn_prefix_cache_queries_total",
        "pagedattn_num_preemptions_total",
        "pagedattn_num_requests_waiting",
    ):
        assert name in m
    assert m["pagedattn_kv_cache_free_blocks"] == m["pagedattn_kv_cache_total_blocks"]
    assert m["pagedattn_prompt_tokens_total"] > 0
    assert m["pagedattn_generation_tokens_total"] >= 4
    assert m["pagedattn_time_to_first_token_seconds_count"] >= 1
    assert m["pagedattn_inter_token_latency_seconds_count"] >= 3
    assert m["pagedattn_e2e_request_latency_seconds_count"] >= 1
    kv = httpx.get(f"{server.base_url}/debug/kv", headers={"Authorization": f"Bearer {KEY_A}"})
    assert kv.status_code == 200 and isinstance(kv.json(), dict)
    assert httpx.get(f"{server.base_url}/debug/kv").status_code == 401
    page = httpx.get(f"{server.base_url}/dashboard")
    assert page.status_code == 200 and "/debug/kv" in page.text
