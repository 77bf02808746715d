"""ResponseBuilder: one /v1/responses answer built from a chat body, or from streamed chat chunks
as the events the official client reads (responses_api.py runs it)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pagedattn.entrypoints.openai.responses_protocol import ResponsesRequest


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response being built: its output items, from a whole chat body or streamed chunks."""

    def __init__(self, req: ResponsesRequest, history: list[dict]) -> None:
        self.req = req
        self.history = history
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self._seq = 0
        # Streaming: output index -> item being built; chat tool-call index -> output index.
        self._open: dict[int, dict[str, Any]] = {}
        self._calls: dict[int, int] = {}
        self._text_item: int | None = None
        self._reasoning_item: int | None = None

    # ---- items -------------------------------------------------------------------------------

    def _message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "type": "message",
            "id": _new_id("msg"),
            "status": status,
            "role": "assistant",
            "content": [part] if status == "completed" else [],
        }

    def _call_item(self, call_id: str, name: str, arguments: str, status="completed") -> dict:
        return {
            "type": "function_call",
            "id": _new_id("fc"),
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def _reasoning(self, text: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": _new_id("rs"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def from_chat(self, body: dict[str, Any]) -> None:
        choice = body["choices"][0]
        message = choice["message"]
        self.finish_reason = choice.get("finish_reason")
        if message.get("reasoning_content"):
            self.output.append(self._reasoning(message["reasoning_content"]))
        if message.get("content"):
            self.output.append(self._message_item(message["content"]))
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            self.output.append(self._call_item(call["id"], fn["name"], fn["arguments"]))
        self._set_usage(body.get("usage"))

    def _set_usage(self, usage: dict | None) -> None:
        if not usage:
            return
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }

    def messages(self) -> list[dict[str, Any]]:
        """The output as chat messages (what `previous_response_id` continues from)."""
        text = "".join(
            p["text"] for item in self.output if item["type"] == "message" for p in item["content"]
        )
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.output
            if item["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message]

    def body(self, status: str | None = None) -> dict[str, Any]:
        req = self.req
        incomplete = self.finish_reason == "length"
        if status is None:
            status = "incomplete" if incomplete else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": self.output if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning,
            "store": req.store,
            "temperature": req.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": self.usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    # ---- streaming ---------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _add(self, item: dict[str, Any]) -> tuple[int, list[str]]:
        index = len(self.output)
        self.output.append(item)
        self._open[index] = item
        return index, [self.event("response.output_item.added", output_index=index, item=item)]

    def _done(self, index: int) -> list[str]:
        item = self._open.pop(index)
        out = []
        if item["type"] == "message":
            text = item["content"][0]["text"] if item["content"] else ""
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            part = {"type": "output_text", "text": text, "annotations": []}
            out.append(self.event("response.output_text.done", text=text, **ids))
            out.append(self.event("response.content_part.done", part=part, **ids))
        elif item["type"] == "function_call":
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk."""
        self._set_usage(chunk.get("usage"))
        out: list[str] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._reasoning_delta(delta["reasoning_content"])
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for tc in delta.get("tool_calls") or []:
                out += self._call_delta(tc)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _reasoning_delta(self, text: str) -> list[str]:
        out = []
        if self._reasoning_item is None:
            self._reasoning_item, out = self._add(self._reasoning(""))
        item = self.output[self._reasoning_item]
        item["content"][0]["text"] += text
        ids = {"item_id": item["id"], "output_index": self._reasoning_item, "content_index": 0}
        return out + [self.event("response.reasoning_text.delta", delta=text, **ids)]

    def _close_reasoning(self) -> list[str]:
        if self._reasoning_item is None or self._reasoning_item not in self._open:
            return []
        return self._done(self._reasoning_item)

    def _text_delta(self, text: str) -> list[str]:
        out = self._close_reasoning()
        if self._text_item is None or self._text_item not in self._open:
            index, added = self._add(self._message_item("", status="in_progress"))
            item = self.output[index]
            item["content"] = [{"type": "output_text", "text": "", "annotations": []}]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            part = {"type": "output_text", "text": "", "annotations": []}
            out += added + [self.event("response.content_part.added", part=part, **ids)]
            self._text_item = index
        item = self.output[self._text_item]
        item["content"][0]["text"] += text
        ids = {"item_id": item["id"], "output_index": self._text_item, "content_index": 0}
        return out + [self.event("response.output_text.delta", delta=text, **ids)]

    def _call_delta(self, tc: dict[str, Any]) -> list[str]:
        out = self._close_reasoning()
        fn = tc.get("function") or {}
        index = self._calls.get(tc["index"])
        if index is None:
            if self._text_item is not None and self._text_item in self._open:
                out += self._done(self._text_item)
            item = self._call_item(
                tc.get("id") or _new_id("call"), fn.get("name") or "", "", "in_progress"
            )
            index, added = self._add(item)
            self._calls[tc["index"]] = index
            out += added
        item = self.output[index]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=fn["arguments"],
                )
            )
        return out

    def close(self) -> list[str]:
        """Events that finish every item still open."""
        out: list[str] = []
        for index in sorted(self._open):
            out += self._done(index)
        return out
