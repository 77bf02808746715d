"""The OpenAI-compatible HTTP server: `build_app`, `run_server`, and `pagedattn serve` options.

Trust model for tenants and the prefix cache:
- Without `--api-key` the server is open and every client shares one prefix-cache namespace,
  unless a request sends `cache_salt`. A client-sent salt is only as secret as the client keeps
  it: anyone who sends the same salt shares (and can probe, by cache hits or TTFT) that namespace.
- With `--api-key` (one or more) every request except `/health` and `/dashboard` (and
  `/metrics` with `--metrics-public`) must send `Authorization: Bearer <key>` (else 401).
  The key is checked before the body is read (http.py's guard middleware, shared with the Ray
  Serve ingress), and bodies over `--max-request-bytes` are refused with 413 whether they
  declare a Content-Length or stream.
  Each key gets its own namespace: the salt passed to the engine is HMAC-SHA256(server secret,
  key), which a client cannot choose or forge. A `cache_salt` sent with a key only splits that
  key's namespace further (HMAC of key salt and client salt), so no tenant can name another
  tenant's namespace. Clients sharing a key share a namespace.
- The server secret is random per process; the prefix cache does not outlive the process.
- `/health` and `/dashboard` need no key. `/metrics` needs one when keys are set, unless
  `--metrics-public`. `/debug/kv` needs a key when keys are set and shows the caller's own
  requests (ids, token counts, block tables) and only the caller's blocks in the per-block
  arrays; other tenants appear only as aggregate counts.
- `/health` answers 503 "degraded" when an engine step, or a tokenising job, has run longer
  than `--health-stall-s` (a grammar compile is killed at its deadline, so it is not counted).
- The dashboard page takes the key from its URL fragment (`/dashboard#api_key=KEY`, never
  sent to the server); query-string secrets are redacted from the access log anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedattn.config import EngineConfig
from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.entrypoints.args import HelpFormatter, add_serve_args
from pagedattn.entrypoints.openai.agent_routes import install_agent_routes, local_front_door
from pagedattn.entrypoints.openai.http import (
    CLIENT_CLOSED_REQUEST,
    TenantAuth,
    degraded_reasons,
    error_response,
    make_app,
    redact_query_secrets,
    tenant_of,
    until_disconnect,
)
from pagedattn.entrypoints.openai.kv_debug import (
    dashboard_response,
    tenant_kv_snapshot,
)
from pagedattn.entrypoints.openai.lora_routes import install_lora_routes, serving_lora
from pagedattn.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedattn.entrypoints.openai.request_checks import ignored_fields, ignored_header
from pagedattn.entrypoints.openai.responses_api import ResponsesAPI
from pagedattn.entrypoints.openai.serving import OpenAIServing
from pagedattn.entrypoints.serve_config import ServeConfig

logger = logging.getLogger(__name__)

# After --shutdown-timeout the requests still in flight get an error; this long to send it.
SHUTDOWN_FLUSH_S = 5.0
# Exit status of `pagedattn serve` after an engine fault (a supervisor should restart it).
EXIT_ENGINE_FAULT = 1
__all__ = ["TenantAuth", "build_app", "redact_query_secrets", "run_server"]


async def _respond(handler, raw: Request, headers: dict[str, str] | None = None) -> Response:
    """Run a handler; abort its requests if the client leaves before the body is ready."""
    answered, result = await until_disconnect(handler, raw)
    if not answered:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, dict):
        return JSONResponse(result, headers=headers)
    # NOTE: starlette cancels the body iterator when the client disconnects mid-stream; the
    # request streams close and abort their engine requests before the next step.
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)


def build_app(
    engine_or_async_engine,
    serve_config: ServeConfig | None = None,
    *,
    grammar_timeout_s: float | None = None,
    **options,
) -> FastAPI:
    """The FastAPI app serving one engine; the engine loop stops when the app shuts down.

    ``serve_config``: `pagedattn serve`'s options (LoRA adapters, tool and reasoning parsers,
    keys, limits: docs/agent-api.md); or ``options``, ServeConfig's fields by name
    (``build_app(engine, served_model_name="m")``), for tests and scripts. API and admin keys
    default to PAGEDATTN_API_KEY and PAGEDATTN_ADMIN_API_KEY (see TenantAuth).
    ``grammar_timeout_s``: the structured-output compile deadline (OpenAIServing's default)."""
    if serve_config is None:
        serve_config = ServeConfig(**options)
    elif options:
        raise TypeError(f"build_app: give serve_config or options, not both: {sorted(options)}")
    cfg = serve_config
    engine = engine_or_async_engine
    if not isinstance(engine, AsyncLLMEngine):
        engine = AsyncLLMEngine(engine)
    limits = {} if grammar_timeout_s is None else {"grammar_timeout_s": grammar_timeout_s}
    model_name = cfg.served_model_name or engine.model_name

    def is_admin(tenant: str | None) -> bool:
        admin_keys = getattr(auth, "admin_keys", ())  # NOTE: TenantAuth's admin keys, if any
        return tenant is not None and any(
            tenant == auth.authenticate(f"Bearer {k}") for k in admin_keys
        )

    loras = serving_lora(engine, model_name, cfg.lora_modules or (), cfg.lora_root, is_admin)
    serving = OpenAIServing(
        engine,
        model_name,
        max_prompt_chars=cfg.max_prompt_chars,
        loras=loras,
        tool_call_parser=cfg.tool_call_parser,
        enable_auto_tool_choice=cfg.enable_auto_tool_choice,
        reasoning_parser=cfg.reasoning_parser,
        **limits,
    )
    auth = TenantAuth(cfg.api_keys(), admin_keys=cfg.admin_keys())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        # NOTE: uvicorn has already waited for in-flight responses (or cancelled them, which
        # aborts their requests); this aborts whatever is left and stops the loop thread.
        engine.shutdown()
        serving.close()

    app = make_app(
        "pagedattn",
        auth,
        max_request_bytes=cfg.max_request_bytes,
        metrics_public=cfg.metrics_public,
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.serving = serving
    if cfg.enable_lora_runtime_updates:
        if loras is None:
            raise ValueError("--enable-lora-runtime-updates needs --enable-lora")
        install_lora_routes(app, loras)
    tenant = tenant_of

    @app.get("/health")
    async def health() -> Response:
        if engine.fault is not None:
            # NOTE: the fault's detail is in the log; /health is public.
            return error_response(503, "the engine stopped after a fault", "server_error")
        if not engine.is_running:
            return error_response(503, "the engine loop has stopped", "server_error")
        reasons = degraded_reasons(engine, serving.pools, cfg.health_stall_s)
        if reasons:
            body = {"status": "degraded", "reasons": reasons}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = engine.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(raw: Request) -> dict:
        return serving.models(tenant_of(raw)).model_dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        key_salt = tenant(raw)
        salt = auth.cache_salt(key_salt, body.cache_salt)
        ignored = ignored_header(ignored_fields(body))
        return await _respond(serving.create_completion(body, salt, owner=key_salt), raw, ignored)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        key_salt = tenant(raw)
        salt = auth.cache_salt(key_salt, body.cache_salt)
        ignored = ignored_header(ignored_fields(body))
        handler = serving.create_chat_completion(body, salt, owner=key_salt)
        return await _respond(handler, raw, ignored)

    run, chat_backend = local_front_door(serving, auth)
    install_agent_routes(app, run, chat_backend, ResponsesAPI())

    @app.get("/debug/kv")
    async def debug_kv(raw: Request) -> dict:
        return await tenant_kv_snapshot(engine, tenant(raw), scoped=bool(auth.api_keys))

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return dashboard_response()

    return app


class _GracefulServer(uvicorn.Server):
    """uvicorn, minus re-raising SIGINT/SIGTERM after a clean shutdown (so the exit code is 0).

    - Past the graceful-shutdown timeout, the requests still in flight get an error (a 503 JSON
      body, or an error event and `[DONE]` on a stream) instead of being cut off.
    - After an engine fault the server stops and `run()` raises SystemExit(EXIT_ENGINE_FAULT).
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        state = getattr(config.app, "state", None)
        self._engine: AsyncLLMEngine | None = getattr(state, "engine", None)
        self._drain_timeout = config.timeout_graceful_shutdown
        if self._drain_timeout is not None:
            config.timeout_graceful_shutdown = self._drain_timeout + SHUTDOWN_FLUSH_S
        if self._engine is not None:
            self._engine.add_fault_listener(self._on_fault)

    def _on_fault(self, exc: BaseException) -> None:
        logger.critical("engine fault, the server stops: %r", exc)
        self.should_exit = True

    def run(self, sockets=None) -> None:
        super().run(sockets)
        if self._engine is not None and self._engine.fault is not None:
            raise SystemExit(EXIT_ENGINE_FAULT)

    async def shutdown(self, sockets=None) -> None:
        watcher = None
        if self._engine is not None and self._drain_timeout is not None:
            watcher = asyncio.ensure_future(self._fail_in_flight_after(self._drain_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _fail_in_flight_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        logger.warning("shutdown timeout (%.1f s) passed: failing the requests in flight", delay)
        self._engine.request_stop()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_server(engine_config: EngineConfig, serve_config: ServeConfig) -> int:
    """Load the model, serve until SIGINT/SIGTERM, finish or abort in-flight requests, return 0."""
    logging.basicConfig(
        level=serve_config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    engine = LLMEngine(engine_config, verbose=True)
    config = uvicorn.Config(
        build_app(engine, serve_config),
        host=serve_config.host,
        port=serve_config.port,
        log_level=serve_config.log_level,
        timeout_graceful_shutdown=serve_config.shutdown_timeout,
    )
    _GracefulServer(config).run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pagedattn.entrypoints.openai.server --model DIR --port N`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = argparse.ArgumentParser(
        prog="pagedattn serve", description=__doc__, formatter_class=HelpFormatter
    )
    add_serve_args(parser)
    args = parser.parse_args(argv)
    serve_config = ServeConfig.from_cli(args)
    if serve_config.uses_replicas:
        parser.error("replicas (--data-parallel-size, --ray-address) run with `pagedattn serve`")
    return run_server(EngineConfig.from_cli(args), serve_config)


if __name__ == "__main__":
    raise SystemExit(main())
