"""1 prefill + 1 decode replica on a local Ray Serve: one stream per request, the same greedy
text as one engine, blocks pulled over ZMQ, no leaked blocks, and replica deaths handled.

Slow (Ray and three deployments start in ~1 min on 2 cores); the engine-level behaviour is in
tests/kv_transfer/test_pd.py, in the default suite.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from pagedattn import LLM, SamplingParams  # noqa: E402
from pagedattn.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from pagedattn.entrypoints.serve_config import ServeConfig  # noqa: E402
from pagedattn.serve.pd_app import build_pd_app  # noqa: E402
from tests.entrypoints.server_process import free_port, make_model_dir  # noqa: E402
from tests.serve.test_serve_app import prompt, wait_for  # noqa: E402

KEY = "key-a"
SECRET = b"deployment secret of the PD test module"
BLOCK_SIZE = 4
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # NOTE: a long context, so that a stream outlives the kill below
    return make_model_dir(tmp_path_factory.mktemp("pd"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def app(model):
    config = EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=1100),
        scheduler=SchedulerConfig(max_num_seqs=8),
        num_threads=1,
    )
    port = free_port()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve_config = ServeConfig(
            prefill_replicas=1,
            decode_replicas=1,
            api_key=[KEY],
            shutdown_timeout=5.0,
            pd_min_prompt_tokens=0,  # NOTE: these prompts are short; every one goes through PD
        )
        application = build_pd_app(
            config,
            serve_config,
            deployment_secret=SECRET,
            routing_stats_period_s=0.5,
            health_check_period_s=1.0,
            seed=0,
        )
        serve.run(application, name="pagedattn", route_prefix="/")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0)
        wait_for(lambda: client.get("/health").status_code == 200, "a healthy app")
        yield client
        client.close()
    finally:
        serve.shutdown()
        ray.shutdown()


def kv_usage(name: str) -> dict:
    handle = serve.get_deployment_handle(name, app_name="pagedattn")
    return handle.kv_usage.remote().result()


def single_text(model, text: str, max_tokens: int) -> str:
    llm = LLM(str(model), dtype="float32", num_blocks=96, block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([text], params)[0].outputs[0].text


def test_streams_and_whole_responses_equal_one_engine_and_leak_nothing(app, model):
    text = prompt(1, n=40)
    expected = single_text(model, text, 12)
    body = {"model": "tiny-llama", "prompt": text, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = app.post("/v1/completions", json=body, headers=HEADERS)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    usage = r.json()["usage"]
    # Pulled blocks are not prefix-cache hits: a first request reports none cached.
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    with app.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=HEADERS) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1])
    assert streamed == expected
    decode = kv_usage("DecodeReplica")
    assert decode["num_disaggregated"] == 2 and decode["num_local"] == 0
    # The first request pulled the prompt's full blocks; the second found them cached here.
    first, second = decode["transfers"][-2:]
    assert first["num_blocks"] >= 10 and first["num_bytes"] > 0 and first["num_local_blocks"] == 0
    assert (second["num_local_blocks"], second["num_blocks"]) == (first["num_blocks"], 0)
    wait_for(lambda: idle(kv_usage("DecodeReplica")) and idle(kv_usage("PrefillReplica")), "idle")
    assert kv_usage("DecodeReplica")["num_inbox_entries"] == 0
    # --threads 1 on a shared node: each replica on a core of its own (PAGEDATTN_CPU_BIND=auto).
    cpus = [kv_usage(name)["cpus"] for name in ("PrefillReplica", "DecodeReplica")]
    if len(os.sched_getaffinity(0)) >= 2:
        assert cpus[0] and cpus[1] and not set(cpus[0]) & set(cpus[1]), cpus


def idle(usage: dict) -> bool:
    return usage["num_requests"] == 0 and usage["num_free_blocks"] == usage["num_usable_blocks"]


def _actor(name: str):
    (actor,) = [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if name in a["name"]
    ]
    return ray.get_actor(actor, namespace="serve")


def _raw_get(endpoint: str, frames, curve=None) -> list[bytes] | None:
    import zmq

    from pagedattn.distributed.zmq_auth import secure_client

    req = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        secure_client(req, curve, endpoint)
    req.setsockopt(zmq.SNDTIMEO, 1500)
    req.connect(endpoint)
    try:
        req.send_multipart(frames)
        return req.recv_multipart() if req.poll(1500) else None
    except zmq.Again:  # NOTE: a failed handshake dropped the peer: the send has nowhere to go
        return None
    finally:
        req.close()


def test_the_block_server_is_loopback_private_and_survives_malformed_pulls(app, model):
    from pagedattn.distributed.zmq_auth import CurveKeys

    before = kv_usage("PrefillReplica")
    endpoint = before["transfer_endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
    # Without the deployment secret: no answer at all (not even "missing").
    assert _raw_get(endpoint, [b"get", b"any-key"]) is None
    curve = CurveKeys.from_secret(SECRET)
    assert _raw_get(endpoint, [b"get", b"any-key"], curve) == [b"ok", b""]
    # A malformed pull (a key that is not UTF-8) is answered with an error ...
    reply = _raw_get(endpoint, [b"get", b"\xff\xfe"], curve)
    assert reply is not None and reply[0] == b"error"
    # ... and the next request's blocks are still pulled from this server.
    text = prompt(7, n=40)
    body = {"model": "tiny-llama", "prompt": text, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = app.post("/v1/completions", json=body, headers=HEADERS)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == single_text(model, text, 4)
    assert kv_usage("DecodeReplica")["transfers"][-1]["num_blocks"] >= 10
    after = kv_usage("PrefillReplica")
    assert after["num_malformed_transfer_requests"] == before["num_malformed_transfer_requests"] + 1
    # The ingress's debug views: the decode replica's pool for the tenant; no internals for it.
    snap = app.get("/debug/kv", headers=HEADERS).json()
    assert snap["replica_ids"] == [snap["replica_id"]] and "state" in snap
    assert app.get("/debug/replicas", headers=HEADERS).status_code == 403


def test_a_request_the_decode_replica_cannot_hold_is_refused_before_the_prefill(app):
    body = {"model": "tiny-llama", "prompt": prompt(4), "max_tokens": 4090}
    r = app.post("/v1/completions", json=body, headers=HEADERS)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_a_dying_decode_replica_ends_its_stream_with_an_error(app):
    body = {"model": "tiny-llama", "prompt": prompt(3, n=30), "max_tokens": 4000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with app.stream("POST", "/v1/completions", json=body, headers=HEADERS) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        ray.kill(_actor("DecodeReplica"), no_restart=True)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:]).get("error", {}).get("code") == "replica_failed", rest[-3:]
    wait_for(lambda: app.get("/health").status_code == 200, "a new decode replica", 120.0)


def test_a_dying_prefill_replica_is_retried_or_computed_on_decode(app, model):
    text = prompt(5, n=30)
    expected = single_text(model, text, 6)
    ray.kill(_actor("PrefillReplica"), no_restart=True)
    body = {"model": "tiny-llama", "prompt": text, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = app.post("/v1/completions", json=body, headers=HEADERS)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    wait_for(lambda: idle(kv_usage("DecodeReplica")), "decode idle")
    wait_for(lambda: idle(kv_usage("PrefillReplica")), "a new prefill replica, idle", 120.0)
