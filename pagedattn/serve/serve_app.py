"""`pagedattn serve --data-parallel-size N`: N engine replicas as one Ray Serve application.

Layout: an `OpenAIIngress` deployment (FastAPI, the same endpoints as `pagedattn serve`)
authenticates, derives the tenant's cache salt, tokenizes the prompt and hashes its blocks the way
the engine does, then calls the `EngineReplica` deployment through a handle whose request router
is `PagedRequestRouter` (prefix-aware, pow2 or round robin). Replicas and the ingress share the
server secret, so a tenant's salt, and so its block hashes, are the same everywhere.
"""

# NOTE: no postponed annotations here: the endpoint functions may reach a Ray replica pickled by
# value, where FastAPI could not resolve a string annotation (the body became a query parameter).

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from pagedattn.entrypoints.openai import agent_routes
from pagedattn.entrypoints.openai.http import (
    CLIENT_CLOSED_REQUEST,
    TenantAuth,
    error_payload,
    internal_error,
    make_app,
    tenant_of,
    tenant_salt_secret,
    until_disconnect,
)
from pagedattn.entrypoints.openai.preprocess import check_prompt_chars, default_max_prompt_chars
from pagedattn.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from pagedattn.entrypoints.openai.worker_pool import WorkerPool
from pagedattn.entrypoints.serve_config import (
    DEFAULT_HEALTH_STALL_S,
    DEFAULT_MAX_REQUEST_BYTES,
    ServeConfig,
)
from pagedattn.serve.ingress_debug import install_debug_routes
from pagedattn.serve.metrics_merge import merge_metrics
from pagedattn.serve.replica import CHAT, COMPLETION, EngineReplica
from pagedattn.serve.router import DEFAULT_IMBALANCE_RATIO, RequestHasher

logger = logging.getLogger(__name__)

APP_NAME = "pagedattn"
ROUTER_CLASS = "pagedattn.serve.serve_router.PagedRequestRouter"
# Routing hashes cover the prompt's first this-many characters: prefix affinity needs only the
# leading blocks, and hashing a 20 MB prompt would hold a worker for seconds.
ROUTING_PREFIX_CHARS = 8192
# How long /health waits for a replica to answer.
HEALTH_TIMEOUT_S = 10.0


async def _answer(call, raw: Request) -> Response:
    """A replica call's (status, body) as a response; the call is cancelled if the client
    leaves first."""
    answered, _ = await until_disconnect(_await(call), raw, on_disconnect=call.cancel)
    if not answered:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        result = await call
    except Exception as exc:
        result = _replica_failed(exc)
    return JSONResponse(result["body"], status_code=result["status"])


def _replica_failed(exc: BaseException) -> dict[str, Any]:
    # NOTE: Ray's exception text names the actor id, pid and node address: log it, never send it.
    message = internal_error(exc, "the engine replica serving this request failed")
    body = error_body(f"{message}; Ray Serve restarts it: retry", "server_error")
    body["error"]["code"] = "replica_failed"
    return {"status": 503, "body": body}


def _error_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload['body'])}\n\n"


async def _await(response):
    return await response


def _routers():
    from pagedattn.serve.serve_router import ACTIVE_ROUTERS

    return list(ACTIVE_ROUTERS)


def _num_prompt_chars(kind: str, body: CompletionRequest | ChatCompletionRequest) -> int:
    if kind == CHAT:
        return sum(len(m.text()) for m in body.messages)
    prompt = body.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return max((len(p) for p in prompt if isinstance(p, str)), default=0)


@serve.ingress()
class OpenAIIngress:
    """The OpenAI endpoints in front of the engine replicas (one handle, our request router).

    Its app is built per replica (`__serve_build_asgi_app__`) on the shared HTTP layer: the key is
    checked, then the body size capped, before the body is read. The prompt's size is checked
    before routing, and routing hashes are computed on a worker thread over a bounded prefix.
    """

    def __init__(
        self,
        engine: DeploymentHandle,
        model: str | None,
        block_size: int,
        hash_seed: str,
        api_keys: Sequence[str] | None,
        secret: bytes,
        max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
        max_prompt_chars: int | None = None,
        metrics_public: bool = False,
        health_stall_s: float = DEFAULT_HEALTH_STALL_S,
        cpu_slots: tuple | None = None,
        deployment_secret: bytes | None = None,
        admin_keys: Sequence[str] | None = None,
    ) -> None:
        """cpu_slots: (parsed cpu_bind, slots, threads per slot): run on those slots' CPUs (PD:
        the prefill replicas', so the decode replicas' cores serve decode steps only).
        deployment_secret: what this process's router reads the replicas' KV events with."""
        from pagedattn.distributed.cpu_bind import bind_to_slots
        from pagedattn.model.loader import resolve_checkpoint
        from pagedattn.serve.serve_router import use_deployment_secret

        if deployment_secret is not None:
            use_deployment_secret(deployment_secret)

        self.cpus = bind_to_slots(*cpu_slots) if cpu_slots else None
        self.engine = engine
        self.stream_engine = engine.options(stream=True)
        self.auth = TenantAuth(api_keys, secret=secret, admin_keys=admin_keys)
        self.hasher = RequestHasher(resolve_checkpoint(model).tokenizer(), block_size, hash_seed)
        self.max_request_bytes = max_request_bytes
        self.max_prompt_chars = max_prompt_chars
        self.max_model_len: int | None = None
        # The default character cap, computed on the first request (max_model_len is then known).
        self.default_prompt_chars: int | None = None
        self.metrics_public = metrics_public
        self.health_stall_s = health_stall_s
        self.route_pool = WorkerPool("pagedattn-route", 2)
        from pagedattn import envs

        self.trace_hops = envs.PAGEDATTN_TRACE_HOPS

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self)

    # ---- routing inputs -------------------------------------------------------------------

    async def check_prompt(self, kind: str, body) -> None:
        """Refuse a prompt over the character cap before any routing work is done."""
        if self.max_model_len is None:
            card = (await self.engine.models.remote())["data"][0]
            self.max_model_len = int(card["max_model_len"])
        limit = self.max_prompt_chars or self.default_prompt_chars
        if not limit:
            # NOTE: listing the vocabulary takes ~80 ms: once, on a worker. Done on the event
            # loop for every request, it held up every stream's tokens (docs/scaling.md, PD).
            limit = await self.route_pool.run(
                default_max_prompt_chars, self.hasher.tokenizer, self.max_model_len
            )
            self.default_prompt_chars = limit
        param = "messages" if kind == CHAT else "prompt"
        check_prompt_chars(_num_prompt_chars(kind, body), limit, self.max_model_len, param)

    def routing_hashes(self, kind: str, body, salt) -> list:
        """Block hashes of the prompt's first ROUTING_PREFIX_CHARS characters (a worker thread)."""
        try:
            if kind == CHAT:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                text = self.hasher.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
                tokens = self._prefix_ids(text, add_special_tokens=False)
            else:
                prompt = body.prompt
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]  # NOTE: a batch of prompts is routed by its first one.
                if isinstance(prompt, str):
                    tokens = self._prefix_ids(prompt, add_special_tokens=True)
                else:
                    tokens = list(prompt[:ROUTING_PREFIX_CHARS])
        except Exception:
            return []  # the replica reports the bad prompt; route it anywhere
        return self.hasher.block_hashes(tokens, salt)

    def _prefix_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self.hasher.tokenizer.encode(
            text[:ROUTING_PREFIX_CHARS], add_special_tokens=add_special_tokens
        )
        ids = list(ids)
        if len(text) > ROUTING_PREFIX_CHARS:
            ids = ids[:-1]  # NOTE: the cut may split the last token differently from the whole
        return ids

    # ---- requests -------------------------------------------------------------------------

    async def serve(self, kind: str, body, raw: Request) -> Response:
        owner = tenant_of(raw)
        salt = self.auth.cache_salt(owner, body.cache_salt)
        await self.check_prompt(kind, body)
        hashes = await self.route_pool.run(self.routing_hashes, kind, body, salt)
        payload = await raw.json()
        if body.stream:
            return await self._stream(kind, payload, salt, hashes, owner)
        call = self.engine.generate.remote(kind, payload, salt, routing_hashes=hashes, owner=owner)
        return await _answer(call, raw)

    async def forward(self, kind: str, body, raw: Request) -> Response:
        """An agent-API request (agent_routes: tokenize, detokenize, embeddings) to a replica."""
        owner = tenant_of(raw)
        salt = self.auth.cache_salt(owner, getattr(body, "cache_salt", None))
        call = self.engine.generate.remote(kind, await raw.json(), salt, owner=owner)
        return await _answer(call, raw)

    async def chat_backend(self, payload: dict, raw: Request):
        """/v1/responses' chat handler: a chat body (or its events) from a replica; errors raise."""
        body = agent_routes.validated(ChatCompletionRequest, payload)
        owner = tenant_of(raw)
        salt = self.auth.cache_salt(owner, body.cache_salt)
        await self.check_prompt(CHAT, body)
        hashes = await self.route_pool.run(self.routing_hashes, CHAT, body, salt)
        if not body.stream:
            result = await self.engine.generate.remote(
                CHAT, payload, salt, routing_hashes=hashes, owner=owner
            )
            return agent_routes.body_or_raise(result)
        gen = self.stream_engine.generate_stream.remote(
            CHAT, payload, salt, routing_hashes=hashes, owner=owner
        )
        first = await gen.__anext__()
        if isinstance(first, dict):
            gen.cancel()
            return agent_routes.body_or_raise(first)

        async def events() -> AsyncIterator[str]:
            try:
                yield first
                async for chunk in gen:
                    yield chunk
            finally:
                gen.cancel()

        return events()

    async def _stream(self, kind: str, payload: dict, salt, hashes, owner) -> Response:
        gen = self.stream_engine.generate_stream.remote(
            kind, payload, salt, routing_hashes=hashes, owner=owner
        )
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = error_payload(RuntimeError("the replica sent an empty response"))
        except Exception as exc:
            first = _replica_failed(exc)
        if isinstance(first, dict):
            return JSONResponse(first["body"], status_code=first["status"])

        trace = self.trace_hops

        async def events() -> AsyncIterator[str]:
            try:
                yield first
                async for chunk in gen:
                    # PAGEDATTN_TRACE_HOPS: when this ingress forwarded the event.
                    yield f": hop i={time.monotonic():.6f}\n{chunk}" if trace else chunk
            except Exception as exc:
                # NOTE: the replica died mid-stream: end the stream with an error, never hang.
                yield _error_event(_replica_failed(exc))
                yield "data: [DONE]\n\n"
            finally:
                gen.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(self) -> Response:
        reasons = []
        stuck = self.route_pool.oldest_running_s()
        if stuck > self.health_stall_s:
            reasons.append(f"a {self.route_pool.name} job has run for {stuck:.0f} s")
        try:
            call = self.engine.health.remote(self.health_stall_s)
            reasons += await asyncio.wait_for(_await(call), timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:
            logger.warning("health: no engine replica answers: %r", exc)
            body = error_body("no engine replica answers", "server_error")
            return JSONResponse(body, status_code=503)
        if reasons:
            return JSONResponse({"status": "degraded", "reasons": reasons}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ensure_router(self) -> None:
        # NOTE: a handle builds its request router on its first call.
        if not _routers():
            try:
                await self.engine.models.remote()
            except Exception as exc:
                logger.warning("no replica answered while building the router: %r", exc)

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Latest routing stats of every live replica, as this process's routers see them."""
        await self.ensure_router()
        out: dict[str, dict[str, Any]] = {}
        for router in _routers():
            out.update(router.replica_stats())
        return out


def build_ingress_app(ingress: OpenAIIngress) -> FastAPI:
    """The ingress's FastAPI app: the same guard and error mapping as `pagedattn serve`."""
    api = make_app(
        "pagedattn (Ray Serve replicas)",
        ingress.auth,
        max_request_bytes=ingress.max_request_bytes,
        metrics_public=ingress.metrics_public,
    )

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await ingress.serve(COMPLETION, body, raw)

    @api.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        return await ingress.serve(CHAT, body, raw)

    @api.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(await ingress.engine.models.remote())

    @api.get("/health")
    async def health() -> Response:
        return await ingress.health()

    @api.get("/metrics")
    async def metrics() -> Response:
        stats = await ingress.replica_stats()
        pages = {uid: s.get("metrics", "") for uid, s in stats.items()}
        return Response(merge_metrics(pages), media_type="text/plain; version=0.0.4")

    install_debug_routes(api, ingress, _routers)  # /debug/replicas, /debug/kv, /dashboard
    # /tokenize, /detokenize, /v1/embeddings, /v1/responses: the single server's handlers.
    agent_routes.install_agent_routes(
        api, ingress.forward, ingress.chat_backend, agent_routes.ResponsesAPI()
    )
    api.add_middleware(RayDisconnectMiddleware)
    return api


class RayDisconnectMiddleware:
    """Ray Serve's proxy cancels a replica's `receive()` when the client goes
    (`TaskCancelledError`); to the app that is a disconnect, not an internal error."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from ray.exceptions import TaskCancelledError

        async def receive_or_disconnect():
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


def build_app(
    engine_config,
    serve_config: ServeConfig,
    *,
    secret: bytes | None = None,
    imbalance_ratio: float = DEFAULT_IMBALANCE_RATIO,
    max_ongoing_requests: int = 256,
    routing_stats_period_s: float = 1.0,
    health_check_period_s: float = 2.0,
    seed: int | None = None,
    cpu_bind: str | None = None,
    deployment_secret: bytes | None = None,
):
    """The Ray Serve application: `serve.run(build_app(engine_config, serve_config))`.

    ``serve_config``: `pagedattn serve`'s options (replicas: its data_parallel_size; router,
    keys, limits, tool and reasoning parsers). The keywords tune what no flag sets: ``secret``
    (the tenant secret; default: a fresh one), the router's ``imbalance_ratio`` and ``seed``,
    Ray Serve's periods. ``cpu_bind`` (default: PAGEDATTN_CPU_BIND, ``auto``) gives each replica
    CPUs of its own on a shared node (distributed/cpu_bind.py). ``deployment_secret`` (default:
    a fresh one, handed to the replicas and the ingress's router) authenticates the replicas'
    KV event sockets.
    """
    from pagedattn.distributed.zmq_auth import new_deployment_secret

    deployment_secret = deployment_secret or new_deployment_secret()
    router_config = make_router_config(
        routing_stats_period_s,
        policy=serve_config.router,
        imbalance_threshold=serve_config.router_imbalance_threshold,
        imbalance_ratio=imbalance_ratio,
        seed=seed,
    )
    num_cpus = serve_config.replica_cpus
    engine = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=serve_config.data_parallel_size,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus},
        **tensor_parallel_placement(engine_config.tensor_parallel_size, num_cpus),
        request_router_config=router_config,
        graceful_shutdown_timeout_s=serve_config.shutdown_timeout,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=30.0,
    ).bind(
        engine_config,
        serve_config,
        serve_config.kv_transfer_host,
        None,
        None,  # NOTE: the replica publishes on the engine's --kv-events-endpoint, port + rank
        serve_config.kv_events_replay_endpoint,
        replica_cpu_bind(cpu_bind),
        0,
        deployment_secret=deployment_secret,
    )
    return bind_ingress(
        engine,
        engine_config,
        serve_config,
        secret,
        max_ongoing_requests,
        deployment_secret=deployment_secret,
    )


def replica_cpu_bind(cpu_bind: str | None):
    """The parsed CPU binding for replicas: cpu_bind, else PAGEDATTN_CPU_BIND (read here, in
    the driver, so replicas on other nodes see the same setting)."""
    from pagedattn import envs
    from pagedattn.distributed.cpu_bind import parse_cpu_bind

    return parse_cpu_bind(envs.PAGEDATTN_CPU_BIND if cpu_bind is None else cpu_bind)


def make_router_config(period_s: float, **policy_kwargs: Any) -> RequestRouterConfig:
    """Ray Serve's config for our request router (ROUTER_CLASS) with these policy arguments."""
    return RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs=policy_kwargs,
        request_routing_stats_period_s=period_s,
        request_routing_stats_timeout_s=max(5.0, 2 * period_s),
    )


def bind_ingress(
    backend,
    engine_config,
    serve_config: ServeConfig,
    secret: bytes | None,
    max_ongoing_requests: int,
    **ingress_options: Any,
):
    """The OpenAIIngress deployment in front of `backend` (the replicas that serve requests),
    with serve_config's keys and limits; a fresh tenant secret unless one is given."""
    ingress = serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        num_replicas=1,
        max_ongoing_requests=4 * max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=serve_config.shutdown_timeout,
    )
    return ingress.bind(
        backend,
        engine_config.model.model,
        engine_config.cache.block_size,
        engine_config.cache.hash_seed,
        serve_config.api_keys(),
        secret if secret is not None else tenant_salt_secret(),
        max_request_bytes=serve_config.max_request_bytes,
        max_prompt_chars=serve_config.max_prompt_chars,
        metrics_public=serve_config.metrics_public,
        health_stall_s=serve_config.health_stall_s,
        admin_keys=serve_config.admin_keys(),
        **ingress_options,
    )


def tensor_parallel_placement(tensor_parallel_size: int, num_cpus: float) -> dict:
    """Deployment options that reserve a replica's tensor-parallel ranks on one node.

    NOTE: one bundle per rank, STRICT_PACK: Ray puts a replica's bundles on one node (the
    replica actor takes the first); its rank processes (worker.tp_executor) start there and use
    the others' CPUs. Replicas land on whichever nodes have room for all their bundles.
    """
    if tensor_parallel_size == 1:
        return {}
    return {
        "placement_group_bundles": [{"CPU": num_cpus}] * tensor_parallel_size,
        "placement_group_strategy": "STRICT_PACK",
    }


def replica_env() -> dict[str, str]:
    """The variables this process hands on to Ray's workers (PAGEDATTN_*, HF_*)."""
    import os

    env = {k: v for k, v in os.environ.items() if k.startswith(("PAGEDATTN_", "HF_"))}
    env.update({k: os.environ[k] for k in ("TRANSFORMERS_OFFLINE",) if k in os.environ})
    return env
