"""Deployment CURVE keys: derived from the secret alone, and never shown."""

from __future__ import annotations

import pytest
import zmq

from pagedattn.distributed.zmq_auth import (
    CurveKeys,
    encrypts,
    new_deployment_secret,
    secure_client,
    secure_server,
)


def test_every_holder_of_the_secret_derives_the_same_keys_and_others_differ():
    secret = new_deployment_secret()
    keys = CurveKeys.from_secret(secret)
    assert keys == CurveKeys.from_secret(secret)
    assert keys.server_public == zmq.curve_public(keys.server_secret)
    assert keys.client_public == zmq.curve_public(keys.client_secret)
    assert keys.server_secret != keys.client_secret
    other = CurveKeys.from_secret(new_deployment_secret())
    assert other.server_public != keys.server_public
    assert other.client_public != keys.client_public
    shown = repr(keys) + str(keys)
    assert keys.server_secret.decode() not in shown and keys.client_secret.decode() not in shown
    assert keys.password.decode() not in shown


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 32"):
        CurveKeys.from_secret(b"short")


def _local_network_ip() -> str | None:
    """This machine's address on a network interface (not loopback), or None."""
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # NOTE: UDP: nothing is sent
        ip = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if ip.startswith("127.") else ip


def test_the_mechanism_follows_the_endpoint():
    assert not encrypts("tcp://127.0.0.1:5555") and not encrypts("tcp://127.3.4.5:1")
    assert not encrypts("tcp://[::1]:5555") and not encrypts("ipc:///tmp/x")
    assert encrypts("tcp://10.0.0.7:5555") and encrypts("tcp://0.0.0.0:*")


@pytest.mark.parametrize("where", ["loopback", "network"])
def test_only_a_client_holding_the_secret_gets_a_message_through(where):
    host = "127.0.0.1" if where == "loopback" else _local_network_ip()
    if host is None:
        pytest.skip("no network interface besides loopback")
    keys = CurveKeys.from_secret(new_deployment_secret())
    other = CurveKeys.from_secret(new_deployment_secret())
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    secure_server(server, keys, f"tcp://{host}:*")
    server.bind(f"tcp://{host}:*")
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    assert encrypts(endpoint) == (where == "network")

    def delivered(setup) -> bool:
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        setup(client)
        client.setsockopt(zmq.SNDTIMEO, 1000)
        client.connect(endpoint)
        try:
            client.send(b"hello")
        except zmq.Again:  # NOTE: a failed handshake dropped the peer: the send has nowhere to go
            client.close()
            return False
        got = server.poll(500)
        if got:
            server.recv_multipart()
        client.close()
        return bool(got)

    assert not delivered(lambda c: None)
    assert not delivered(lambda c: secure_client(c, other, endpoint))
    # The other mechanism with the right secret fails too (both ends follow the endpoint).
    wrong = "tcp://127.0.0.1:1" if where == "network" else "tcp://10.0.0.7:1"
    assert not delivered(lambda c: secure_client(c, keys, wrong))
    assert delivered(lambda c: secure_client(c, keys, endpoint))
    server.close()
