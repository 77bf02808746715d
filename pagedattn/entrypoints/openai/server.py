"""The OpenAI-compatible HTTP server: `build_app`, `run_server`, and `pagedattn serve` options.

Trust model for tenants and the prefix cache:
- Without `--api-key` the server is open and every client shares one prefix-cache namespace,
  unless a request sends `cache_salt`. A client-sent salt is only as secret as the client keeps
  it: anyone who sends the same salt shares (and can probe, by cache hits or TTFT) that namespace.
- With `--api-key` (one or more) every `/v1/*` and `/debug/kv` request must send
  `Authorization: Bearer <key>` (else 401). Each key gets its own namespace: the salt passed to the
  engine is HMAC-SHA256(server secret, key), which a client cannot choose or forge. A `cache_salt`
  sent with a key only splits that key's namespace further (HMAC of key salt and client salt), so
  no tenant can name another tenant's namespace. Clients sharing a key share a namespace.
- The server secret is random per process; the prefix cache does not outlive the process.
- `/health`, `/metrics` and `/dashboard` need no key: they show aggregate counters and no prompt
  content. `/debug/kv` shows block tables of all requests, so it needs a key when keys are set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import signal
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedattn.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from pagedattn.entrypoints.openai.serving import APIError, OpenAIServing

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DISCONNECT_POLL_S = 0.5
# nginx's status for "the client closed the connection before the response was ready".
CLIENT_CLOSED_REQUEST = 499


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


def _validation_param(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg')}", None
    return f"{param or 'body'}: {first.get('msg')}", param


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

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")


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
) -> FastAPI:
    """The FastAPI app serving one engine; the engine loop stops when the app shuts down."""
    engine = engine_or_async_engine
    if not isinstance(engine, AsyncLLMEngine):
        engine = AsyncLLMEngine(engine)
    serving = OpenAIServing(engine, served_model_name or engine.model_name)
    auth = TenantAuth(api_keys)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        # NOTE: uvicorn has already waited for in-flight responses (or cancelled them, which
        # aborts their requests); this aborts whatever is left and stops the loop thread.
        engine.shutdown()

    app = FastAPI(title="pagedattn", lifespan=lifespan)
    app.state.engine = engine
    app.state.auth = auth
    _install_error_handlers(app)

    def tenant(request: Request) -> str | None:
        return auth.authenticate(request.headers.get("authorization"))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return _error(503, "the engine loop has stopped", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = engine.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(_: str | None = Depends(tenant)) -> dict:
        return serving.models().model_dump()

    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest, raw: Request, key_salt: str | None = Depends(tenant)
    ) -> Response:
        salt = auth.cache_salt(key_salt, body.cache_salt)
        return await _respond(serving.create_completion(body, salt), raw)

    @app.post("/v1/chat/completions")
    async def chat(
        body: ChatCompletionRequest, raw: Request, key_salt: str | None = Depends(tenant)
    ) -> Response:
        salt = auth.cache_salt(key_salt, body.cache_salt)
        return await _respond(serving.create_chat_completion(body, salt), raw)

    @app.get("/debug/kv")
    async def debug_kv(_: str | None = Depends(tenant)) -> dict:
        return await engine.kv_snapshot()

    @app.get("/dashboard")
    async def dashboard() -> Response:
        page = STATIC_DIR / "dashboard.html"
        if not page.exists():
            return _error(404, "the dashboard page is not installed", "invalid_request_error")
        return FileResponse(page, media_type="text/html")

    return app


class _GracefulServer(uvicorn.Server):
    """uvicorn, minus re-raising SIGINT/SIGTERM after a clean shutdown (so the exit code is 0)."""

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


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Options of `pagedattn serve`: the engine's plus host, port, keys and model name."""
    from pagedattn.entrypoints.cli import add_engine_args

    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=None,
        help="accepted API keys (repeatable); each key gets its own prefix-cache namespace",
    )
    g.add_argument("--served-model-name", default=None, help="model id clients must send")
    if "--seed" not in parser._option_string_actions:
        g.add_argument("--seed", type=int, default=0, help="engine seed")
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="seconds in-flight requests may finish after SIGTERM/SIGINT before being aborted",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run_server(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGINT/SIGTERM, finish or abort in-flight requests, return 0."""
    from pagedattn.engine.llm import LLM
    from pagedattn.entrypoints.cli import engine_kwargs

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(**engine_kwargs(args), seed=args.seed, verbose=True)
    api_keys = list(args.api_key or []) or _keys_from_env()
    app = build_app(llm.engine, api_keys, args.served_model_name)
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
    parser = argparse.ArgumentParser(prog="pagedattn serve", description=__doc__)
    add_serve_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
