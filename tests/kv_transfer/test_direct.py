"""BlockServer and fetch_blocks on loopback: authentication and malformed requests."""

from __future__ import annotations

import pytest
import zmq

from pagedattn.distributed.zmq_auth import CurveKeys, new_deployment_secret, secure_client
from pagedattn.kv_transfer.direct import BlockServer, TransferError, fetch_blocks
from pagedattn.kv_transfer.memory_store import MemoryKVStore

VALUE = b"block of tenant 1's prompt" * 100


@pytest.fixture
def curve():
    return CurveKeys.from_secret(new_deployment_secret())


@pytest.fixture
def server(curve):
    store = MemoryKVStore(1 << 20)
    store.put("k1", VALUE)
    server = BlockServer(store, curve=curve)
    yield server
    server.close()


def _raw(endpoint: str, frames, kind=zmq.REQ, curve=None, timeout_ms=1000):
    """The reply a raw socket gets within timeout_ms (None: nothing came)."""
    socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        secure_client(socket, curve, endpoint)
    socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
    socket.connect(endpoint)
    try:
        socket.send_multipart(frames)
        return socket.recv_multipart() if socket.poll(timeout_ms) else None
    except zmq.Again:  # NOTE: a failed handshake dropped the peer: the send has nowhere to go
        return None
    finally:
        socket.close()


def test_the_server_binds_loopback_by_default(server):
    assert server.endpoint.startswith("tcp://127.0.0.1:")


def test_only_the_deployments_client_can_pull_a_block(server, curve):
    assert [bytes(v) for v in fetch_blocks(server.endpoint, ["k1"], 5.0, curve=curve)] == [VALUE]
    # No CURVE, or another deployment's keys: no byte comes back, and the pull fails.
    for kind in (zmq.REQ, zmq.DEALER):
        frames = [b"get", b"k1"] if kind == zmq.REQ else [b"", b"get", b"k1"]
        assert _raw(server.endpoint, frames, kind) is None
    other = CurveKeys.from_secret(new_deployment_secret())
    assert _raw(server.endpoint, [b"get", b"k1"], curve=other) is None
    with pytest.raises(TransferError):
        fetch_blocks(server.endpoint, ["k1"], 1.0)
    with pytest.raises(TransferError):
        fetch_blocks(server.endpoint, ["k1"], 1.0, curve=other)
    assert server.num_requests == 1


@pytest.mark.parametrize(
    "frames",
    [
        [b"get", b"\xff\xfe not utf-8"],
        [b"get", b"k1", b"\xc3\x28"],
        [b"put", b"k1"],
        [b"\x00garbage"],
        [b"get", *[b"k"] * 20_000],
    ],
    ids=["non-utf8-key", "non-utf8-second-key", "wrong-verb", "garbage", "too-many-keys"],
)
def test_a_malformed_request_gets_an_error_and_the_next_pull_succeeds(server, curve, frames):
    reply = _raw(server.endpoint, frames, curve=curve)
    assert reply is not None and reply[0] == b"error" and reply[1].startswith(b"bad request")
    assert [bytes(v) for v in fetch_blocks(server.endpoint, ["k1"], 5.0, curve=curve)] == [VALUE]
    assert server.num_malformed == 1


def test_an_error_reply_fails_the_pull_with_its_reason(server, curve):
    with pytest.raises(TransferError, match="refused the pull: bad request: more than"):
        fetch_blocks(server.endpoint, ["k1"] * 20_000, 5.0, curve=curve)
    assert [bytes(v) for v in fetch_blocks(server.endpoint, ["k1"], 5.0, curve=curve)] == [VALUE]
