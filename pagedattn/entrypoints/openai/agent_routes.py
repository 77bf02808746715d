"""The agent-API routes on every front door: /tokenize, /detokenize, /v1/embeddings, /v1/responses.

Each front door hands `install_agent_routes` two callables and nothing else is copied:
- ``run(kind, body, raw) -> Response``: runs a TOKENIZE/DETOKENIZE/EMBEDDINGS request where the
  engine is (`handle` on this process's OpenAIServing, or on a Ray replica through its handle);
- ``chat(payload, raw) -> body | events``: the front door's chat handler, which /v1/responses
  runs on (errors raise APIError).
The routes sit behind the same guard middleware as the others (the key before the body, the
body size cap) because they are added to the app `make_app` built.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from pagedattn.entrypoints.openai.embeddings import EmbeddingRequest, create_embedding
from pagedattn.entrypoints.openai.http import CLIENT_CLOSED_REQUEST, tenant_of, until_disconnect
from pagedattn.entrypoints.openai.protocol import ChatCompletionRequest
from pagedattn.entrypoints.openai.protocol_base import APIError
from pagedattn.entrypoints.openai.request_checks import ignored_fields, ignored_header
from pagedattn.entrypoints.openai.responses_api import ResponsesAPI
from pagedattn.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedattn.entrypoints.openai.tokenize_routes import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)

TOKENIZE, DETOKENIZE, EMBEDDINGS = "tokenize", "detokenize", "embeddings"
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    TOKENIZE: TokenizeRequest,
    DETOKENIZE: DetokenizeRequest,
    EMBEDDINGS: EmbeddingRequest,
}

Run = Callable[[str, BaseModel, Request], Awaitable[Response]]
Chat = Callable[[dict[str, Any], Request], Awaitable[dict | AsyncIterator[str]]]


def validated(model: type[BaseModel], payload: dict[str, Any]) -> BaseModel:
    """`model` from a body built by the server (a 400 naming the field if it does not fit)."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise APIError(f"{param}: {first.get('msg')}", param=param) from None


async def handle(
    serving, kind: str, body: BaseModel | dict, cache_salt: str | None = None, owner=None
):
    """Run one agent-API request on an OpenAIServing (the single server's, or a replica's)."""
    if kind not in REQUEST_MODELS:
        raise ValueError(f"kind={kind!r} is invalid: use one of {sorted(REQUEST_MODELS)}")
    if isinstance(body, dict):
        body = validated(REQUEST_MODELS[kind], body)
    if kind == EMBEDDINGS:
        return await create_embedding(serving, body, cache_salt, owner)
    if kind == TOKENIZE:
        return await tokenize(serving, body)
    return await detokenize(serving, body)


def body_or_raise(result: dict[str, Any]) -> dict[str, Any]:
    """A replica's `{"status", "body"}` answer: the body if 200, else raised as an APIError."""
    if result.get("status") == 200:
        return result["body"]
    error = result["body"]["error"]
    raise APIError(
        error["message"],
        status_code=result["status"],
        err_type=error["type"],
        param=error.get("param"),
        code=error.get("code"),
    )


async def respond(work: Awaitable[Any], raw: Request, headers: dict[str, str]) -> Response:
    """A handler's result as a response; its requests abort if the client leaves first."""
    answered, result = await until_disconnect(work, raw)
    if not answered:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, Response):
        result.headers.update(headers)
        return result
    if isinstance(result, dict):
        return JSONResponse(result, headers=headers)
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)


def install_agent_routes(app: FastAPI, run: Run, chat: Chat, responses: ResponsesAPI) -> None:
    """Add the agent-API routes to a front door's app (see the module docstring)."""

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, raw: Request) -> Response:
        return await run(TOKENIZE, body, raw)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, raw: Request) -> Response:
        return await run(DETOKENIZE, body, raw)

    @app.post("/v1/embeddings")
    async def embeddings_route(body: EmbeddingRequest, raw: Request) -> Response:
        headers = ignored_header(ignored_fields(body))
        response = await run(EMBEDDINGS, body, raw)
        response.headers.update(headers)
        return response

    @app.post("/v1/responses")
    async def responses_route(body: ResponsesRequest, raw: Request) -> Response:
        headers = ignored_header(ignored_fields(body))

        async def chat_backend(payload: dict[str, Any]):
            return await chat(payload, raw)

        return await respond(responses.create(body, tenant_of(raw), chat_backend), raw, headers)


def local_front_door(serving, auth) -> tuple[Run, Chat]:
    """`run` and `chat` for a front door whose engine is in this process (`pagedattn serve`)."""

    async def run(kind: str, body: BaseModel, raw: Request) -> Response:
        key_salt = tenant_of(raw)
        salt = auth.cache_salt(key_salt, getattr(body, "cache_salt", None))
        return await respond(handle(serving, kind, body, salt, key_salt), raw, {})

    async def chat(payload: dict[str, Any], raw: Request):
        req = validated(ChatCompletionRequest, payload)
        key_salt = tenant_of(raw)
        salt = auth.cache_salt(key_salt, req.cache_salt)
        return await serving.create_chat_completion(req, salt, owner=key_salt)

    return run, chat
