"""Tool-call parsers (`--tool-call-parser`): a model's own tool-call syntax -> OpenAI tool calls.

- hermes: Hermes / Qwen2.5 / Qwen3 ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (also the format of the generic tool prompt, chat_tools.py);
- llama3_json: Llama 3.1+ ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``, several separated by ``;``);
- mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``, or ``[TOOL_CALLS]name[ARGS]{...}``;
- pythonic: ``[get_weather(city="Paris"), now()]`` (Llama 3.2 / 4 style), literal arguments only.

A call that does not parse, or names a function not among the request's tools, is not a call:
the whole text comes back as content (never a 500). Streaming: `split` says how much of the text
so far is surely content, and whether tool-call text has started.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    """One call found in the model's text: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def with_id(self) -> ParsedToolCall:
        return ParsedToolCall(self.name, self.arguments, self.id or new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParseError(ValueError):
    """The text has tool-call syntax that does not parse."""


def _arguments_json(value: Any) -> str:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            raise ToolParseError("the arguments are not JSON") from None
    if not isinstance(value, dict):
        raise ToolParseError("the arguments are not a JSON object")
    return json.dumps(value, ensure_ascii=False)


def call_from_json(
    obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ParsedToolCall:
    """A call from ``{"name": ..., "arguments": {...}}`` (or "parameters")."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolParseError("a tool call is a JSON object with a string 'name'")
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ParsedToolCall(obj["name"], _arguments_json(args))


class ToolParser(ABC):
    """Finds tool calls in a model's output text."""

    name: ClassVar[str]
    # Text that starts tool-call output.
    markers: ClassVar[tuple[str, ...]]
    # True: tool-call output is recognised only at the start of the text (after whitespace).
    at_start_only: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls); raises ToolParseError when tool-call syntax does not parse."""

    def extract(
        self, text: str, tool_names: Collection[str] | None = None
    ) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls with ids); text with no valid calls comes back whole as content."""
        try:
            content, calls = self.parse(text)
        except (ToolParseError, ValueError, SyntaxError, RecursionError):
            return text, []
        if not calls or (tool_names is not None and any(c.name not in tool_names for c in calls)):
            return text, []
        if content is not None and not content.strip():
            content = None
        return content, [c.with_id() for c in calls]

    def split(self, text: str) -> tuple[int, bool]:
        """(length of the prefix that is surely content, whether a tool call starts there)."""
        if self.at_start_only:
            stripped = text.lstrip()
            lead = len(text) - len(stripped)
            if not stripped:
                return 0, False
            if any(stripped.startswith(m) for m in self.markers):
                return lead, True
            if any(m.startswith(stripped) for m in self.markers):
                return 0, False
            return len(text), False
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if found:
            return min(found), True
        longest = max(len(m) for m in self.markers)
        for k in range(min(len(text), longest - 1), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return len(text) - k, False
        return len(text), False


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks; the text before the first is the content."""

    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = [call_from_json(json.loads(body)) for body in self._block.findall(text[start:])]
        return text[:start], calls

    def closed_calls(self, text: str) -> int:
        """How many calls are complete (closed by their tag) in the text so far."""
        return text.count("</tool_call>")


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` objects (``;``-separated) as the whole output."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start_only = True

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            obj, end = decoder.raw_decode(body, pos)
            calls.append(call_from_json(obj))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` then a JSON list of calls, or ``name[ARGS]{json}`` per call (v11+)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        calls = []
        for part in text[start:].split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if "[ARGS]" in part:
                name, _, args = part.partition("[ARGS]")
                calls.append(ParsedToolCall(name.strip(), _arguments_json(json.loads(args))))
                continue
            objs = json.loads(part)
            for obj in objs if isinstance(objs, list) else [objs]:
                calls.append(call_from_json(obj))
        return text[:start], calls


class PythonicToolParser(ToolParser):
    """A Python list of calls with literal keyword arguments: ``[f(a=1), g(b="x")]``."""

    name = "pythonic"
    markers = ("<|python_start|>", "[")
    at_start_only = True

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        body = body.strip()
        if not body.startswith("["):
            return text, []
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List):
            raise ToolParseError("pythonic tool calls are a list of calls")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(
                node.func, ast.Name | ast.Attribute
            ):
                raise ToolParseError("each element must be a call: name(arg=value, ...)")
            if node.args:
                raise ToolParseError("pythonic tool calls take keyword arguments only")
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            calls.append(ParsedToolCall(ast.unparse(node.func), _arguments_json(args)))
        return None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name`; ValueError naming the choices otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"--tool-call-parser={name!r} is invalid: use one of {sorted(TOOL_PARSERS)}"
        ) from None
