"""KV events on the wire: vLLM's msgpack schema, ZMQ publish/subscribe with replay, PrefixIndex."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from pagedattn.core import kv_events as core
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from pagedattn.core.request import Request
from pagedattn.distributed.kv_events import (
    END_SEQ,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    ZmqEventSubscriber,
    decode_batch,
    encode_batch,
    make_batch,
)
from pagedattn.distributed.zmq_auth import CurveKeys, new_deployment_secret, secure_client
from pagedattn.serve.prefix_index import PrefixIndex

LOOPBACK = "tcp://127.0.0.1:*"


def test_wire_format_is_vllms_array_like_tagged_schema():
    stored = core.BlockStored(
        (b"h1", b"h2"), None, tuple(range(8)), 4, None, ((("salt", "s"),), None)
    )
    batch = make_batch([stored, core.BlockRemoved((b"h0",)), core.AllBlocksCleared()])
    raw = msgspec.msgpack.decode(encode_batch(batch))
    ts, events = raw[0], raw[1]
    assert isinstance(ts, float) and raw[2] is None  # data_parallel_rank
    assert events[0][:7] == ["BlockStored", [b"h1", b"h2"], None, list(range(8)), 4, None, "CPU"]
    assert events[0][8] == [[["salt", "s"]], None]  # per block: its keys, or None
    assert events[1][:3] == ["BlockRemoved", [b"h0"], "CPU"]
    assert events[2] == ["AllBlocksCleared"]
    again = decode_batch(encode_batch(batch))
    assert isinstance(again.events[0], BlockStored)
    assert again.events[0].block_hashes == [b"h1", b"h2"]


# The structs of vLLM's kv_events_subscriber example (no lora_name/extra_keys/group_idx):
# trailing fields they do not know are skipped by msgspec.
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


def test_a_consumer_with_vllms_structs_decodes_our_batches():
    stored = core.BlockStored((b"a",), b"p", (1, 2), 2, extra_keys=((("salt", "x"),),))
    batch = make_batch([stored, core.BlockRemoved((b"a",))])
    decoded = msgspec.msgpack.Decoder(VBatch).decode(encode_batch(batch))
    assert decoded.events[0].parent_block_hash == b"p"
    assert decoded.events[0].token_ids == [1, 2]
    assert decoded.events[1].block_hashes == [b"a"]


def _drain(sub: ZmqEventSubscriber, n: int, timeout_s: float = 5.0) -> list[KVEventBatch]:
    got: list[KVEventBatch] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got.extend(sub.poll(100))
    return got


def _connect(pub: ZmqEventPublisher, replay: bool = True) -> ZmqEventSubscriber:
    sub = ZmqEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint if replay else None)
    # NOTE: PUB drops what it sends before a subscription arrives; wait for the join.
    for _ in range(100):
        pub.publish([core.AllBlocksCleared()])
        if sub.poll(50):
            return sub
    raise AssertionError("the subscriber never joined")


def test_publish_subscribe_in_order_with_topic_and_seq():
    pub = ZmqEventPublisher(LOOPBACK, topic="kv", replay_endpoint=LOOPBACK)
    sub = _connect(pub)
    try:
        for i in range(20):
            pub.publish([core.BlockRemoved((i.to_bytes(2, "big"),))])
        pub.publish([])  # empty batches are not sent
        got = _drain(sub, 20)
        assert [b.events[0].block_hashes[0] for b in got] == [
            i.to_bytes(2, "big") for i in range(20)
        ]
        assert sub.num_missed == 0
    finally:
        sub.close()
        pub.shutdown()


def test_missed_batches_come_back_from_the_replay_socket():
    pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    sub = _connect(pub)
    try:
        for i in range(5):
            pub.publish([core.BlockRemoved((bytes([i]),))])
        got = _drain(sub, 5)
        assert len(got) == 5
        # Simulate loss: the subscriber believes it never saw the last five batches.
        sub.last_seq -= 5
        pub.publish([core.BlockRemoved((b"new",))])
        got = _drain(sub, 6)
        assert [b.events[0].block_hashes for b in got] == [[bytes([i])] for i in range(5)] + [
            [b"new"]
        ]
        assert sub.num_missed == 0
    finally:
        sub.close()
        pub.shutdown()


def test_catch_up_replays_the_last_batches_lost_with_nothing_after_them():
    pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    sub = _connect(pub)
    try:
        for i in range(3):
            pub.publish([core.BlockRemoved((bytes([i]),))])
        assert len(_drain(sub, 3)) == 3
        seen = sub.last_seq
        for i in range(3, 5):
            pub.publish([core.BlockRemoved((bytes([i]),))])
        # Lose the last two on the wire (as a full receive queue does): no later batch shows
        # the gap, so poll alone never returns them.
        for _ in range(2):
            assert sub._sub.poll(2000)
            sub._sub.recv_multipart()
        assert sub.poll(50) == [] and sub.last_seq == seen
        got = sub.catch_up(pub.next_seq - 1)
        assert [b.events[0].block_hashes for b in got] == [[bytes([3])], [bytes([4])]]
        assert sub.last_seq == seen + 2 and sub.num_missed == 0
        assert sub.catch_up(seen + 2) == []
    finally:
        sub.close()
        pub.shutdown()


def test_a_late_subscriber_gets_the_buffered_history_on_its_first_poll():
    pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    try:
        for i in range(3):
            pub.publish([core.BlockRemoved((bytes([i]),))])
        deadline = time.monotonic() + 5
        while pub.next_seq < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Joins after the last batch and nothing follows: only the replay can tell it.
        sub = ZmqEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        got = sub.poll(0)
        assert [b.events[0].block_hashes for b in got] == [[bytes([i])] for i in range(3)]
        assert sub.last_seq == 2 and sub.num_missed == 0
        got = []
        for _ in range(100):  # until the SUB socket has joined (PUB drops what came before)
            pub.publish([core.BlockRemoved((b"next",))])
            got = sub.poll(50)
            if got:
                break
        # A batch dropped before the join is a gap: replayed, in order, none missed.
        assert got and all(b.events[0].block_hashes == [b"next"] for b in got)
        assert sub.last_seq == pub.next_seq - 1 or sub.poll(200)
        assert sub.num_missed == 0
        sub.close()
    finally:
        pub.shutdown()


def test_publisher_refuses_after_shutdown_and_busy_port_raises():
    pub = ZmqEventPublisher(LOOPBACK)
    port = pub.endpoint.rsplit(":", 1)[1]
    with pytest.raises(zmq.ZMQError):
        ZmqEventPublisher("tcp://*:" + port)
    pub.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pub.publish([core.AllBlocksCleared()])


def _raw_replay(endpoint: str, frames, curve: CurveKeys | None = None, timeout_ms: int = 1000):
    """Every message a DEALER gets within timeout_ms after sending frames to a replay socket."""
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        secure_client(req, curve, endpoint)
    req.setsockopt(zmq.SNDTIMEO, timeout_ms)
    req.connect(endpoint)
    got = []
    try:
        req.send_multipart(frames)
    except zmq.Again:  # NOTE: a failed handshake dropped the peer: the send has nowhere to go
        timeout_ms = 0
    while req.poll(timeout_ms):
        got.append(req.recv_multipart())
        timeout_ms = 200
    req.close()
    return got


def _stored(i: int) -> core.BlockStored:
    return core.BlockStored((bytes([i]),), None, (101, 102, 103, 104), 4, None, ((("s", "x"),),))


def test_a_curve_publisher_feeds_only_the_deployments_subscribers_and_hides_token_ids():
    curve = CurveKeys.from_secret(new_deployment_secret())
    pub = ZmqEventPublisher(
        LOOPBACK, replay_endpoint=LOOPBACK, curve=curve, token_ids=False, topic="kv"
    )
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        for i in range(3):
            pub.publish([_stored(i)])
        deadline = time.monotonic() + 5
        while pub.next_seq < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        start = (0).to_bytes(8, "big")
        # No key, or another deployment's keys: the replay socket answers nothing at all.
        assert _raw_replay(pub.replay_endpoint, [b"", start]) == []
        other = CurveKeys.from_secret(new_deployment_secret())
        assert _raw_replay(pub.replay_endpoint, [b"", start], other) == []
        # Nor does the PUB socket: an unauthenticated SUB receives no batch.
        spy = zmq.Context.instance().socket(zmq.SUB)
        spy.setsockopt(zmq.LINGER, 0)
        spy.setsockopt(zmq.SUBSCRIBE, b"")
        spy.connect(pub.endpoint)
        sub = ZmqEventSubscriber(
            pub.endpoint, topic="kv", replay_endpoint=pub.replay_endpoint, curve=curve
        )
        got = sub.poll(0)  # the deployment's subscriber: the history, by replay
        assert [b.events[0].block_hashes for b in got] == [[bytes([i])] for i in range(3)]
        got = []
        for _ in range(100):
            pub.publish([_stored(9)])
            got = sub.poll(50)
            if got:
                break
        assert got and got[0].events[0].block_hashes == [bytes([9])]
        # Hashes only: neither the prompt's token ids nor its extra keys leave the replica.
        assert all(b.events[0].token_ids == [] and b.events[0].extra_keys is None for b in got)
        assert not spy.poll(300)
        spy.close()
        sub.close()
    finally:
        pub.shutdown()


def test_malformed_replay_requests_get_an_empty_answer_and_the_publisher_goes_on():
    pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    try:
        pub.publish([_stored(1)])
        for frames in ([b"", b"\xff" * 3], [b"x", b"y", b"z"], [b"only"]):
            answer = _raw_replay(pub.replay_endpoint, frames)
            if frames[0] == b"":
                assert answer == [[b"", END_SEQ, b""]], frames
        # The default external feed keeps vLLM's schema: token ids included.
        answer = _raw_replay(pub.replay_endpoint, [b"", (0).to_bytes(8, "big")])
        assert answer[-1] == [b"", END_SEQ, b""]
        batch = decode_batch(answer[0][2])
        assert batch.events[0].token_ids == [101, 102, 103, 104]
    finally:
        pub.shutdown()


def _cached(manager: KVCacheManager) -> set[bytes]:
    return {k[:-4] for k in manager.block_pool.cached_block_hash_to_block}


def test_index_fed_over_zmq_equals_the_cache_through_evictions_and_reset():
    groups = [KVCacheGroupSpec(("layer.0",), FullAttentionSpec(4))]
    manager = KVCacheManager(groups, 20, enable_kv_cache_events=True)
    pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    sub = _connect(pub)
    index = PrefixIndex()
    index.add_replica("r0")
    rng = random.Random(1)
    num_removed = 0
    try:
        for i in range(40):
            tokens = [rng.randrange(50) for _ in range(rng.randrange(4, 20))]
            request = Request(f"q{i}", tokens, block_size=4, cache_salt=rng.choice([None, "t"]))
            hit, num_hit = manager.get_computed_blocks(request)
            assert manager.allocate_slots(request, request.num_tokens - num_hit, hit, num_hit)
            request.num_computed_tokens = request.num_tokens
            manager.free(request)
            events = manager.take_events()
            num_removed += sum(isinstance(e, core.BlockRemoved) for e in events)
            pub.publish(events)
            if events:
                for batch in _drain(sub, 1):
                    index.apply("r0", batch)
            assert index.cached_hashes("r0") == _cached(manager)
        assert num_removed > 0
        assert manager.reset_prefix_cache()
        pub.publish(manager.take_events())
        for batch in _drain(sub, 1):
            index.apply("r0", batch)
        assert index.cached_hashes("r0") == set() == _cached(manager)
    finally:
        sub.close()
        pub.shutdown()
