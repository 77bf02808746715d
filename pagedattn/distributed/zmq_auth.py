"""Private ZMQ sockets of one deployment: CURVE keys derived from its secret, a ZAP check.

A deployment (the Ray Serve replicas of one `pagedattn serve`) has one random secret, made by
the process that starts the replicas and handed to each of them. From it every holder derives
the same two Curve25519 key pairs (``CurveKeys``): the server pair, which every socket that binds
(KV event PUB, replay ROUTER, BlockServer) uses, and the client pair, which every socket that
connects (the router's SUB and replay DEALER, the decode side's puller) uses. A server socket
completes the CURVE handshake only with a peer that knows the server's public key and holds the
client pair: a ZAP handler on the socket's context admits the client public key alone. A peer
without the secret therefore reads nothing (its handshake fails before any message passes), and
what passes is encrypted.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

# The ZAP domain of every deployment socket.
ZAP_DOMAIN = "pagedattn"
# Bytes of a new deployment secret (and the fewest a given one may have).
SECRET_BYTES = 32


def new_deployment_secret() -> bytes:
    """A fresh random deployment secret."""
    return secrets.token_bytes(SECRET_BYTES)


def _key_pair(secret: bytes, person: bytes) -> tuple[bytes, bytes]:
    # NOTE: any 32 bytes are a Curve25519 secret key (the curve clamps it); BLAKE2b with a
    # personalisation string gives two independent keys from one secret.
    private = z85.encode(hashlib.blake2b(secret, digest_size=32, person=person).digest())
    return zmq.curve_public(private), private


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """The deployment's server and client CURVE key pairs (z85), derived from its secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> CurveKeys:
        if not isinstance(secret, bytes) or len(secret) < SECRET_BYTES:
            raise ValueError(f"a deployment secret is at least {SECRET_BYTES} random bytes")
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support: install pyzmq's wheel")
        server_public, server_secret = _key_pair(secret, b"pagedattn-server")
        client_public, client_secret = _key_pair(secret, b"pagedattn-client")
        return cls(server_public, server_secret, client_public, client_secret)

    def __repr__(self) -> str:
        return "CurveKeys(<secret>)"


class _AllowedKeys:
    """The ZAP credentials provider: client public keys (z85) a context's servers admit."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


_lock = threading.Lock()
# Per ZMQ context: its ZAP handler thread and the client keys it admits.
_authenticators: dict[int, tuple[zmq.Context, ThreadAuthenticator, _AllowedKeys]] = {}


def _admit(ctx: zmq.Context, client_public: bytes) -> None:
    """Start the context's ZAP handler (one per context) and admit client_public there."""
    with _lock:
        entry = _authenticators.get(id(ctx))
        if entry is None or entry[0] is not ctx or entry[0].closed:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            allowed = _AllowedKeys()
            auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=allowed)
            entry = (ctx, auth, allowed)
            _authenticators[id(ctx)] = entry
        entry[2].keys.add(client_public)


def secure_server(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Make a socket (before it binds) a CURVE server that admits the deployment's client only."""
    _admit(socket.context, keys.client_public)
    socket.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    socket.setsockopt(zmq.CURVE_SERVER, 1)


def secure_client(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Make a socket (before it connects) the deployment's CURVE client."""
    socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
