"""An EngineReplica outside Ray: its KV event sockets are loopback and private to the deployment,
its events carry no token ids, and its /debug/kv view is scoped to the tenant."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from pagedattn.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedattn.distributed.kv_events import END_SEQ, ZmqEventSubscriber, decode_batch
from pagedattn.distributed.zmq_auth import CurveKeys, secure_client
from pagedattn.entrypoints.serve_config import ServeConfig
from pagedattn.serve import replica as replica_module
from pagedattn.serve.replica import CHAT, COMPLETION, EVENTS_TOPIC, EngineReplica, socket_hosts
from tests.entrypoints.server_process import make_model_dir

SECRET = b"the deployment secret of this test"


def test_socket_hosts_default_to_loopback_and_name_the_node_only_when_asked(monkeypatch):
    monkeypatch.setattr(replica_module, "_node_ip", lambda: "10.1.2.3")
    assert socket_hosts(None) == ("127.0.0.1", "127.0.0.1")
    assert socket_hosts("node") == ("10.1.2.3", "10.1.2.3")
    assert socket_hosts("0.0.0.0") == ("0.0.0.0", "10.1.2.3")
    assert socket_hosts("192.168.0.5") == ("192.168.0.5", "192.168.0.5")


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("replica"))
    config = EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4),
        num_threads=1,
    )
    serve_config = ServeConfig(
        served_model_name="tiny-llama", tool_call_parser="hermes", enable_auto_tool_choice=True
    )
    replica = EngineReplica(config, serve_config, deployment_secret=SECRET)
    yield replica
    replica.__del__()


def _replay(endpoint: str, curve=None) -> list[list[bytes]]:
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        secure_client(req, curve, endpoint)
    req.setsockopt(zmq.SNDTIMEO, 1500)
    req.connect(endpoint)
    got, wait = [], 1500
    try:
        req.send_multipart([b"", (0).to_bytes(8, "big")])
    except zmq.Again:  # NOTE: a failed handshake dropped the peer: the send has nowhere to go
        wait = 0
    while req.poll(wait):
        got.append(req.recv_multipart())
        wait = 300
    req.close()
    return got


def _complete(replica: EngineReplica, text: str, owner: str) -> dict:
    body = {"model": "tiny-llama", "prompt": text, "max_tokens": 2}
    return asyncio.run(replica.generate(COMPLETION, body, cache_salt=owner, owner=owner))


def test_event_sockets_are_loopback_and_read_only_with_the_secret(replica):
    stats = replica.record_routing_stats()
    endpoints = stats["kv_events_endpoint"], stats["kv_events_replay_endpoint"]
    assert all(e.startswith("tcp://127.0.0.1:") for e in endpoints), endpoints
    spy = zmq.Context.instance().socket(zmq.SUB)
    spy.setsockopt(zmq.LINGER, 0)
    spy.setsockopt(zmq.SUBSCRIBE, b"")
    spy.connect(stats["kv_events_endpoint"])
    text = "the a of to and is in it you that he was for on are with as I his"
    assert _complete(replica, text, "tenant-1")["status"] == 200
    deadline = time.monotonic() + 10
    while replica.publisher.next_seq == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    # Without the secret: no replay answer, no published batch.
    assert _replay(stats["kv_events_replay_endpoint"]) == []
    assert not spy.poll(300)
    spy.close()
    # With it: the router's subscriber reads the blocks, as hashes without token ids.
    curve = CurveKeys.from_secret(SECRET)
    got = _replay(stats["kv_events_replay_endpoint"], curve)
    assert got and got[-1] == [b"", END_SEQ, b""]
    sub = ZmqEventSubscriber(
        stats["kv_events_endpoint"], EVENTS_TOPIC, stats["kv_events_replay_endpoint"], curve=curve
    )
    batches = sub.poll(0)
    sub.close()
    stored = [e for b in batches for e in b.events if hasattr(e, "token_ids")]
    assert stored and all(e.token_ids == [] and e.extra_keys is None for e in stored)
    hashes = {h for e in stored for h in e.block_hashes}
    assert hashes and hashes <= replica.cached_block_hashes()
    assert [decode_batch(m[2]) for m in got[:-1]]


def test_kv_snapshot_is_the_tenants_view(replica):
    async def run():
        body = {"model": "tiny-llama", "prompt": "the a of to and is", "max_tokens": 64,
                "ignore_eos": True, "stream": True}  # fmt: skip
        stream = replica.generate_stream(COMPLETION, body, cache_salt="t1", owner="t1")
        await stream.__anext__()  # the request runs now
        mine = await replica.kv_snapshot("t1", True)
        theirs = await replica.kv_snapshot("t2", True)
        whole = await replica.kv_snapshot(None, False)
        await stream.aclose()
        return mine, theirs, whole

    mine, theirs, whole = asyncio.run(run())
    assert mine["replica_id"] == "local" and len(mine["requests"]) == 1
    assert theirs["requests"] == {} and theirs["other_tenants"]["num_requests"] == 1
    assert set(theirs["state"]) == {"hidden"} and set(mine["state"]) != {"hidden"}
    assert len(whole["requests"]) == 1


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_a_replica_applies_the_serve_configs_tool_options(replica):
    """--enable-auto-tool-choice reaches the replicas: `auto` is served, not refused with 400."""
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "auto",
        "max_tokens": 4,
    }
    out = asyncio.run(replica.generate(CHAT, body, cache_salt="t1", owner="t1"))
    assert out["status"] == 200, out
    assert out["body"]["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")
    assert replica.serving.enable_auto_tool_choice
