"""Two engine replicas on a local Ray Serve: affinity, tenants, events = caches, metrics, death.

One Ray instance and one application for the module (start-up dominates: ~1 min on 2 cores).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from pagedattn.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from pagedattn.entrypoints.serve_config import ServeConfig  # noqa: E402
from pagedattn.serve.serve_app import build_app  # noqa: E402
from tests.entrypoints.server_process import free_port, make_model_dir  # noqa: E402
from tests.entrypoints.test_front_door import load_probes  # noqa: E402

KEYS = ("key-a", "key-b")
ADMIN = "key-admin"
SECRET = b"deployment secret of this test module!"
BLOCK_SIZE = 4
WORDS = "the a of to and is in it you that he was for on are with as I his they be at one".split()


def prompt(i: int, n: int = 24) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n)) + f" w{i}"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("replicas"))
    config = EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=96),
        scheduler=SchedulerConfig(max_num_seqs=8),
        num_threads=1,
    )
    port = free_port()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve_config = ServeConfig(
            data_parallel_size=2,
            router="prefix",
            api_key=KEYS,
            admin_api_key=[ADMIN],
            shutdown_timeout=5.0,
        )
        application = build_app(
            config,
            serve_config,
            deployment_secret=SECRET,
            routing_stats_period_s=0.5,
            health_check_period_s=1.0,
            seed=0,
        )
        serve.run(application, name="pagedattn", route_prefix="/")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0)
        wait_for(lambda: len(replica_stats(client)) == 2, "2 replicas in the router")
        yield client
        client.close()
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_for(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def replica_stats(client: httpx.Client) -> dict:
    r = client.get("/debug/replicas", headers=auth(ADMIN))
    r.raise_for_status()
    return r.json()


def complete(client: httpx.Client, text: str, key: str = KEYS[0], **kw) -> dict:
    body = {"model": "tiny-llama", "prompt": text, "max_tokens": 3, **kw}
    r = client.post("/v1/completions", json=body, headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()


def cached_tokens(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def quiescent(client: httpx.Client) -> dict:
    """Replica stats once every replica is idle and the router's index caught up with it."""
    last = {}

    def settled() -> bool:
        nonlocal last
        last = replica_stats(client)
        return len(last) == 2 and all(
            s.get("num_requests") == 0 and s.get("index_digest") == s.get("cached_digest")
            for s in last.values()
        )

    wait_for(settled, "replicas idle with the index equal to their caches")
    return last


def test_endpoints_auth_and_streaming(app):
    assert app.get("/health").json() == {"status": "ok"}
    assert app.get("/v1/models").status_code == 401
    models = app.get("/v1/models", headers=auth(KEYS[1])).json()
    assert models["data"][0]["id"] == "tiny-llama"
    r = app.post(
        "/v1/completions",
        json={"model": "nope", "prompt": "the a", "max_tokens": 2},
        headers=auth(KEYS[0]),
    )
    # The replica's own answer (status and OpenAI error body) comes back unchanged.
    assert r.status_code in (400, 404) and r.json()["error"]["code"] == "model_not_found"
    body = {"model": "tiny-llama", "prompt": prompt(99), "max_tokens": 4, "stream": True}
    with app.stream("POST", "/v1/completions", json=body, headers=auth(KEYS[0])) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert sum(len(json.loads(x[6:])["choices"][0]["text"]) > 0 for x in lines[:-1]) >= 1
    chat = app.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "the a"}],
            "max_tokens": 2,
        },  # fmt: skip
        headers=auth(KEYS[0]),
    )
    assert chat.status_code == 200, chat.text


def test_prefix_affinity_tenants_and_index_equals_caches(app):
    # Each prefix, sent again, goes where its blocks are: every repeat hits the prefix cache.
    for i in range(6):
        first = complete(app, prompt(i))
        assert cached_tokens(first) == 0
        for _ in range(2):
            again = complete(app, prompt(i))
            assert cached_tokens(again) >= BLOCK_SIZE * 6, again["usage"]
    # Another tenant sending the same text never hits the first tenant's blocks.
    assert cached_tokens(complete(app, prompt(0), key=KEYS[1])) == 0
    stats = quiescent(app)
    # Both replicas took traffic (misses spread to the least loaded) and hold what they served.
    assert all(s["num_routed"] > 0 and s["num_cached_blocks"] > 0 for s in stats.values())
    # 0 leaked blocks: idle replicas hold no block.
    assert all(s["num_free_blocks"] == s["num_usable_blocks"] for s in stats.values())


def test_metrics_cover_every_replica(app):
    complete(app, prompt(50))
    assert app.get("/metrics").status_code == 401  # keys are set, and no --metrics-public
    wait_for(
        lambda: app.get("/metrics", headers=auth(KEYS[0])).text.count('replica="') > 0, "metrics"
    )
    text = app.get("/metrics", headers=auth(KEYS[0])).text
    replicas = set(replica_stats(app))
    assert {rid for rid in replicas if f'replica="{rid}"' in text} == replicas
    assert "# HELP" in text


def test_adversarial_probes_hold_on_the_replicas(app):
    # NOTE: the same list as the single server's (issue 21: C2 was the ingress missing them).
    results = load_probes().run_probes(str(app.base_url), KEYS[0], "tiny-llama", KEYS[1])
    failed = [f"{r.name}: {r.failure}" for r in results if not r.ok]
    assert not failed, failed


def test_a_failed_replica_call_sends_no_ray_detail():
    from pagedattn.serve.serve_app import _replica_failed

    exc = RuntimeError("ActorDiedError: actor 5a1f... pid=31337, ip=10.9.8.7")
    body = json.dumps(_replica_failed(exc)["body"])
    assert "31337" not in body and "10.9.8.7" not in body and "ActorDied" not in body


def test_killed_replica_fails_its_requests_clearly_and_is_restarted(app):
    before = replica_stats(app)
    text = prompt(77, n=8)
    complete(app, text)  # the prefix now lives on one replica; the stream below follows it
    after = replica_stats(app)
    (victim_id,) = [r for r in after if after[r]["num_routed"] > before[r]["num_routed"]]
    (victim,) = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "EngineReplica" in a["name"] and victim_id in a["name"]
    ]
    body = {"model": "tiny-llama", "prompt": text, "max_tokens": 200, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with app.stream("POST", "/v1/completions", json=body, headers=auth(KEYS[0])) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        rest = [line for line in lines if line.startswith("data: ")]
    # The stream ends (no hang) with an error event naming the failure, then [DONE].
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])
    assert error["error"]["code"] == "replica_failed", rest[-3:]
    # Ray Serve replaces the replica; new requests succeed and no block leaks.
    wait_for(lambda: len(replica_stats(app)) == 2 and victim_id not in replica_stats(app),
             "a replacement replica", timeout_s=120.0)  # fmt: skip
    for i in range(4):
        complete(app, prompt(200 + i))
    quiescent(app)


def test_internal_endpoints_need_the_admin_key(app):
    for path in ("/debug/replicas", "/debug/router"):
        for headers in ({}, auth(KEYS[0]), auth(KEYS[1])):
            r = app.get(path, headers=headers)
            assert r.status_code in (401, 403), (path, r.status_code)
            assert "tcp://" not in r.text and "node_id" not in r.text
        assert app.get(path, headers=auth(ADMIN)).status_code == 200
    # The admin key is an API key too.
    assert complete(app, prompt(300), key=ADMIN)["usage"]["completion_tokens"] == 3


def _dealer_replay(endpoint: str, curve=None, timeout_ms: int = 1500) -> list:
    import zmq

    from pagedattn.distributed.zmq_auth import secure_client

    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        secure_client(req, curve, endpoint)
    req.setsockopt(zmq.SNDTIMEO, timeout_ms)
    req.connect(endpoint)
    got = []
    try:
        req.send_multipart([b"", (0).to_bytes(8, "big")])
    except zmq.Again:  # NOTE: a failed handshake dropped the peer: the send has nowhere to go
        timeout_ms = 0
    while req.poll(timeout_ms):
        got.append(req.recv_multipart())
        timeout_ms = 300
    req.close()
    return got


def test_replica_event_sockets_are_loopback_and_need_the_deployment_secret(app):
    import zmq

    from pagedattn.distributed.kv_events import END_SEQ, decode_batch
    from pagedattn.distributed.zmq_auth import CurveKeys

    complete(app, prompt(400))
    stats = quiescent(app)
    for s in stats.values():
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            assert s[name].startswith("tcp://127.0.0.1:"), s[name]
        # A peer without the secret: no replay batch, and the PUB socket sends it nothing.
        assert _dealer_replay(s["kv_events_replay_endpoint"]) == []
        spy = zmq.Context.instance().socket(zmq.SUB)
        spy.setsockopt(zmq.LINGER, 0)
        spy.setsockopt(zmq.SUBSCRIBE, b"")
        spy.connect(s["kv_events_endpoint"])
        # With the secret: the history, as block hashes without the prompts' token ids.
        got = _dealer_replay(s["kv_events_replay_endpoint"], CurveKeys.from_secret(SECRET))
        assert got and got[-1] == [b"", END_SEQ, b""]
        stored = [e for m in got[:-1] for e in decode_batch(m[2]).events if hasattr(e, "token_ids")]
        assert stored and all(e.token_ids == [] and e.block_hashes for e in stored)
        complete(app, prompt(401))
        assert not spy.poll(500)
        spy.close()


def test_debug_kv_per_replica_scoped_to_the_tenant_and_the_dashboard(app):
    page = app.get("/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert app.get("/debug/kv").status_code == 401
    ids = sorted(replica_stats(app))
    r = app.get("/debug/kv", params={"replica": "nope"}, headers=auth(KEYS[0]))
    assert r.status_code == 404
    body = {"model": "tiny-llama", "prompt": prompt(500), "max_tokens": 200, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with app.stream("POST", "/v1/completions", json=body, headers=auth(KEYS[0])) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        mine = {}
        for rid in ids:
            snap = app.get("/debug/kv", params={"replica": rid}, headers=auth(KEYS[0])).json()
            assert snap["replica_id"] == rid and snap["replica_ids"] == ids
            mine[rid] = snap
        (holder,) = [rid for rid, snap in mine.items() if snap["requests"]]
        assert any(state != "hidden" for state in mine[holder]["state"])
        # Another tenant sees the request only as a count, and none of its blocks.
        other = app.get("/debug/kv", params={"replica": holder}, headers=auth(KEYS[1])).json()
        assert other["requests"] == {} and other["block_tables"] == {}
        assert other["other_tenants"]["num_requests"] >= 1
        assert set(other["state"]) == {"hidden"}
        default = app.get("/debug/kv", headers=auth(KEYS[1])).json()
        assert default["replica_id"] == ids[0]
