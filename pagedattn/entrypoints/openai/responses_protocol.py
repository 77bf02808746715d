"""Bodies of ``POST /v1/responses`` (OpenAI's Responses API), and their conversion to a chat.

Input: a string, or a list of items: messages (``{"role", "content"}`` with text or
``input_text``/``output_text`` parts), ``function_call`` items (the model's earlier calls) and
``function_call_output`` items (their results). Tools: ``{"type": "function", "name", ...}``
only; other built-in tools (web search, file search, ...) are a 400 naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt

from pagedattn.entrypoints.openai.protocol_base import APIError, FiniteFloat, OpenAIBaseModel, Text


class ResponsesRequest(OpenAIBaseModel):
    """Body of ``POST /v1/responses``; unknown fields are kept to be named (x-ignored-fields)."""

    model_config = ConfigDict(extra="allow")

    model: Text
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: FiniteFloat | None = Field(default=None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    previous_response_id: Text | None = None
    stream: StrictBool = False
    store: StrictBool = True
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    seed: StrictInt | None = None
    # Accepted as OpenAI's defaults; anything else is refused (request_checks style).
    text: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    # Internal (like cache_salt on the other routes): splits the tenant's prefix-cache namespace.
    cache_salt: Text | None = Field(default=None, min_length=1)


def chat_tools_of(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """The request's tools and tool_choice in the chat API's shape."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise APIError(
                    f"tool type {tool.get('type')!r} is not supported by this server: only "
                    "function tools",
                    param=f"tools.{i}.type",
                )
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            tools.append({"type": "function", "function": function})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "name"}',
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in (
                "input_text",
                "output_text",
                "text",
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(
                    f"content part {kind!r} is not supported by this server: send text",
                    param=param,
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise APIError("content must be a string or a list of text parts", param=param)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages: calls join one assistant message, outputs become tool turns."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"role {role!r} is invalid here", param=f"input.{i}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"input.{i}")})
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id") or item.get("id") or ""),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"input.{i}.output")
            messages.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text}
            )
        elif kind == "reasoning":
            continue  # NOTE: our own earlier reasoning, handed back; templates drop it anyway
        else:
            raise APIError(
                f"input item type {kind!r} is not supported by this server",
                param=f"input.{i}.type",
            )
    return messages


def check_unsupported(req: ResponsesRequest) -> None:
    """400 naming a field this server does not honour (`reasoning.effort` goes to the chat
    handler as reasoning_effort, which refuses it without --reasoning-parser)."""
    fmt = (req.text or {}).get("format", {"type": "text"})
    if not isinstance(fmt, dict) or fmt.get("type") != "text":
        raise APIError(
            "text.format other than text is not supported by /v1/responses here: use "
            "/v1/chat/completions with response_format",
            param="text.format",
        )
