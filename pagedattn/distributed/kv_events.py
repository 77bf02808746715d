"""KV cache events on the wire, in vLLM's schema: msgspec structs, a ZMQ publisher, a subscriber.

Wire format (as vLLM's `vllm/distributed/kv_events.py`): each batch is one ZMQ multipart message
`[topic, seq (8-byte big-endian), msgpack(KVEventBatch)]` on a PUB socket; the structs are
array-like and tagged by class name, so a consumer of vLLM's events decodes ours unchanged. With
a replay endpoint, a ROUTER socket answers `[b"", start_seq]` with every buffered batch from
start_seq on, then `[END_SEQ, b""]`; a malformed request gets `[END_SEQ, b""]` at once.

Privacy (the router's internal feed with replicas, distributed/zmq_auth.py): a publisher given
the deployment's `CurveKeys` binds its PUB and replay sockets as servers of the deployment
(CURVE, or PLAIN on loopback: zmq_auth.py), so only a holder
of the deployment secret can subscribe or replay. Decision: that internal feed also leaves token
ids out (`token_ids=False`: `BlockStored.token_ids` is empty, `extra_keys` None): the prefix
router matches the block hashes the ingress computes from the request's prompt
(serve/router.py `RequestHasher`), so the ids, which are every tenant's prompt text, never need
to leave the replica. An external `--kv-events-endpoint` keeps vLLM's schema (token ids
included, as vLLM sends them), unauthenticated as vLLM's, and binds only where the user says.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import zmq

from pagedattn.core import kv_events as core_events
from pagedattn.distributed.zmq_auth import CurveKeys, secure_client, secure_server

logger = logging.getLogger(__name__)

# Sequence number that ends a replay answer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# A replay answer slower than this counts as lost (the router must not stall on a dead replica).
REPLAY_TIMEOUT_MS = 500


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Events of one engine step, stamped with wall-clock time."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three KV cache events (tagged by class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one sequence entered the prefix cache."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted."""

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset."""


class KVEventBatch(EventBatch):
    """A batch of KV cache events (what the publisher sends)."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(
    event: core_events.KVCacheEvent, token_ids: bool = True
) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """The msgspec struct of one core event (group 0 leaves group_idx out, as vLLM does).

    token_ids=False: a BlockStored without its token ids and extra keys (hashes only).
    """
    if isinstance(event, core_events.BlockStored):
        extra = event.extra_keys if token_ids else None
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids) if token_ids else [],
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=list(extra) if extra is not None else None,
            group_idx=event.group_id or None,
        )
    if isinstance(event, core_events.BlockRemoved):
        return BlockRemoved(list(event.block_hashes), event.medium, event.group_id or None)
    return AllBlocksCleared()


def make_batch(
    events: Iterable[core_events.KVCacheEvent],
    data_parallel_rank: int | None = None,
    token_ids: bool = True,
) -> KVEventBatch:
    """A wire batch of core events, stamped now (token_ids=False: hashes only, see to_wire)."""
    wire = [to_wire(e, token_ids) for e in events]
    return KVEventBatch(time.time(), wire, data_parallel_rank)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes of a batch."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from msgpack bytes."""
    return _decoder.decode(payload)


def _binds(endpoint: str) -> bool:
    # NOTE: vLLM's convention: a wildcard, ipc or inproc address binds; a host address connects.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes KV event batches on a PUB socket from a background thread, with replay.

    `publish(events)` never blocks the engine: it queues the batch; the thread stamps it with
    the next sequence number, sends it and keeps the last `buffer_steps` batches for replay.
    With ``curve`` both sockets are servers of the deployment (only its clients read);
    ``token_ids=False`` publishes block hashes without token ids.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = None,
        hwm: int = 100_000,
        curve: CurveKeys | None = None,
        token_ids: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.token_ids = token_ids
        self.replay_endpoint = replay_endpoint
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        if curve is not None:
            secure_server(self._pub, curve, endpoint)
        try:
            if _binds(endpoint):
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                if curve is not None:
                    secure_server(self._replay, curve, replay_endpoint)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events-pub", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[core_events.KVCacheEvent] | KVEventBatch) -> None:
        """Queue one batch (core events, or a ready KVEventBatch); empty lists are dropped."""
        if self._closed:
            raise RuntimeError("the KV event publisher is shut down")
        if not isinstance(events, KVEventBatch):
            if not events:
                return
            events = make_batch(events, self.data_parallel_rank, self.token_ids)
        self._queue.put(events)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued, stop the thread and close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    try:
                        self._answer_replay()
                    except Exception:  # NOTE: one bad request never stops the publisher
                        logger.exception("answering a KV event replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode_batch(batch)
            seq = self.next_seq
            self.next_seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        client = frames[0]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            # NOTE: answered (an empty replay), so a peer waiting on it does not hang.
            logger.warning("malformed replay request (%d frames): answered empty", len(frames))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
            return
        start_seq = int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


class ZmqEventSubscriber:
    """Receives a publisher's batches in order; asks its replay socket for any it missed.

    With a replay endpoint, the first poll fetches every batch the publisher still buffers (a
    subscriber that joins late, or after a quiet spell, would otherwise never see a gap). With
    ``curve`` its sockets are the deployment's clients (the publisher's must be servers).
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        hwm: int = 100_000,
        curve: CurveKeys | None = None,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._curve = curve
        self._sub = self._ctx.socket(zmq.SUB)
        if curve is not None:
            secure_client(self._sub, curve, endpoint)
        # NOTE: the default receive HWM (1,000 messages) dropped the newest batches while the
        # router did not poll (a replica publishes up to one batch per step); match the PUB's.
        self._sub.set_hwm(hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self.last_seq = -1
        self.num_missed = 0
        self._caught_up = replay_endpoint is None

    def poll(self, timeout_ms: int = 0) -> list[KVEventBatch]:
        """Batches that arrived (waiting up to timeout_ms for the first), oldest first."""
        out: list[KVEventBatch] = []
        wait = timeout_ms
        if not self._caught_up:
            self._caught_up = True
            out.extend(self._replay(0, None))
        while self._sub.poll(wait):
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                out.extend(self._replay(self.last_seq + 1, seq))
            out.append(decode_batch(payload))
            self.last_seq = seq
            wait = 0
        return out

    def catch_up(self, newest_seq: int) -> list[KVEventBatch]:
        """Batches up to newest_seq (the publisher says it sent it): polled, then replayed.

        A lost batch is seen as a gap only when a later one arrives; this finds the loss of the
        last ones, after which nothing more may come.
        """
        out = self.poll(0)
        if newest_seq > self.last_seq:
            out.extend(self._replay(self.last_seq + 1, newest_seq + 1))
            self.last_seq = newest_seq
        return out

    def _replay(self, start: int, stop: int | None) -> list[KVEventBatch]:
        """Batches [start, stop) from the replay socket (those it no longer has are missed).

        stop=None: everything buffered from start on; last_seq moves to the newest one.
        """
        got: list[KVEventBatch] = []
        newest = start - 1
        if self._replay_endpoint is not None:
            # NOTE: a DEALER, not a REQ: the answer is many messages, and REQ takes only one.
            req = self._ctx.socket(zmq.DEALER)
            req.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
            # NOTE: a send blocks for good once a failed handshake (a wrong secret) dropped the
            # peer; the router must not stall on it.
            req.setsockopt(zmq.SNDTIMEO, REPLAY_TIMEOUT_MS)
            req.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                secure_client(req, self._curve, self._replay_endpoint)
            try:
                req.connect(self._replay_endpoint)
                req.send_multipart((b"", start.to_bytes(8, "big")))
                while True:
                    _, seq_bytes, payload = req.recv_multipart()
                    if seq_bytes == END_SEQ:
                        break
                    seq = int.from_bytes(seq_bytes, "big")
                    if seq >= start and (stop is None or seq < stop):
                        got.append(decode_batch(payload))
                        newest = max(newest, seq)
            except zmq.ZMQError as exc:
                logger.warning("KV event replay from %s failed: %s", self._replay_endpoint, exc)
            finally:
                req.close()
        if stop is None:
            self.num_missed += (newest + 1 - start) - len(got)
            self.last_seq = max(self.last_seq, newest)
        else:
            self.num_missed += (stop - start) - len(got)
        return got

    def close(self) -> None:
        """Close the socket."""
        self._sub.close(linger=0)
