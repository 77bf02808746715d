"""EngineReplica: one engine behind a Ray Serve deployment, publishing its KV cache events.

Its sockets (the router's KV event feed and replay; a PD prefill replica's BlockServer) bind to
loopback unless `--kv-transfer-host` names an address (`node`: the Ray node's, for replicas on
several nodes), and are servers of the deployment (distributed/zmq_auth.py: CURVE, or PLAIN on
loopback): only a
process holding the deployment secret, which the builder hands every replica, reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedattn.distributed.kv_events import ZmqEventPublisher
from pagedattn.distributed.zmq_auth import CurveKeys, new_deployment_secret
from pagedattn.entrypoints.serve_config import ServeConfig
from pagedattn.serve.prefix_index import hashes_digest

logger = logging.getLogger(__name__)

# How often the replica drains its engine's KV cache events and publishes them.
EVENT_DRAIN_PERIOD_S = 0.005
COMPLETION, CHAT = "completion", "chat"
EVENTS_TOPIC = "kv-events"
# A prefix-cache key ends with its KV cache group id (make_block_hash_with_group_id).
GROUP_ID_BYTES = 4
_GROUP0 = (0).to_bytes(GROUP_ID_BYTES, "big")
# Where replica sockets bind by default, and the --kv-transfer-host value for the node's address.
LOOPBACK = "127.0.0.1"
NODE_HOST = "node"
_WILDCARDS = ("0.0.0.0", "*")


def socket_hosts(host: str | None) -> tuple[str, str]:
    """(address to bind, address peers connect to) for a replica's sockets (--kv-transfer-host).

    None: loopback. ``node``: the Ray node's address. A wildcard binds every interface and is
    reached at the node's address.
    """
    if host is None:
        return LOOPBACK, LOOPBACK
    if host == NODE_HOST:
        ip = _node_ip()
        return ip, ip
    if host in _WILDCARDS:
        return "0.0.0.0", _node_ip()
    return host, host


def error_payload(exc: BaseException) -> dict[str, Any]:
    """`{"status", "body"}` for an exception, as every front door answers it (http.py)."""
    from pagedattn.entrypoints.openai.http import error_payload as payload

    return payload(exc)


class EngineReplica:
    """An AsyncLLMEngine and its OpenAIServing, driven by the ingress through a handle.

    Its KV cache events go out on a ZMQ PUB socket (vLLM's wire format, block hashes without
    token ids) bound to `tcp://<events_host>:<free port>` (events_host: see `socket_hosts`) as a
    server of `deployment_secret`; `record_routing_stats` tells the request router where,
    and how loaded the engine is. Requests are the OpenAI bodies as dicts plus the tenant's cache
    salt.
    """

    def __init__(
        self,
        engine_config,
        serve_config: ServeConfig | None = None,
        events_host: str | None = None,
        engine_factory=None,
        events_endpoint: str | None = None,
        replay_endpoint: str | None = None,
        cpu_bind=None,
        cpu_slot_base: int = 0,
        publish_kv_events: bool = True,
        deployment_secret: bytes | None = None,
    ) -> None:
        """serve_config: the served model name and the tool-call and reasoning options its
        OpenAIServing applies (default: ServeConfig()'s).
        publish_kv_events=False: no router reads this replica's cache (a PD decode replica,
        routed by load), so its engine records no KV events and no thread drains them.
        deployment_secret: the deployment's (serve_app.build_app makes one); None: a fresh one,
        which only this object holds (`self.curve`)."""
        from pagedattn.distributed.cpu_bind import bind_replica
        from pagedattn.engine.async_engine import AsyncLLMEngine
        from pagedattn.entrypoints.openai.serving import OpenAIServing

        if engine_factory is None:
            from pagedattn.engine.llm_engine import LLMEngine

            engine_factory = LLMEngine
        # NOTE: before the engine exists: its threads and the kernel tuner run on these CPUs.
        self.cpus = None
        if getattr(engine_config, "tensor_parallel_size", 1) == 1:
            self.cpus = bind_replica(
                cpu_bind, cpu_slot_base + _replica_rank(), engine_config.num_threads
            )
        cache = engine_config.cache
        if getattr(cache, "kv_events_endpoint", None) is not None:
            # NOTE: this replica publishes (rank-offset port, with replay); the engine must not
            # bind the same endpoint in every replica.
            events_endpoint = events_endpoint or cache.kv_events_endpoint
            cache = dataclasses.replace(cache, kv_events_endpoint=None)
            engine_config = dataclasses.replace(engine_config, cache=cache)
        self.llm_engine = engine_factory(engine_config)
        self.kv_cache_manager = self.llm_engine.kv_cache_manager
        # NOTE: events on after construction: the engine is not running yet, nothing is lost.
        if publish_kv_events:
            self.llm_engine.enable_kv_cache_events()
        self.engine = AsyncLLMEngine(self.llm_engine)
        self.engine.start()
        serve_config = serve_config or ServeConfig()
        self.serving = OpenAIServing(
            self.engine,
            serve_config.served_model_name or self.engine.model_name,
            tool_call_parser=serve_config.tool_call_parser,
            enable_auto_tool_choice=serve_config.enable_auto_tool_choice,
            reasoning_parser=serve_config.reasoning_parser,
        )
        self.replica_id = _replica_id()
        self.node_id = _node_id()
        self.curve = CurveKeys.from_secret(deployment_secret or new_deployment_secret())
        host, advertised = socket_hosts(events_host)
        self.bind_host, self.advertised_host = host, advertised
        rank = _replica_rank()
        self._stop = threading.Event()
        self.publisher = self.external_publisher = None
        self.events_endpoint = self.replay_endpoint = None
        if not publish_kv_events:
            return
        # The router's feed: bound here on a free port, with replay, whatever the user asked for;
        # only the deployment's clients read it, and it carries no token ids.
        self.publisher = ZmqEventPublisher(
            f"tcp://{host}:*",
            replay_endpoint=f"tcp://{host}:*",
            topic=EVENTS_TOPIC,
            curve=self.curve,
            token_ids=False,
        )
        self.events_endpoint = _advertised(self.publisher.endpoint, advertised)
        self.replay_endpoint = _advertised(self.publisher.replay_endpoint, advertised)
        # --kv-events-endpoint: the same batches for external consumers, port + rank (vLLM's rule;
        # a wildcard binds, a host address connects to the consumer).
        if events_endpoint is not None:
            self.external_publisher = ZmqEventPublisher(
                offset_endpoint_port(events_endpoint, rank),
                replay_endpoint=offset_endpoint_port(replay_endpoint, rank),
                topic=EVENTS_TOPIC,
                data_parallel_rank=rank,
            )
        self._drainer = threading.Thread(target=self._drain_events, name="kv-events", daemon=True)
        self._drainer.start()
        logger.info(
            "replica %s: KV events on %s (replay %s)",
            self.replica_id,
            self.publisher.endpoint,
            self.publisher.replay_endpoint,
        )

    def _drain_events(self) -> None:
        # NOTE: take_events swaps the queue list in one assignment; an append racing with it lands
        # in the list it returns (GIL), so no event is lost while the engine thread steps.
        while not self._stop.wait(EVENT_DRAIN_PERIOD_S):
            events = self.llm_engine.take_kv_events()
            if events:
                self.publisher.publish(events)
                if self.external_publisher is not None:
                    self.external_publisher.publish(events)

    # ---- requests ----------------------------------------------------------------------------

    async def _create(self, kind: str, body: dict, cache_salt: str | None, owner: str | None):
        from pagedattn.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

        if kind == COMPLETION:
            return await self.serving.create_completion(
                CompletionRequest.model_validate(body), cache_salt, owner
            )
        if kind == CHAT:
            return await self.serving.create_chat_completion(
                ChatCompletionRequest.model_validate(body), cache_salt, owner
            )
        from pagedattn.entrypoints.openai import agent_routes

        # /tokenize, /detokenize, /v1/embeddings (agent_routes.REQUEST_MODELS names them).
        return await agent_routes.handle(self.serving, kind, body, cache_salt, owner)

    async def generate(
        self,
        kind: str,
        body: dict,
        cache_salt: str | None = None,
        routing_hashes=None,
        owner: str | None = None,
    ) -> dict:
        """A whole response: `{"status": 200, "body": ...}` or an error payload.

        owner: the tenant that sent it (what `kv_snapshot` shows that tenant)."""
        try:
            result = await self._create(kind, body, cache_salt, owner)
            if not isinstance(result, dict):
                raise ValueError("stream=true requests go through generate_stream")
            return {"status": 200, "body": result}
        except Exception as exc:
            return error_payload(exc)

    async def generate_stream(
        self,
        kind: str,
        body: dict,
        cache_salt: str | None = None,
        routing_hashes=None,
        owner: str | None = None,
    ) -> AsyncIterator[str | dict]:
        """Server-sent events, or one error payload (a dict) if the request is rejected."""
        try:
            result = await self._create(kind, body, cache_salt, owner)
        except Exception as exc:
            yield error_payload(exc)
            return
        if isinstance(result, dict):
            yield {"status": 200, "body": result}
            return
        async for chunk in result:
            yield chunk

    async def health(self, stall_s: float) -> list[str]:
        """Why this replica cannot serve in time now (empty when healthy): see `/health`."""
        from pagedattn.entrypoints.openai.http import degraded_reasons

        if not self.engine.is_running:
            return [f"replica {self.replica_id}: the engine loop has stopped"]
        return degraded_reasons(self.engine, self.serving.pools, stall_s)

    async def models(self) -> dict:
        """The /v1/models body."""
        return self.serving.models().model_dump()

    async def kv_snapshot(
        self, owner: str | None, scoped: bool, target_replica: str | None = None
    ) -> dict:
        """This replica's /debug/kv body for the tenant `owner` (scoped: keys are set), named
        by `replica_id`. target_replica: the router sends the call there (ingress_debug.py)."""
        from pagedattn.entrypoints.openai.kv_debug import tenant_kv_snapshot

        snapshot = await tenant_kv_snapshot(self.engine, owner, scoped)
        snapshot["replica_id"] = self.replica_id
        return snapshot

    # ---- Ray Serve hooks ---------------------------------------------------------------------

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by the request router: events endpoints, load and this replica's metrics."""
        stats = self.llm_engine.scheduler
        body, _ = self.engine.metrics.render()
        cached = self.cached_block_hashes()
        return {
            "replica_id": self.replica_id,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "kv_events_endpoint": self.events_endpoint,
            "kv_events_replay_endpoint": self.replay_endpoint,
            "kv_events_topic": EVENTS_TOPIC,
            "kv_events_last_seq": None if self.publisher is None else self.publisher.next_seq - 1,
            "kv_events_external_endpoint": (
                self.external_publisher.endpoint if self.external_publisher else None
            ),
            "num_requests": _num_requests(stats),
            "num_free_blocks": self.kv_cache_manager.num_free_blocks,
            "num_usable_blocks": self.kv_cache_manager.num_usable_blocks,
            "num_cached_blocks": len(cached),
            "cached_digest": hashes_digest(cached),
            "block_size": self.kv_cache_manager.block_size,
            "hash_seed": self.kv_cache_manager.hash_seed,
            "metrics": body.decode() if isinstance(body, bytes) else body,
            "time": time.time(),
        }

    def cached_block_hashes(self) -> set[bytes]:
        """Group-0 block hashes in this replica's prefix cache now (what its events describe)."""
        keys = self.kv_cache_manager.cached_block_keys()
        return {key[:-GROUP_ID_BYTES] for key in keys if key[-GROUP_ID_BYTES:] == _GROUP0}

    def check_health(self) -> None:
        """Ray Serve's health check: a stopped engine loop makes Ray replace this replica."""
        if not self.engine.is_running:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop has stopped")

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is None or stop.is_set():
            return
        stop.set()
        self.engine.shutdown()
        if self.publisher is not None:
            self.publisher.shutdown()
        if self.external_publisher is not None:
            self.external_publisher.shutdown()


def _num_requests(scheduler) -> int:
    for name in ("get_num_unfinished_requests", "num_unfinished_requests"):
        attr = getattr(scheduler, name, None)
        if attr is not None:
            return int(attr() if callable(attr) else attr)
    return len(getattr(scheduler, "requests", ()))


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule: replica `rank` publishes on the endpoint's port + rank (ipc: a suffix)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _advertised(endpoint: str | None, host: str) -> str | None:
    if endpoint is None:
        return None
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:" + endpoint[len(wildcard) :]
    return endpoint


def _replica_rank() -> int:
    try:
        from ray import serve

        rank = serve.get_replica_context().rank
        return int(getattr(rank, "rank", rank))
    except Exception:
        return 0


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return "local"


def _node_id() -> str | None:
    try:
        import ray

        # NOTE: outside Ray, get_runtime_context() would start a local Ray instance of its own.
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
