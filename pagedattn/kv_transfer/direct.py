"""Direct replica-to-replica block transfer over ZMQ: the prefill side serves, decode pulls.

The prefill replica's connector saves every block its steps compute into an in-memory outbox
(encoded by the codec: header, payload, BLAKE2b checksum over the key, whose chained hash carries
the tenant salt). A ``BlockServer`` answers ``get`` requests for outbox keys on a ZMQ ROUTER
socket; ``fetch_blocks`` on the decode replica asks for the keys its prefix cache lacks and puts
the answers in its inbox, from which the decode engine's connector loads them before the first
step (as for store hits). A value that is missing, late or fails verification means recompute.

Privacy: the server binds where it is told (loopback by default); with the deployment's
``CurveKeys`` (distributed/zmq_auth.py) it is a server of the deployment and ``fetch_blocks`` its
client (CURVE, or PLAIN on loopback),
so a peer without the deployment secret cannot pull a block. A malformed request is answered
``[b"error", reason]`` and the server goes on serving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedattn.distributed.zmq_auth import CurveKeys, secure_client, secure_server
from pagedattn.kv_transfer.codec import HEADER_BYTES, BlockFormat
from pagedattn.kv_transfer.connector import KVConnector
from pagedattn.kv_transfer.store import KVStore

logger = logging.getLogger(__name__)

_GET, _OK, _ERROR = b"get", b"ok", b"error"
# The most keys one pull may ask for (a prompt of 16,384 blocks); more is a malformed request.
MAX_KEYS_PER_PULL = 16_384
# How long the server's poll waits before it checks whether it should stop.
_POLL_MS = 100
# A TCP connect to a live BlockServer takes milliseconds; past this the peer counts as gone.
_CONNECT_TIMEOUT_MS = 2000
# Socket events that mean the BlockServer is gone: connect refused or timed out, peer closed.
# A failed handshake (wrong deployment secret) counts as gone too: no retry will pass it.
_PEER_GONE = (
    zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class MalformedRequest(ValueError):
    """A BlockServer request that is not `[b"get", key, ...]` with UTF-8 keys."""


class ExportConnector(KVConnector):
    """The prefill side: saves every block a step computes (into the outbox), even one it saved
    before and the outbox has since dropped."""

    def _mark_known(self, keys: Sequence[str]) -> None:
        return None  # NOTE: the outbox evicts; a recomputed block must be saved again


class ImportConnector(KVConnector):
    """The decode side: loads transferred blocks, never saves (its inbox is not a cache).

    Values in ``verified`` (the inbox) passed the checksum when they were pulled, off the engine
    step; loading them checks only their length and header. Anything else (the fallback store)
    is verified as it loads.
    """

    def __init__(self, *args, verified: KVStore | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.verified = verified

    def save_blocks(self, kv_caches, block_ids, block_hashes) -> int:
        return 0

    def _fetch(self, keys, rows, fmt: BlockFormat, staging) -> tuple[int, int]:
        chunk = [keys[row] for row in rows]
        if self.verified is None or not all(self.verified.exists_many(chunk)):
            return super()._fetch(keys, rows, fmt, staging)
        lengths = self.verified.get_many_into(chunk, [staging[row] for row in rows])
        header = fmt.header()
        num_good = num_bytes = 0
        for row, length in zip(rows, lengths, strict=True):
            if length != fmt.value_bytes or staging[row][:HEADER_BYTES].tobytes() != header:
                break
            num_good += 1
            num_bytes += length
        return num_good, num_bytes


def attach_connector(engine, connector: KVConnector) -> None:
    """Give an LLMEngine built without kv_store a connector (scheduler and runner sides)."""
    if engine.kv_connector is not None:
        raise ValueError("the engine already has a KV connector (kv_store is set)")
    connector.block_format(engine.runner.kv_caches)  # NOTE: raises now if the layout differs
    engine.kv_connector = connector
    engine.runner.kv_connector = connector
    engine.scheduler.kv_connector = connector


class BlockServer:
    """Serves a store's values by key on a ZMQ ROUTER socket, on a thread of its own.

    Request: ``[b"get", key, ...]``; reply: ``[b"ok", value or b"", ...]`` (empty: missing), or
    ``[b"error", reason]`` for a malformed request. With ``curve``: a server of the
    deployment (only its clients connect).
    """

    def __init__(
        self, store: KVStore, endpoint: str = "tcp://127.0.0.1:*", curve: CurveKeys | None = None
    ) -> None:
        self.store = store
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            secure_server(self._socket, curve, endpoint)
        self._socket.bind(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_requests = 0
        self.num_malformed = 0
        self.bytes_sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-block-server", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                frames = self._socket.recv_multipart()
                try:
                    self._answer(frames)
                except Exception as exc:  # NOTE: one request never stops the server
                    self.num_malformed += 1
                    reason = str(exc) if isinstance(exc, MalformedRequest) else "internal error"
                    logger.warning("block server: refused a request: %s", exc)
                    self._socket.send_multipart([frames[0], b"", _ERROR, reason.encode()])
        finally:
            self._socket.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        ident, rest = frames[0], frames[1:]
        if rest and rest[0] == b"":
            rest = rest[1:]  # NOTE: a REQ peer's empty delimiter
        if not rest or rest[0] != _GET:
            raise MalformedRequest("bad request: send [b'get', key, ...]")
        if len(rest) - 1 > MAX_KEYS_PER_PULL:
            raise MalformedRequest(f"bad request: more than {MAX_KEYS_PER_PULL} keys")
        try:
            keys = [key.decode() for key in rest[1:]]
        except UnicodeDecodeError:
            raise MalformedRequest("bad request: a key is not UTF-8") from None
        values = [self._get(key) for key in keys]
        self.num_requests += 1
        self.bytes_sent += sum(len(v) for v in values)
        self._socket.send_multipart([ident, b"", _OK, *values], copy=False)

    def _get(self, key: str) -> bytes:
        try:
            value = self.store.get(key)
        except Exception:  # NOTE: a store failure is a miss for the puller, never a crash here
            logger.exception("block server: reading %s failed", key)
            value = None
        return b"" if value is None else value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class TransferError(RuntimeError):
    """A block pull failed or timed out; the decode side recomputes the prompt."""


class PeerUnreachableError(TransferError):
    """The BlockServer refused the connection or went away (its replica died): known at once."""


def fetch_blocks(
    endpoint: str,
    keys: Sequence[str],
    timeout_s: float,
    ctx: zmq.Context | None = None,
    curve: CurveKeys | None = None,
) -> list[memoryview | None]:
    """Pull keys' values from a BlockServer; None for a key it lacks. Raises TransferError.

    A refused or dropped connection raises PeerUnreachableError as soon as the socket reports
    it, not at the deadline (a dead prefill replica's port refuses at once). ``ctx``: the ZMQ
    context whose I/O thread receives (default: the process's shared one). ``curve``: the
    deployment's keys, when the server is the deployment's (zmq_auth.secure_server).
    """
    if not keys:
        return []
    ctx = ctx or zmq.Context.instance()
    socket = ctx.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.CONNECT_TIMEOUT, min(_CONNECT_TIMEOUT_MS, int(timeout_s * 1000)))
    # NOTE: a send blocks for good once a failed handshake (a wrong secret) dropped the peer.
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    if curve is not None:
        secure_client(socket, curve, endpoint)
    monitor = socket.get_monitor_socket(_PEER_GONE)
    try:
        socket.connect(endpoint)
        socket.send_multipart([_GET, *(key.encode() for key in keys)])
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        if socket not in ready:
            if monitor in ready:
                event = recv_monitor_message(monitor)["event"]
                raise PeerUnreachableError(f"{endpoint} is unreachable ({zmq.Event(event).name})")
            raise TransferError(f"no answer from {endpoint} within {timeout_s:.1f} s")
        frames = socket.recv_multipart(copy=False)
    except zmq.ZMQError as exc:
        raise TransferError(f"pulling blocks from {endpoint} failed: {exc}") from exc
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)
        socket.close(linger=0)
    if frames and frames[0].bytes == _ERROR:
        reason = frames[1].bytes.decode(errors="replace") if len(frames) > 1 else ""
        raise TransferError(f"{endpoint} refused the pull: {reason}")
    if not frames or frames[0].bytes != _OK or len(frames) != len(keys) + 1:
        raise TransferError(f"{endpoint} answered {len(frames)} frames for {len(keys)} keys")
    # NOTE: memoryviews of the received frames: no copy until the connector loads them.
    return [frame.buffer if len(frame) else None for frame in frames[1:]]


# Nice value of the decode side's pull threads (receive and verify): above the engine loop's,
# so that on a replica's own cores a pull takes the CPU time decode steps leave.
PULL_NICE = 10


class PullWorker:
    """Runs pulls on one thread of lower CPU priority (PULL_NICE) with a ZMQ context of its own,
    whose I/O thread (the socket receives) it starts and so shares that priority.

    NOTE: Linux nice values are per thread and inherited by the threads a thread starts; raising
    one needs no privilege. Where setpriority is refused, pulls run at normal priority.
    """

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._ctx: zmq.Context | None = None
        self.nice: int | None = None
        self._pool = ThreadPoolExecutor(1, "kv-pull", initializer=self._start)

    def _start(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PULL_NICE)
            self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        except (OSError, AttributeError):
            logger.info("kv pulls run at normal priority (setpriority refused)")
        self._ctx = zmq.Context(io_threads=1)
        self._ctx.socket(zmq.REQ).close(linger=0)  # NOTE: starts the I/O thread from here

    @property
    def ctx(self) -> zmq.Context | None:
        """The pull thread's context (None until the first pull started the thread)."""
        return self._ctx

    def submit(self, fn: Callable, *args):
        """A Future of fn(*args) on the pull thread."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)


def pull_into(
    inbox: KVStore,
    endpoint: str,
    keys: Sequence[str],
    timeout_s: float,
    verify: Callable[[str, memoryview], bool] | None = None,
    on_unreachable: Callable[[str], None] | None = None,
    ctx: zmq.Context | None = None,
    curve: CurveKeys | None = None,
) -> tuple[int, int, float]:
    """fetch_blocks, then put the leading present (and verified) values in the inbox:
    (blocks, bytes, seconds).

    A failed pull puts nothing (the decode side recomputes); it is logged, not raised, and
    ``on_unreachable(endpoint)`` hears of a peer that is gone. A value that fails ``verify``
    ends the run of blocks put (loads are contiguous).
    """
    start = time.perf_counter()
    try:
        values = fetch_blocks(endpoint, keys, timeout_s, ctx, curve)
    except TransferError as exc:
        logger.warning("block transfer failed, recomputing the prompt: %s", exc)
        if on_unreachable is not None and isinstance(exc, PeerUnreachableError):
            on_unreachable(endpoint)
        return 0, 0, time.perf_counter() - start
    num_blocks = num_bytes = 0
    for key, value in zip(keys, values, strict=True):
        if value is None or (verify is not None and not verify(key, value)):
            break  # NOTE: blocks after a gap cannot load (loads are contiguous)
        inbox.put(key, value)
        num_blocks += 1
        num_bytes += len(value)
    return num_blocks, num_bytes, time.perf_counter() - start
