"""Tool-call and reasoning parsers on recorded model outputs of each format, whole and streamed.

The outputs are as the models write them (Qwen2.5 / Hermes, Llama 3.1 / 3.2, Mistral v0.3 and
v11+ tokenizers, DeepSeek-R1, Qwen3); malformed ones come back as content, never an exception.
"""

from __future__ import annotations

import json

import pytest

from pagedattn.entrypoints.openai.chat_output import ChatOutputParser
from pagedattn.entrypoints.openai.chat_tools import ToolMode
from pagedattn.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedattn.entrypoints.openai.tool_parsers import get_tool_parser

NAMES = frozenset({"get_weather", "get_time"})

# (parser, model output, expected content, expected [(name, arguments)])
RECORDED = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        "</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "unit": "c"})],
    ),
    (
        "hermes",
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "Let me check both.\n",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        None,
        [("get_weather", {"city": "Rome"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", {"city": "Rome"}), ("get_time", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}]',
        None,
        [("get_weather", {"city": "Lyon"})],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[ARGS]{}',
        "Sure.",
        [("get_weather", {"city": "Nice"}), ("get_time", {})],
    ),
    (
        "pythonic",
        '[get_weather(city="Berlin", days=2), get_time(zone="UTC")]',
        None,
        [("get_weather", {"city": "Berlin", "days": 2}), ("get_time", {"zone": "UTC"})],
    ),
]

MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>'),  # unknown
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),
    ("llama3_json", '{"city": "Rome"}'),  # no name
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": [1, 2]}]'),
    ("pythonic", "[get_weather(city=open('/etc/passwd'))]"),  # not a literal
    ("pythonic", "[get_weather(city="),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), RECORDED)
def test_recorded_outputs_parse_whole(parser, text, content, calls):
    got_content, got_calls = get_tool_parser(parser).extract(text, NAMES)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_calls_come_back_as_content(parser, text):
    content, calls = get_tool_parser(parser).extract(text, NAMES)
    assert calls == [] and content == text


def test_plain_text_is_content():
    for name in ("hermes", "llama3_json", "mistral", "pythonic"):
        assert get_tool_parser(name).extract("It is sunny.", NAMES) == ("It is sunny.", [])


def _stream(parser: ChatOutputParser, text: str, step: int = 3):
    """Feed `text` in pieces; the concatenated reasoning, content and calls of the deltas."""
    reasoning, content, calls = "", "", {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        for d in parser.feed(piece, final=i == len(pieces) - 1):
            reasoning += d.reasoning or ""
            content += d.content or ""
            for tc in d.tool_calls:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id is not None:
                    assert entry["id"] is None, "the id comes once, with the name"
                    entry["id"], entry["name"] = tc.id, tc.function.name
                else:
                    assert entry["name"] is not None, "the name comes first"
                entry["arguments"] += tc.function.arguments or ""
    return reasoning, content, calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), RECORDED)
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_recorded_outputs_stream_as_openai_deltas(parser, text, content, calls, step):
    out = ChatOutputParser(None, get_tool_parser(parser), ToolMode("auto", NAMES))
    _, got_content, got_calls = _stream(out, text, step)
    assert (got_content or None) == content
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got_calls.items())]
    assert got == calls


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_streamed_calls_come_back_as_content(parser, text):
    out = ChatOutputParser(None, get_tool_parser(parser), ToolMode("auto", NAMES))
    _, content, calls = _stream(out, text, step=5)
    assert calls == {} and content == text


def test_streamed_content_before_a_call_is_not_held_back_past_the_marker():
    out = ChatOutputParser(None, get_tool_parser("hermes"), ToolMode("auto", NAMES))
    deltas = out.feed("Checking the weather <tool", final=False)
    assert "".join(d.content or "" for d in deltas) == "Checking the weather "


def test_named_choice_streams_arguments_as_generated():
    out = ChatOutputParser(None, None, ToolMode("named", NAMES, "get_time"))
    first = out.feed('{"zone": ', final=False)
    assert first[0].tool_calls[0].function.name == "get_time"
    assert first[-1].tool_calls[0].function.arguments == '{"zone": '
    last = out.feed('"UTC"}', final=True)
    assert last[0].tool_calls[0].function.arguments == '"UTC"}'
    whole = ChatOutputParser(None, None, ToolMode("named", NAMES, "get_time")).whole('{"zone":"X"}')
    assert whole.content is None and _calls(whole.calls) == [("get_time", {"zone": "X"})]


def test_required_choice_reads_the_constrained_array():
    out = ChatOutputParser(None, None, ToolMode("required", NAMES))
    parsed = out.whole('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert _calls(parsed.calls) == [("get_weather", {"city": "Oslo"})]
    cut = out.whole('[{"name": "get_weather", "argu')  # cut off by max_tokens
    assert cut.calls == [] and cut.content == '[{"name": "get_weather", "argu'


# ---- reasoning ----------------------------------------------------------------------------

REASONING = [
    (
        "deepseek_r1",
        "<think>\nThe user greets.\n</think>\n\nHello!",
        "\nThe user greets.\n",
        "Hello!",
    ),
    ("deepseek_r1", "The template opened it.</think>Hi.", "The template opened it.", "Hi."),
    ("deepseek_r1", "Still thinking when cut off", "Still thinking when cut off", ""),
    ("qwen3", "<think>\nShort.\n</think>\n\nAnswer.", "\nShort.\n", "Answer."),
    ("qwen3", "<think>\n\n</think>\n\nNo thinking.", "\n\n", "No thinking."),
    ("qwen3", "Plain answer, no block.", "", "Plain answer, no block."),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING)
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_reasoning_split_whole_and_streamed(name, text, reasoning, content, step):
    parser = get_reasoning_parser(name)
    whole = ChatOutputParser(parser).whole(text)
    assert (whole.reasoning or "", whole.content) == (reasoning, content)
    got_reasoning, got_content, _ = _stream(
        ChatOutputParser(get_reasoning_parser(name)), text, step
    )
    assert (got_reasoning, got_content) == (reasoning, content)


def test_tool_parsing_applies_after_the_reasoning():
    text = (
        "<think>I could write <tool_call> here, it is only thought.</think>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    out = ChatOutputParser(
        get_reasoning_parser("qwen3"), get_tool_parser("hermes"), ToolMode("auto", NAMES)
    )
    parsed = out.whole(text)
    assert parsed.reasoning == "I could write <tool_call> here, it is only thought."
    assert _calls(parsed.calls) == [("get_time", {})] and parsed.content is None


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")
