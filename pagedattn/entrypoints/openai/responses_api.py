"""ResponsesAPI: ``POST /v1/responses`` on top of the chat handler, with a bounded response store.

A request becomes a chat completion (instructions as the system message, the stored conversation
of `previous_response_id` before the input, function tools and tool_choice as chat tools), run by
whichever chat backend the front door has (this process's OpenAIServing, or a Ray replica), so
tool calling, reasoning and every limit behave exactly as on /v1/chat/completions.

The store keeps the conversations of the last MAX_STORED_RESPONSES responses (and at most
MAX_STORED_CHARS characters), per tenant: a response id is found only with the key that made it.
A missing or evicted id is a 404 (`previous_response_not_found`). Streaming sends the events the
official client reads: response.created, response.output_item.added, response.content_part.added,
response.output_text.delta, response.function_call_arguments.delta, ...done, response.completed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pagedattn.entrypoints.openai.protocol_base import APIError
from pagedattn.entrypoints.openai.response_builder import ResponseBuilder
from pagedattn.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    chat_tools_of,
    check_unsupported,
    input_messages,
)

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 32 * 1024 * 1024

# The front door's chat handler: a chat request body in, a body or server-sent events out.
ChatBackend = Callable[[dict[str, Any]], Awaitable[dict | AsyncIterator[str]]]


class ResponseStore:
    """Conversations by (tenant, response id), least recently used dropped first."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._items: OrderedDict[tuple, tuple[list[dict], int]] = OrderedDict()
        self._num_chars = 0
        self._lock = threading.Lock()

    def put(self, tenant: str | None, response_id: str, messages: list[dict]) -> None:
        size = len(json.dumps(messages))
        with self._lock:
            self._items[(tenant, response_id)] = (messages, size)
            self._num_chars += size
            while self._items and (
                len(self._items) > self.max_entries or self._num_chars > self.max_chars
            ):
                _, (_, dropped) = self._items.popitem(last=False)
                self._num_chars -= dropped

    def get(self, tenant: str | None, response_id: str) -> list[dict]:
        with self._lock:
            entry = self._items.get((tenant, response_id))
            if entry is None:
                raise APIError(
                    f"Previous response with id {response_id!r} not found (it was never stored, "
                    "was made with another key, or was evicted from this server's store)",
                    status_code=404,
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            self._items.move_to_end((tenant, response_id))
            return [dict(m) for m in entry[0]]

    def __len__(self) -> int:
        return len(self._items)


class ResponsesAPI:
    """Runs /v1/responses requests through a chat backend; one store per front door."""

    def __init__(self, store: ResponseStore | None = None):
        self.store = store or ResponseStore()

    def _chat_body(self, req: ResponsesRequest, history: list[dict]) -> dict[str, Any]:
        check_unsupported(req)
        tools, choice = chat_tools_of(req)
        messages = []
        if req.instructions:
            messages.append({"role": "system", "content": req.instructions})
        messages += history
        body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
        optional = {
            "max_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": tools,
            "tool_choice": choice,
            "seed": req.seed,
            "user": req.user,
            "cache_salt": req.cache_salt,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if tools:
            body["parallel_tool_calls"] = req.parallel_tool_calls
        effort = (req.reasoning or {}).get("effort")
        if effort is not None:
            body["reasoning_effort"] = effort
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def create(
        self, req: ResponsesRequest, tenant: str | None, chat: ChatBackend
    ) -> dict | AsyncIterator[str]:
        """The response body, or its server-sent events when streaming."""
        history = []
        if req.previous_response_id is not None:
            history = self.store.get(tenant, req.previous_response_id)
        history += input_messages(req.input)
        result = await chat(self._chat_body(req, history))
        response = ResponseBuilder(req, history)
        if isinstance(result, dict):
            response.from_chat(result)
            self._keep(req, tenant, response)
            return response.body()
        return self._stream(req, tenant, response, result)

    def _keep(self, req: ResponsesRequest, tenant: str | None, response: ResponseBuilder) -> None:
        if req.store:
            self.store.put(tenant, response.id, response.history + response.messages())

    async def _stream(
        self, req: ResponsesRequest, tenant: str | None, response: ResponseBuilder, events
    ) -> AsyncIterator[str]:
        yield response.event("response.created", response=response.body("in_progress"))
        try:
            async for line in events:
                for data in _sse_data(line):
                    if "error" in data:
                        yield response.event("error", **data["error"])
                        return
                    for event in response.feed(data):
                        yield event
            for event in response.close():
                yield event
            self._keep(req, tenant, response)
            yield response.event("response.completed", response=response.body())
        finally:
            if hasattr(events, "aclose"):
                await events.aclose()


def _sse_data(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out
