"""Chat templates rendered the way transformers' apply_chat_template renders them, without it.

The same sandboxed Jinja environment (trim_blocks, lstrip_blocks, loop controls, a ``tojson``
that keeps non-ASCII text, ``raise_exception``, ``strftime_now``, a restricted ``dict`` and
``namespace``, the ``{% generation %}`` tag) and the same message normalisation: None values
dropped, reasoning fields aliased, everything reduced to plain JSON data.
jinja2 is imported on first use (a few tens of ms), not at start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

# Names a message's reasoning is passed under; templates read the first (transformers' order).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# For a template without tool support (as llama.cpp does): the tools and the Hermes format.
GENERIC_TOOL_PROMPT = (
    "You can call functions. Their signatures, as JSON schemas, are in <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with only a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
    "</tool_call>\n"
    "Otherwise answer normally."
)


def template_supports_tools(template: str | dict | None) -> bool:
    """Whether a chat template renders the `tools` variable itself."""
    if isinstance(template, dict):
        return "tool_use" in template or any(template_supports_tools(t) for t in template.values())
    return bool(template) and "tools" in template


def tool_conversation(
    messages: Sequence[dict[str, Any]], tools: list[dict] | None, native: bool
) -> list[dict[str, Any]]:
    """A conversation with tool calls, as a template with (`native`) or without tool support
    reads it.

    Tool-call arguments become objects (templates expect them so). Without tool support, the
    tools go into the system message as GENERIC_TOOL_PROMPT, earlier calls are written in its
    `<tool_call>` format and tool results become user turns in `<tool_response>` tags.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        msg = dict(message)
        calls = [_with_object_arguments(c) for c in msg.get("tool_calls") or []]
        if calls:
            msg["tool_calls"] = calls
        if not native:
            if calls:
                written = "\n".join(
                    "<tool_call>\n"
                    + json.dumps(c["function"], ensure_ascii=False)
                    + "\n</tool_call>"
                    for c in calls
                )
                msg["content"] = ((msg.get("content") or "") + "\n" + written).lstrip("\n")
                del msg["tool_calls"]
            if msg.get("role") == "tool":
                content = msg.get("content") or ""
                msg = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        out.append(msg)
    if tools and not native:
        prompt = GENERIC_TOOL_PROMPT.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {
                **out[0],
                "role": "system",
                "content": f"{out[0].get('content') or ''}\n\n{prompt}",
            }
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # NOTE: not JSON: the template gets the text as the client sent it
    return {**call, "function": function}


def render_chat_template(
    template: str,
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **template_kwargs: Any,
) -> str:
    """``template`` rendered for one conversation; template_kwargs (e.g. bos_token) are visible."""
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools should be JSON schemas (dicts); functions are not converted here")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents should be a list of dicts with 'title' and 'text' keys")
    chat = []
    for message in _as_dict(messages):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages should be dicts, but got {message!r}")
        # NOTE: APIs send content=None or tool_calls=None; templates handle a missing key better.
        chat.append(_plain({k: v for k, v in message.items() if v is not None}))
    return _compiled(template).render(
        messages=_alias_reasoning(chat),
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(template_kwargs),
    )


def _as_dict(value: Any) -> Any:
    """Pydantic models and dataclasses (e.g. OpenAI SDK messages) as dicts, recursively."""
    if isinstance(value, Mapping):
        return {k: _as_dict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dict(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dict(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dict(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """Only plain JSON types reach the sandbox; anything else becomes a '<TypeName>' string."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums, ...) lose their methods and names
        if isinstance(value, base):
            return getattr(base, f"__{base.__name__}__")(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    converted = _as_dict(value)
    if converted is not value:
        return _plain(converted)
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: marks assistant text; renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        """``dict(...)`` in a template: builds a dict, exposes nothing else."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """Jinja's namespace that refuses underscore-prefixed names (no CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}"
                )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # NOTE: Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
