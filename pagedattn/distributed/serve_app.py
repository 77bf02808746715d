"""`pagedattn serve --data-parallel-size N`: N engine replicas as one Ray Serve application.

Layout: an `OpenAIIngress` deployment (FastAPI, the same endpoints as `pagedattn serve`)
authenticates, derives the tenant's cache salt, tokenizes the prompt and hashes its blocks the way
the engine does, then calls the `EngineReplica` deployment through a handle whose request router
is `PagedRequestRouter` (prefix-aware, pow2 or round robin). Replicas and the ingress share the
server secret, so a tenant's salt, and so its block hashes, are the same everywhere.
"""

# NOTE: no `from __future__ import annotations`: serve.ingress pickles the class as it is
# defined, and FastAPI must see real annotation objects (Request, the body models), not strings.
import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from pagedattn.distributed.metrics_merge import merge_metrics
from pagedattn.distributed.replica import CHAT, COMPLETION, EngineReplica
from pagedattn.distributed.router import (
    DEFAULT_IMBALANCE_RATIO,
    DEFAULT_IMBALANCE_THRESHOLD,
    RequestHasher,
)
from pagedattn.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)

logger = logging.getLogger(__name__)

APP_NAME = "pagedattn"
ROUTER_CLASS = "pagedattn.distributed.serve_router.PagedRequestRouter"
DISCONNECT_POLL_S = 0.5
CLIENT_CLOSED_REQUEST = 499

api = FastAPI(title="pagedattn (Ray Serve replicas)")


def _install_handlers(app: FastAPI) -> None:
    from pagedattn.entrypoints.openai import server

    server._install_error_handlers(app)


_install_handlers(api)


def _replica_failed(exc: BaseException) -> dict[str, Any]:
    message = (
        f"the engine replica serving this request failed ({type(exc).__name__}: {exc}); "
        "Ray Serve restarts it: retry the request"
    )
    return {"status": 503, "body": error_body(message, "server_error", code="replica_failed")}


def _error_event(payload: dict[str, Any]) -> str:
    import json

    return f"data: {json.dumps(payload['body'])}\n\n"


async def _await(response):
    return await response


def _routers():
    from pagedattn.distributed.serve_router import ACTIVE_ROUTERS

    return list(ACTIVE_ROUTERS)


# NOTE: every name the class uses is defined above it: serve.ingress pickles it right here.
@serve.ingress(api)
class OpenAIIngress:
    """The OpenAI endpoints in front of the engine replicas (one handle, our request router)."""

    def __init__(
        self,
        engine: DeploymentHandle,
        model: str | None,
        block_size: int,
        hash_seed: str,
        api_keys: Sequence[str] | None,
        secret: bytes,
    ) -> None:
        from pagedattn.entrypoints.openai.server import TenantAuth
        from pagedattn.model.loader import resolve_checkpoint

        self.engine = engine
        self.stream_engine = engine.options(stream=True)
        self.auth = TenantAuth(api_keys, secret=secret)
        self.hasher = RequestHasher(resolve_checkpoint(model).tokenizer(), block_size, hash_seed)

    # ---- routing inputs -------------------------------------------------------------------

    def _routing_hashes(self, kind: str, body: CompletionRequest | ChatCompletionRequest, salt):
        try:
            if kind == CHAT:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                tokens = self.hasher.chat_token_ids(messages)
            else:
                prompt = body.prompt
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]  # NOTE: a batch of prompts is routed by its first one.
                tokens = self.hasher.prompt_token_ids(prompt)
        except Exception:
            return []  # the replica reports the bad prompt; route it anywhere
        return self.hasher.block_hashes(tokens, salt)

    async def _serve(self, kind: str, body, raw: Request) -> Response:
        salt = self.auth.cache_salt(
            self.auth.authenticate(raw.headers.get("authorization")), body.cache_salt
        )
        payload = await raw.json()
        hashes = self._routing_hashes(kind, body, salt)
        if body.stream:
            return await self._stream(kind, payload, salt, hashes)
        call = self.engine.generate.remote(kind, payload, salt, routing_hashes=hashes)
        task = asyncio.ensure_future(_await(call))
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await raw.is_disconnected():
                call.cancel()
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            result = task.result()
        except Exception as exc:
            result = _replica_failed(exc)
        return JSONResponse(result["body"], status_code=result["status"])

    async def _stream(self, kind: str, payload: dict, salt, hashes) -> Response:
        gen = self.stream_engine.generate_stream.remote(kind, payload, salt, routing_hashes=hashes)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = {"status": 500, "body": error_body("empty response", "server_error")}
        except Exception as exc:
            first = _replica_failed(exc)
        if isinstance(first, dict):
            return JSONResponse(first["body"], status_code=first["status"])

        async def events() -> AsyncIterator[str]:
            try:
                yield first
                async for chunk in gen:
                    yield chunk
            except Exception as exc:
                # NOTE: the replica died mid-stream: end the stream with an error, never hang.
                yield _error_event(_replica_failed(exc))
                yield "data: [DONE]\n\n"
            finally:
                gen.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- endpoints --------------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        return await self._serve(COMPLETION, body, raw)

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        return await self._serve(CHAT, body, raw)

    @api.get("/v1/models")
    async def models(self, raw: Request) -> Response:
        self.auth.authenticate(raw.headers.get("authorization"))
        return JSONResponse(await self.engine.models.remote())

    @api.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(_await(self.engine.models.remote()), timeout=10.0)
        except Exception as exc:
            body = error_body(f"no engine replica answers: {exc}", "server_error")
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @api.get("/metrics")
    async def metrics(self) -> Response:
        pages = {uid: s.get("metrics", "") for uid, s in (await self.replica_stats()).items()}
        return Response(merge_metrics(pages), media_type="text/plain; version=0.0.4")

    @api.get("/debug/replicas")
    async def replicas(self, raw: Request) -> Response:
        self.auth.authenticate(raw.headers.get("authorization"))
        await self._ensure_router()
        out = {}
        for router in _routers():
            view = router.index_view()
            for uid, stats in router.replica_stats().items():
                stats.pop("metrics", None)
                stats.update(view.get(uid, {}))
                out[uid] = stats
        return JSONResponse(out)

    @api.get("/debug/router")
    async def router(self, raw: Request) -> Response:
        self.auth.authenticate(raw.headers.get("authorization"))
        await self._ensure_router()
        return JSONResponse({"routers": [router.policy_counters() for router in _routers()]})

    async def _ensure_router(self) -> None:
        # NOTE: a handle builds its request router on its first call.
        if not _routers():
            with contextlib.suppress(Exception):
                await self.engine.models.remote()

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Latest routing stats of every live replica, as this process's routers see them."""
        await self._ensure_router()
        out: dict[str, dict[str, Any]] = {}
        for router in _routers():
            out.update(router.replica_stats())
        return out


def build_app(
    engine_config,
    num_replicas: int,
    router: str = "prefix",
    api_keys: Sequence[str] | None = None,
    secret: bytes | None = None,
    served_model_name: str | None = None,
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
    imbalance_ratio: float = DEFAULT_IMBALANCE_RATIO,
    events_host: str | None = None,
    replica_num_cpus: float = 1.0,
    max_ongoing_requests: int = 256,
    routing_stats_period_s: float = 1.0,
    graceful_shutdown_timeout_s: float = 30.0,
    health_check_period_s: float = 2.0,
    seed: int | None = None,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
):
    """The Ray Serve application: `serve.run(build_app(...))`."""
    secret = secret if secret is not None else secrets.token_bytes(32)
    router_config = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={
            "policy": router,
            "imbalance_threshold": imbalance_threshold,
            "imbalance_ratio": imbalance_ratio,
            "seed": seed,
        },
        request_routing_stats_period_s=routing_stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 2 * routing_stats_period_s),
    )
    engine = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_num_cpus},
        request_router_config=router_config,
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=30.0,
    ).bind(
        engine_config,
        served_model_name,
        events_host,
        None,
        kv_events_endpoint,
        kv_events_replay_endpoint,
    )
    ingress = serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        num_replicas=1,
        max_ongoing_requests=4 * max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
    )
    return ingress.bind(
        engine,
        engine_config.model.model,
        engine_config.cache.block_size,
        engine_config.cache.hash_seed,
        list(api_keys or []),
        secret,
    )


def run_replicas(args, engine_config) -> int:
    """`pagedattn serve --data-parallel-size N`: serve until SIGTERM/SIGINT, drain, return 0.

    Starts a local Ray instance unless `--ray-address` names a cluster; on a signal the app is
    deleted (replicas finish in-flight requests for up to --shutdown-timeout seconds), then Ray
    is stopped if this command started it.
    """
    import os
    import signal
    import threading

    import ray

    from pagedattn.distributed.args import validate_distributed_args
    from pagedattn.entrypoints.openai.server import _keys_from_env

    validate_distributed_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    num_replicas = args.data_parallel_size
    env = {k: v for k, v in os.environ.items() if k.startswith(("PAGEDATTN_", "HF_"))}
    env.update({k: os.environ[k] for k in ("TRANSFORMERS_OFFLINE",) if k in os.environ})
    if args.ray_address is None:
        num_cpus = max(os.cpu_count() or 1, int(num_replicas * args.replica_cpus + 0.999))
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
    else:
        ray.init(address=args.ray_address, runtime_env={"env_vars": env})
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        # NOTE: one HTTP proxy, on the head node: the endpoint is --host:--port of the head (a
        # proxy on every node would also collide on the port when two nodes share a machine).
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
        app = build_app(
            engine_config,
            num_replicas,
            router=args.router,
            api_keys=list(args.api_key or []) or _keys_from_env(),
            served_model_name=args.served_model_name,
            imbalance_threshold=args.router_imbalance_threshold,
            replica_num_cpus=args.replica_cpus,
            graceful_shutdown_timeout_s=args.shutdown_timeout,
            kv_events_endpoint=getattr(args, "kv_events_endpoint", None),
            kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        )
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        logger.info(
            "serving %d replicas (router %s) on http://%s:%d",
            num_replicas,
            args.router,
            args.host,
            args.port,
        )
        while not stop.wait(1.0):
            pass
        logger.info("signal received: draining in-flight requests, then stopping")
        serve.delete(APP_NAME)
        if args.ray_address is None:
            serve.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pagedattn.distributed.serve_app --data-parallel-size N ...` (serve's options)."""
    import argparse
    import os

    from pagedattn.config import EngineConfig
    from pagedattn.distributed.args import add_distributed_args
    from pagedattn.entrypoints.args import add_serve_args

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="pagedattn serve", description=__doc__)
    add_serve_args(parser)
    if "--data-parallel-size" not in parser._option_string_actions:
        add_distributed_args(parser)
    args = parser.parse_args(argv)
    return run_replicas(args, EngineConfig.from_cli(args))


if __name__ == "__main__":
    raise SystemExit(main())
