"""How a chat request's tools reach the model, and how tool_choice constrains the reply.

- A chat template with tool support (its source reads the `tools` variable: Qwen2.5/3, Llama 3.1+,
  Mistral, Hermes) gets the tools as `tools`, assistant `tool_calls` (arguments as objects, as
  templates expect) and `role: "tool"` messages as they are.
- A template without it (SmolLM2's) gets chat_template.GENERIC_TOOL_PROMPT in the system message, as
  llama.cpp does: the tools' JSON and the Hermes `<tool_call>` format. Earlier calls are written
  back in that format and tool results become user turns in `<tool_response>` tags. The
  `hermes` parser reads the replies (it is the default parser for such a template).
- `tool_choice: "none"`: the tools are not shown to the model and nothing is parsed.
- `required` and a named function are constrained with the structured-output machinery (a JSON
  schema compiled by xgrammar), so the arguments always parse and match the schema: a named
  choice generates the function's arguments object; `required` a JSON array of
  ``{"name", "arguments"}`` objects (one item unless parallel_tool_calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pagedattn.chat_template import tool_conversation
from pagedattn.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedattn.entrypoints.openai.protocol_base import APIError
from pagedattn.entrypoints.openai.tool_protocol import NamedToolChoice, check_tools


@dataclass(frozen=True)
class ToolMode:
    """How the reply is read for tool calls: auto (parsed), required or named (constrained)."""

    kind: Literal["auto", "required", "named"]
    names: frozenset[str]
    named: str | None = None


def tool_mode(
    req: ChatCompletionRequest, *, auto_enabled: bool, has_parser: bool
) -> ToolMode | None:
    """The request's tool mode (None: no tools, or tool_choice none); 400 for bad combinations."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise APIError(
                "tool_choice needs tools: send the functions in `tools`, or omit tool_choice",
                param="tool_choice",
            )
        return None
    check_tools(req.tools, choice)
    names = frozenset(t.function.name for t in req.tools)
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        return ToolMode("named", names, choice.function.name)
    if choice == "required":
        return ToolMode("required", names)
    if not (auto_enabled and has_parser):
        raise APIError(
            'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
            '--tool-call-parser; use tool_choice "required" or a named function, or restart '
            "the server with both options",
            param="tool_choice",
        )
    return ToolMode("auto", names)


def constraint_schema(req: ChatCompletionRequest, mode: ToolMode) -> dict[str, Any] | None:
    """The JSON schema a `required` or named choice generates (None for auto)."""
    params = {t.function.name: t.function.parameters or {"type": "object"} for t in req.tools}
    if mode.kind == "named":
        return params[mode.named]
    if mode.kind != "required":
        return None
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in params.items()
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": one_call}, "minItems": 1}
    if not req.parallel_tool_calls:
        array["maxItems"] = 1
    return array


def template_messages(
    messages: list[ChatMessage], tools: list[dict] | None, native: bool
) -> list[dict[str, Any]]:
    """The conversation as the template reads it (chat_template.tool_conversation)."""
    plain = [
        {
            "role": m.role,
            "content": m.text(),
            "name": m.name,
            "reasoning_content": m.reasoning_content,
            "tool_calls": [c.model_dump() for c in m.tool_calls] if m.tool_calls else None,
            "tool_call_id": m.tool_call_id,
        }
        for m in messages
    ]
    plain = [{k: v for k, v in m.items() if v is not None} for m in plain]
    return tool_conversation(plain, tools, native)
