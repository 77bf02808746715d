"""Tool-calling bodies of the chat API: tool definitions, tool_choice, and tool calls in and out.

Bounds: at most MAX_TOOLS tools, whose JSON together is at most MAX_TOOLS_CHARS characters (the
same cap as a JSON schema constraint, since `required` and named choices compile the tools into
one). Each tool's `parameters` must be a valid JSON schema of an object.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedattn.entrypoints.openai.protocol_base import APIError, OpenAIBaseModel, Text

MAX_TOOLS = 64
MAX_TOOLS_CHARS = 16_384
# OpenAI's rule for function names.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_.\-]{1,64}$"


class FunctionDefinition(OpenAIBaseModel):
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: Text = Field(pattern=FUNCTION_NAME_PATTERN)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    """The function a named `tool_choice` forces."""

    name: Text


class NamedToolChoice(OpenAIBaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(OpenAIBaseModel):
    """A call the model made: the function's name and its arguments as JSON text."""

    name: Text
    arguments: Text = "{}"


class ToolCall(OpenAIBaseModel):
    """An assistant message's tool call (in the history the client sends back)."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


# ---- response side ---------------------------------------------------------------------------


class FunctionCallOut(BaseModel):
    """The function of a returned tool call."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """A tool call in a chat response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(BaseModel):
    """A streamed fragment of a call: the name first, then argument text."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool-call delta, in OpenAI's shape (`index`, `id` and name first)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


def check_tools(tools: list[ChatTool], choice: ToolChoice | None) -> None:
    """Raise APIError (400) for tools the server will not take: too many, too large, a schema
    that is not a JSON schema of an object, or a tool_choice naming no given tool."""

    if len(tools) > MAX_TOOLS:
        raise APIError(
            f"{len(tools)} tools is more than this server accepts ({MAX_TOOLS})", param="tools"
        )
    num_chars = len(json.dumps([t.model_dump(exclude_none=True) for t in tools]))
    if num_chars > MAX_TOOLS_CHARS:
        raise APIError(
            f"the tools' JSON has {num_chars} characters, more than this server accepts "
            f"({MAX_TOOLS_CHARS}); send fewer or shorter tools",
            param="tools",
        )
    names = [t.function.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise APIError(f"tool names must be unique; {dup} appear more than once", param="tools")
    for i, tool in enumerate(tools):
        problem = schema_problem(tool.function.parameters)
        if problem is not None:
            raise APIError(
                f"tool {tool.function.name!r} has invalid parameters: {problem}",
                param=f"tools.{i}.function.parameters",
            )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(
            f"tool_choice names the function {choice.function.name!r}, which is not among the "
            f"tools ({names})",
            param="tool_choice",
        )


def schema_problem(schema: dict[str, Any] | None) -> str | None:
    """Why `schema` is not a JSON schema of a function's arguments (None: it is, or absent)."""
    if schema is None:
        return None
    kind = schema.get("type", "object")
    if kind != "object":
        return f"the schema's type must be 'object' (the arguments are a JSON object), not {kind!r}"
    try:
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for
    except ImportError:  # NOTE: jsonschema comes with ray; without it only the type is checked
        return None
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"{exc.message}" + (f" (at {where})" if where else "")
    return None
