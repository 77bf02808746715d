"""The HTTP layer every front door uses: `pagedattn serve` and the Ray Serve ingress.

- Tenant auth and the guard middleware: the API key first, then the body size cap, then the body.
- Error mapping to the OpenAI error shape: a short message to the client, the detail in the log
  (never an actor id, pid, address or stack to a client).
- The disconnect loop: a handler whose client has gone is cancelled (its requests abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedattn import envs
from pagedattn.engine.async_engine import EngineDeadError, RequestFailedError
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.entrypoints.openai.protocol import APIError, error_body

logger = logging.getLogger(__name__)

# How often a handler waiting on its result checks whether the client is still there.
DISCONNECT_POLL_S = 0.5
# nginx's status for "the client closed the connection before the response was ready".
CLIENT_CLOSED_REQUEST = 499
# Served without an API key: the liveness answer and a static page, no prompt content.
# `/metrics` joins them only with `--metrics-public`.
PUBLIC_PATHS = frozenset({"/health", "/dashboard"})
METRICS_PATH = "/metrics"
_SECRET_QUERY = re.compile(
    r"((?:^|[?&])(?:api[_-]?key|key|token|access_token|auth|password|secret)=)[^&#]*", re.I
)


def keys_from_env() -> list[str]:
    """API keys from PAGEDATTN_API_KEY (comma-separated), used when `--api-key` is not given."""
    return [k for k in envs.PAGEDATTN_API_KEY.split(",") if k]


def admin_keys_from_env() -> list[str]:
    """Admin keys from PAGEDATTN_ADMIN_API_KEY (comma-separated): see TenantAuth."""
    return [k for k in envs.PAGEDATTN_ADMIN_API_KEY.split(",") if k]


def public_paths(metrics_public: bool) -> frozenset[str]:
    """The paths served without a key: /health, /dashboard, and /metrics if asked."""
    return PUBLIC_PATHS | {METRICS_PATH} if metrics_public else PUBLIC_PATHS


def tenant_salt_secret() -> bytes:
    """The key tenants' cache salts are derived with (HMAC of the API key, never the key
    itself): from PAGEDATTN_TENANT_SALT_SECRET, stable across restarts so the KV store finds a
    tenant's blocks again; unset, a random one for this server (said once in the log)."""
    text = envs.PAGEDATTN_TENANT_SALT_SECRET
    if text:
        return hashlib.sha256(b"pagedattn tenant salt\0" + text.encode()).digest()
    return secrets.token_bytes(32)


class TenantAuth:
    """API-key checks and the prefix-cache namespace (cache salt) of each request.

    Admin keys (`--admin-api-key`, PAGEDATTN_ADMIN_API_KEY) are API keys too (a tenant of their
    own) and the only keys internal endpoints (`/debug/replicas`) accept; a server with only
    admin keys needs a key for every request. On an open server (no key at all) every caller is
    the admin.
    """

    def __init__(
        self,
        api_keys: Sequence[str] | None,
        secret: bytes | None = None,
        admin_keys: Sequence[str] | None = None,
    ) -> None:
        self.admin_keys = [k for k in (admin_keys or []) if k]
        tenant_keys = [k for k in (api_keys or []) if k]
        self.api_keys = tenant_keys + [k for k in self.admin_keys if k not in tenant_keys]
        self._secret = secret if secret is not None else tenant_salt_secret()
        if secret is None and self.api_keys and not envs.PAGEDATTN_TENANT_SALT_SECRET:
            logger.info(
                "API keys' cache salts use a random secret: their KV store entries are not found "
                "after a restart (set PAGEDATTN_TENANT_SALT_SECRET to keep them)"
            )

    def require_admin(self, authorization: str | None) -> None:
        """Raise a 403 APIError unless the header carries an admin key (or no key is set)."""
        if not self.api_keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        token_bytes = token.strip().encode()
        if scheme.lower() == "bearer" and any(
            hmac.compare_digest(token_bytes, key.encode()) for key in self.admin_keys
        ):
            return
        raise APIError(
            "this endpoint needs the admin API key (--admin-api-key or PAGEDATTN_ADMIN_API_KEY)",
            status_code=403,
            err_type="permission_error",
            code="admin_key_required",
        )

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


def error_response(status: int, message: str, err_type: str, param=None, code=None) -> Response:
    """A JSON response with OpenAI's error body."""
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


def install_log_redaction() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactSecretsFilter) for f in access.filters):
        access.addFilter(RedactSecretsFilter())


class _BodyTooLarge(StarletteHTTPException):
    """Raised while reading a streamed body past the limit (FastAPI passes HTTP errors on)."""

    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=_too_large_message(limit))


def _too_large_message(limit: int) -> str:
    return f"the request body is larger than this server accepts ({limit} bytes)"


class _BodyNotUTF8(StarletteHTTPException):
    """A body in UTF-16 or UTF-32: json.loads would sniff and read it, RFC 8259 says UTF-8."""

    code = "invalid_encoding"

    def __init__(self) -> None:
        super().__init__(status_code=400, detail=_NOT_UTF8_MESSAGE)


_NOT_UTF8_MESSAGE = "the request body is not UTF-8: send JSON encoded as UTF-8"
# Bodies curl -d sends without -H 'content-type: application/json'; no route reads a form.
_FORM_TYPES = ("", "application/x-www-form-urlencoded")


def _json_content_type(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers with a missing or form content-type read as JSON (every route takes JSON)."""
    kept = [(k, v) for k, v in headers if k.lower() != b"content-type"]
    content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
    if content_type.split(b";")[0].strip().lower().decode("latin-1") in _FORM_TYPES:
        return [*kept, (b"content-type", b"application/json")]
    return headers


def _utf16_or_32(head: bytes) -> bool:
    """A body's first bytes say UTF-16/32 (a byte-order mark, or a NUL in an ASCII position)."""
    return head.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in head[:4]


class GuardMiddleware:
    """Pure ASGI: the API key is checked, then the body size capped, before the app reads a byte.

    A `Depends` would run only after FastAPI has read and parsed the whole body.
    """

    def __init__(
        self,
        app,
        auth: TenantAuth,
        max_request_bytes: int | None,
        public: Iterable[str] = PUBLIC_PATHS,
    ) -> None:
        self.app = app
        self.auth = auth
        self.max_request_bytes = max_request_bytes
        self.public = frozenset(public)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        tenant = None
        if scope["path"] not in self.public:
            try:
                tenant = self.auth.authenticate(headers.get("authorization"))
            except APIError as exc:
                await _reply(send, exc.status_code, str(exc), exc.err_type, exc.code)
                return
        scope.setdefault("state", {})["tenant"] = tenant
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            scope["headers"] = _json_content_type(scope["headers"])
        limit = self.max_request_bytes
        declared = headers.get("content-length", "")
        if limit is not None and declared.isdigit() and int(declared) > limit:
            await _reply(send, 413, _too_large_message(limit), code="request_too_large")
            return
        num_bytes = 0
        head = b""
        started = False

        async def counted_receive():
            nonlocal num_bytes, head
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                num_bytes += len(body)
                if limit is not None and num_bytes > limit:
                    raise _BodyTooLarge(limit)
                if len(head) < 4 and body:
                    head += body[: 4 - len(head)]
                    if _utf16_or_32(head):
                        raise _BodyNotUTF8()
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await _reply(send, 413, _too_large_message(limit), code="request_too_large")
        except _BodyNotUTF8:
            if not started:
                await _reply(send, 400, _NOT_UTF8_MESSAGE, code="invalid_encoding")


async def _reply(
    send, status: int, message: str, err_type: str = "invalid_request_error", code=None
) -> None:
    body = json.dumps(error_body(message, err_type, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if status == 413:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
        reason = first.get("ctx", {}).get("error") or first.get("msg")
        return f"the request body is not valid JSON: {reason}", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return (
            "the request body is not a JSON object: send one (content-type: application/json)",
            None,
        )
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{param or 'body'}: {message}", param


def internal_error(exc: BaseException, what: str = "internal error") -> str:
    """Log `exc` with its detail under a new error id; the short message a client may see."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s (error id %s): %r", what, error_id, exc, exc_info=exc)
    return f"{what} (error id {error_id}; the server log has the detail)"


def error_payload(exc: BaseException) -> dict[str, Any]:
    """`{"status", "body"}` for an exception: how every front door answers it."""
    if isinstance(exc, APIError):
        body = error_body(str(exc), exc.err_type, exc.param, exc.code)
        return {"status": exc.status_code, "body": body}
    if isinstance(exc, InvalidRequestError):
        return {"status": 400, "body": error_body(str(exc), "invalid_request_error", exc.param)}
    if isinstance(exc, EngineDeadError):
        body = error_body(exc.client_message, "server_error", code="engine_unavailable")
        return {"status": 503, "body": body}
    if isinstance(exc, RequestFailedError):
        # NOTE: without the engine's request id (an internal name the client never sent).
        message = f"the request failed in the engine: {exc.message}"
        return {"status": 500, "body": error_body(message, "server_error", code="request_failed")}
    if isinstance(exc, ValueError):
        # SamplingParams errors read "name=value is invalid: ..."; name the field when they do.
        name = str(exc).partition("=")[0]
        param = name if name.isidentifier() else None
        return {"status": 400, "body": error_body(str(exc), "invalid_request_error", param)}
    # NOTE: never a text/plain 500 and never the exception's text: clients parse the body, and
    # the text can hold a path, an address or an actor id.
    return {"status": 500, "body": error_body(internal_error(exc), "server_error")}


def install_error_handlers(app: FastAPI) -> None:
    """Every error becomes an OpenAI error body (FastAPI's 422 becomes a 400)."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_param(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> Response:
        code = getattr(exc, "code", None)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", code=code)

    async def _on_error(_: Request, exc: Exception) -> Response:
        payload = error_payload(exc)
        return JSONResponse(payload["body"], status_code=payload["status"])

    # NOTE: each class on its own: a handler for Exception alone runs in starlette's
    # ServerErrorMiddleware, which re-raises (and logs a traceback for every 400).
    for cls in (APIError, InvalidRequestError, ValueError, EngineDeadError, RequestFailedError):
        app.add_exception_handler(cls, _on_error)
    app.add_exception_handler(Exception, _on_error)


def make_app(
    title: str,
    auth: TenantAuth,
    *,
    max_request_bytes: int | None,
    metrics_public: bool = False,
    lifespan=None,
) -> FastAPI:
    """A FastAPI app behind the guard middleware, with the OpenAI error mapping installed."""
    app = FastAPI(title=title, lifespan=lifespan)
    app.state.auth = auth
    app.add_middleware(
        GuardMiddleware,
        auth=auth,
        max_request_bytes=max_request_bytes,
        public=public_paths(metrics_public),
    )
    install_error_handlers(app)
    install_log_redaction()
    return app


async def until_disconnect(
    work: Awaitable[Any], raw: Request, on_disconnect: Callable[[], None] | None = None
) -> tuple[bool, Any]:
    """Await `work`, polling the client; (True, result), or (False, None) once the client left.

    When the client leaves, `work` is cancelled (which closes its request streams, so the engine
    aborts them) and `on_disconnect` runs first.
    """
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return True, task.result()
        if await raw.is_disconnected():
            if on_disconnect is not None:
                on_disconnect()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return False, None


def degraded_reasons(engine, pools: Iterable, stall_s: float) -> list[str]:
    """Why a front end cannot serve in time now: its engine step (an AsyncLLMEngine) or a job on
    one of its worker pools has run longer than `stall_s`."""
    reasons = []
    busy = engine.busy_s()
    if busy > stall_s:
        reasons.append(f"the engine step has run for {busy:.0f} s")
    for pool in pools:
        stuck = pool.oldest_running_s()
        if stuck > stall_s:
            reasons.append(f"a {pool.name} job has run for {stuck:.0f} s")
    return reasons


def tenant_of(raw: Request) -> str | None:
    """The tenant the guard middleware authenticated (None on an open server)."""
    return raw.state.tenant
