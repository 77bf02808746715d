"""ChatOutputParser: one chat choice's text -> reasoning, content and tool calls, whole or streamed.

The reasoning parser runs first; tool parsing (or a constrained choice's JSON) applies to the
content after the reasoning. Streamed, content is sent as soon as it cannot be the start of a
tool call or a tag; a tool call is sent as its name (with its id) and then its arguments: a named
choice's arguments as they are generated, a parsed call's once it is complete (a Hermes call at
its closing tag, other formats when the output ends).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedattn.entrypoints.openai.chat_tools import ToolMode
from pagedattn.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedattn.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    ParsedToolCall,
    ToolParser,
    new_call_id,
)
from pagedattn.entrypoints.openai.tool_protocol import DeltaFunctionCall, DeltaToolCall


@dataclass
class ParsedChoice:
    """A whole choice, parsed."""

    reasoning: str | None
    content: str | None
    calls: list[ParsedToolCall]


@dataclass
class Delta:
    """One streamed delta of a choice (only the fields that moved are set)."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


def _required_calls(text: str, names: frozenset[str]) -> list[ParsedToolCall]:
    """Calls of a `required` choice's JSON array; [] if it does not parse (cut off)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        args = json.dumps(item.get("arguments", {}), ensure_ascii=False)
        calls.append(ParsedToolCall(item["name"], args, new_call_id()))
    return calls


class ChatOutputParser:
    """Parses one choice; `whole` for a full response, `feed` for a stream."""

    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        tools: ToolParser | None = None,
        mode: ToolMode | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools if mode is not None and mode.kind == "auto" else None
        self.mode = mode
        # Streaming state.
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0
        self._in_tools = False
        self._num_calls = 0
        self._named_id: str | None = None

    @property
    def num_calls(self) -> int:
        """Tool calls sent so far (streaming)."""
        return self._num_calls

    def _split_reasoning(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        reasoning, content, _ = self.reasoning.split(text, final)
        return reasoning, content

    def whole(self, text: str) -> ParsedChoice:
        reasoning, content = self._split_reasoning(text, final=True)
        content_out, calls = self._calls(content)
        return ParsedChoice(reasoning or None, content_out, calls)

    def _calls(self, content: str) -> tuple[str | None, list[ParsedToolCall]]:
        mode = self.mode
        if mode is None:
            return content, []
        if mode.kind == "named":
            try:
                args = json.dumps(json.loads(content), ensure_ascii=False)
            except ValueError:
                args = content  # NOTE: cut off by max_tokens; finish_reason says "length"
            return None, [ParsedToolCall(mode.named, args, new_call_id())]
        if mode.kind == "required":
            calls = _required_calls(content, mode.names)
            return (None, calls) if calls else (content, [])
        return self.tools.extract(content, mode.names)

    # ---- streaming ---------------------------------------------------------------------------

    def feed(self, delta_text: str, final: bool) -> list[Delta]:
        """The deltas that `delta_text` (the choice's next text) releases."""
        self._text += delta_text
        reasoning, content = self._split_reasoning(self._text, final)
        out: list[Delta] = []
        if len(reasoning) > self._sent_reasoning:
            out.append(Delta(reasoning=reasoning[self._sent_reasoning :]))
            self._sent_reasoning = len(reasoning)
        mode = self.mode
        if mode is None:
            self._send_content(out, content, len(content))
        elif mode.kind == "named":
            self._feed_named(out, content)
        elif mode.kind == "required":
            if final:
                self._send_calls(out, content, _required_calls(content, mode.names))
        else:
            self._feed_auto(out, content, final)
        return out

    def _send_content(self, out: list[Delta], content: str, end: int) -> None:
        if end > self._sent_content:
            out.append(Delta(content=content[self._sent_content : end]))
            self._sent_content = end

    def _send_calls(self, out: list[Delta], content: str, calls: list[ParsedToolCall]) -> None:
        """Send the calls not sent yet, or, if none parsed, the rest of the text as content."""
        if not calls and self._num_calls == 0:
            self._send_content(out, content, len(content))
            return
        for call in calls[self._num_calls :]:
            head = DeltaToolCall(
                index=self._num_calls,
                id=call.id or new_call_id(),
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=""),
            )
            args = DeltaToolCall(
                index=self._num_calls, function=DeltaFunctionCall(arguments=call.arguments)
            )
            out.extend((Delta(tool_calls=[head]), Delta(tool_calls=[args])))
            self._num_calls += 1

    def _feed_named(self, out: list[Delta], content: str) -> None:
        if self._named_id is None:
            if not content:
                return
            self._named_id = new_call_id()
            head = DeltaToolCall(
                index=0,
                id=self._named_id,
                type="function",
                function=DeltaFunctionCall(name=self.mode.named, arguments=""),
            )
            out.append(Delta(tool_calls=[head]))
            self._num_calls = 1
        if len(content) > self._sent_content:
            fragment = content[self._sent_content :]
            self._sent_content = len(content)
            out.append(
                Delta(
                    tool_calls=[
                        DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=fragment))
                    ]
                )
            )

    def _feed_auto(self, out: list[Delta], content: str, final: bool) -> None:
        if not self._in_tools:
            end, started = self.tools.split(content)
            if final and not started:
                end = len(content)
            self._send_content(out, content, end)
            self._in_tools = started
        if not self._in_tools:
            return
        if final:
            _, calls = self.tools.extract(content, self.mode.names)
            self._send_calls(out, content, calls)
            return
        if isinstance(self.tools, HermesToolParser):
            closed = content.rfind("</tool_call>")
            if closed >= 0:
                prefix = content[: closed + len("</tool_call>")]
                _, calls = self.tools.extract(prefix, self.mode.names)
                if calls:
                    self._send_calls(out, content, calls)
