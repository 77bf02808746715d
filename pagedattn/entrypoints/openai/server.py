"""The OpenAI-compatible HTTP server: `build_app`, `run_server`, and `pagedattn serve` options.

Trust model for tenants and the prefix cache:
- Without `--api-key` the server is open and every client shares one prefix-cache namespace,
  unless a request sends `cache_salt`. A client-sent salt is only as secret as the client keeps
  it: anyone who sends the same salt shares (and can probe, by cache hits or TTFT) that namespace.
- With `--api-key` (one or more) every request except `/health`, `/metrics` and `/dashboard`
  (so `/v1/*`, `/debug/kv`, `/docs`, `/openapi.json`) must send `Authorization: Bearer <key>`
  (else 401). The key is checked before the body is read (an ASGI middleware), and bodies over
  `--max-request-bytes` are refused with 413 whether they declare a Content-Length or stream.
  Each key gets its own namespace: the salt passed to the engine is HMAC-SHA256(server secret,
  key), which a client cannot choose or forge. A `cache_salt` sent with a key only splits that
  key's namespace further (HMAC of key salt and client salt), so no tenant can name another
  tenant's namespace. Clients sharing a key share a namespace.
- The server secret is random per process; the prefix cache does not outlive the process.
- `/health`, `/metrics` and `/dashboard` need no key: they show aggregate counters and no prompt
  content. `/debug/kv` needs a key when keys are set and shows the caller's own requests (ids,
  token counts, block tables); other tenants' requests appear only as aggregate counts. The
  dashboard page takes the key from its URL fragment (`/dashboard#api_key=KEY`, never sent to the
  server); query-string secrets are redacted from the access log anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import signal
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedattn.config import EngineConfig
from pagedattn.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.entrypoints.args import (
    DEFAULT_MAX_REQUEST_BYTES,
    HelpFormatter,
    add_serve_args,
)
from pagedattn.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from pagedattn.entrypoints.openai.serving import APIError, OpenAIServing

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
DISCONNECT_POLL_S = 0.5
# nginx's status for "the client closed the connection before the response was ready".
CLIENT_CLOSED_REQUEST = 499
# Paths served without an API key: aggregate counters and a static page, no prompt content.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/dashboard"})
# After --shutdown-timeout the requests still in flight get an error; this long to send it.
SHUTDOWN_FLUSH_S = 5.0
# Exit status of `pagedattn serve` after an engine fault (a supervisor should restart it).
EXIT_ENGINE_FAULT = 1
_SECRET_QUERY = re.compile(
    r"((?:^|[?&])(?:api[_-]?key|key|token|access_token|auth|password|secret)=)[^&#]*", re.I
)


class TenantAuth:
    """API-key checks and the prefix-cache namespace (cache salt) of each request."""

    def __init__(self, api_keys: Sequence[str] | None, secret: bytes | None = None) -> None:
        self.api_keys = [k for k in (api_keys or []) if k]
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def _hmac(self, *parts: str) -> str:
        msg = b"\0".join(p.encode() for p in parts)
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant's key salt (None on an open server); raises a 401 APIError without a key."""
        if not self.api_keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer":
            for key in self.api_keys:
                if hmac.compare_digest(token.strip().encode(), key.encode()):
                    return self._hmac("key", key)
        raise APIError(
            "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            status_code=401,
            err_type="authentication_error",
            code="invalid_api_key",
        )

    def cache_salt(self, tenant: str | None, client_salt: str | None) -> str | None:
        """The salt handed to the engine: per tenant, optionally split by the client's salt."""
        if tenant is None:
            return None if client_salt is None else self._hmac("client", client_salt)
        if client_salt is None:
            return tenant
        return self._hmac("tenant", tenant, client_salt)


def _error(status: int, message: str, err_type: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code), status_code=status)


def redact_query_secrets(path: str) -> str:
    """A request path with the values of secret-looking query parameters replaced."""
    return _SECRET_QUERY.sub(r"\1[REDACTED]", path)


class RedactSecretsFilter(logging.Filter):
    """Keeps API keys sent in a query string out of uvicorn's access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query_secrets(args[2]), *args[3:])
        return True


def _install_log_redaction() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactSecretsFilter) for f in access.filters):
        access.addFilter(RedactSecretsFilter())


class _BodyTooLarge(StarletteHTTPException):
    """Raised while reading a streamed body past the limit (FastAPI passes HTTP errors on)."""

    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        message = f"the request body is larger than this server accepts ({limit} bytes)"
        super().__init__(status_code=413, detail=message)


class GuardMiddleware:
    """Pure ASGI: the API key is checked and the body size capped before the app reads a byte.

    A `Depends` would run only after FastAPI has read and parsed the whole body.
    """

    def __init__(self, app, auth: TenantAuth, max_request_bytes: int | None) -> None:
        self.app = app
        self.auth = auth
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        tenant = None
        if scope["path"] not in PUBLIC_PATHS:
            try:
                tenant = self.auth.authenticate(headers.get("authorization"))
            except APIError as exc:
                await self._reply(send, exc.status_code, str(exc), exc.err_type, exc.code)
                return
        scope.setdefault("state", {})["tenant"] = tenant
        limit = self.max_request_bytes
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await self._too_large(send, limit)
            return
        num_bytes = 0
        started = False

        async def counted_receive():
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > limit:
                    raise _BodyTooLarge(limit)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await self._too_large(send, limit)

    async def _too_large(self, send, limit: int) -> None:
        message = f"the request body is larger than this server accepts ({limit} bytes)"
        await self._reply(send, 413, message, "invalid_request_error", "request_too_large")

    @staticmethod
    async def _reply(send, status: int, message: str, err_type: str, code: str | None) -> None:
        body = json.dumps(error_body(message, err_type, None, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        if status == 413:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def scope_kv_snapshot(snapshot: dict, own_ids: set[str]) -> dict:
    """A /debug/kv snapshot cut to the caller's requests; others only as aggregate counts.

    Engine-internal ids of a request's sibling sequences (`<id>#<n>`) count as the request's.
    """

    def mine(core_id: str) -> bool:
        return core_id in own_ids or core_id.partition("#")[0] in own_ids

    tables = snapshot.get("block_tables", {})
    other_ids = [r for r in tables if not mine(r)]
    other_blocks = {b for r in other_ids for g in tables[r] for b in g}
    scoped = dict(snapshot)
    scoped["owners"] = [[r for r in owners if mine(r)] for owners in snapshot.get("owners", [])]
    scoped["block_tables"] = {r: t for r, t in tables.items() if mine(r)}
    scoped["requests"] = {r: v for r, v in snapshot.get("requests", {}).items() if mine(r)}
    scoped["other_tenants"] = {
        "num_requests": len({r.partition("#")[0] for r in other_ids}),
        "num_blocks": len(other_blocks),
    }
    return scoped


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|function-\w+|constrained-\w+)\b|.*\[")


def _validation_param(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    # NOTE: pydantic adds the tried type of a union to the location ("content", "str").
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg')}", None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{param or 'body'}: {message}", param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # NOTE: FastAPI answers 422; OpenAI clients expect 400 with an OpenAI error body.
        message, param = _validation_param(exc)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status_code, str(exc), exc.err_type, exc.param, exc.code)

    @app.exception_handler(InvalidRequestError)
    async def _on_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(ValueError)
    async def _on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        # SamplingParams errors read "name=value is invalid: ..."; name the field when they do.
        name = str(exc).partition("=")[0]
        return _error(400, str(exc), "invalid_request_error", name if name.isidentifier() else None)

    @app.exception_handler(EngineDeadError)
    async def _on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), "server_error", code="engine_unavailable")

    @app.exception_handler(RequestFailedError)
    async def _on_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return _error(500, str(exc), "server_error", code="request_failed")

    @app.exception_handler(Exception)
    async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # NOTE: never a text/plain 500: clients parse the OpenAI error body.
        logger.error("unhandled error: %r", exc, exc_info=exc)
        return _error(500, f"internal error: {exc!r}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = getattr(exc, "code", None)
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", code=code)


async def _respond(handler: Coroutine, raw: Request) -> Response:
    """Run a handler; abort its requests if the client leaves before the body is ready."""
    task = asyncio.ensure_future(handler)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            break
        if await raw.is_disconnected():
            # NOTE: cancelling closes the request streams, which aborts them in the engine.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=CLIENT_CLOSED_REQUEST)
    result = task.result()
    if isinstance(result, dict):
        return JSONResponse(result)
    # NOTE: starlette cancels the body iterator when the client disconnects mid-stream; the
    # request streams close and abort their engine requests before the next step.
    return StreamingResponse(result, media_type="text/event-stream")


def build_app(
    engine_or_async_engine,
    api_keys: Sequence[str] | None = None,
    served_model_name: str | None = None,
    *,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    max_prompt_chars: int | None = None,
) -> FastAPI:
    """The FastAPI app serving one engine; the engine loop stops when the app shuts down."""
    engine = engine_or_async_engine
    if not isinstance(engine, AsyncLLMEngine):
        engine = AsyncLLMEngine(engine)
    serving = OpenAIServing(
        engine, served_model_name or engine.model_name, max_prompt_chars=max_prompt_chars
    )
    auth = TenantAuth(api_keys)
    _install_log_redaction()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        # NOTE: uvicorn has already waited for in-flight responses (or cancelled them, which
        # aborts their requests); this aborts whatever is left and stops the loop thread.
        engine.shutdown()
        serving.close()

    app = FastAPI(title="pagedattn", lifespan=lifespan)
    app.state.engine = engine
    app.state.auth = auth
    app.state.serving = serving
    app.add_middleware(GuardMiddleware, auth=auth, max_request_bytes=max_request_bytes)
    _install_error_handlers(app)

    def tenant(request: Request) -> str | None:
        return request.state.tenant

    @app.get("/health")
    async def health() -> Response:
        if engine.fault is not None:
            return _error(
                503, f"the engine stopped after a fault: {engine.fault!r}", "server_error"
            )
        if not engine.is_running:
            return _error(503, "the engine loop has stopped", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = engine.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        return serving.models().model_dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        key_salt = tenant(raw)
        salt = auth.cache_salt(key_salt, body.cache_salt)
        return await _respond(serving.create_completion(body, salt, owner=key_salt), raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        key_salt = tenant(raw)
        salt = auth.cache_salt(key_salt, body.cache_salt)
        return await _respond(serving.create_chat_completion(body, salt, owner=key_salt), raw)

    @app.get("/debug/kv")
    async def debug_kv(raw: Request) -> dict:
        snapshot, own_ids = await engine.kv_snapshot_with_owned(tenant(raw))
        return scope_kv_snapshot(snapshot, own_ids)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        page = STATIC_DIR / "dashboard.html"
        if not page.exists():
            return _error(404, "the dashboard page is not installed", "invalid_request_error")
        return FileResponse(page, media_type="text/html")

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


def run_server(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGINT/SIGTERM, finish or abort in-flight requests, return 0."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from pagedattn.distributed.args import uses_replicas, validate_distributed_args

    validate_distributed_args(args)
    if uses_replicas(args):
        # NOTE: N engine replicas behind one endpoint, on Ray Serve (the `ray` extra).
        from pagedattn.distributed.serve_app import run_replicas

        return run_replicas(args, EngineConfig.from_cli(args))
    engine = LLMEngine(EngineConfig.from_cli(args), verbose=True)
    api_keys = list(args.api_key or []) or _keys_from_env()
    app = build_app(
        engine,
        api_keys,
        args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        max_prompt_chars=args.max_prompt_chars,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    _GracefulServer(config).run()
    return 0


def _keys_from_env() -> list[str]:
    raw = os.environ.get("PAGEDATTN_API_KEY", "")
    return [k for k in raw.split(",") if k]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pagedattn.entrypoints.openai.server --model DIR --port N`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = argparse.ArgumentParser(
        prog="pagedattn serve", description=__doc__, formatter_class=HelpFormatter
    )
    add_serve_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
