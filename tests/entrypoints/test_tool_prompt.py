"""How tools reach the model: a template's own tool support, or the generic tool prompt."""

from __future__ import annotations

import json

from pagedattn.chat_template import (
    render_chat_template,
    template_supports_tools,
    tool_conversation,
)
from pagedattn.entrypoints.openai.chat_tools import constraint_schema, template_messages, tool_mode
from pagedattn.entrypoints.openai.protocol import ChatCompletionRequest

SMOLLM2 = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A Qwen2.5-like template: tools in the system turn, calls and results in its own tags.
NATIVE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}\n"
    "{% endfor %}"
)
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
HISTORY = {
    "model": "m",
    "tools": [TOOL],
    "messages": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ],
}


def test_template_without_tool_support_gets_the_generic_prompt():
    assert not template_supports_tools(SMOLLM2) and template_supports_tools(NATIVE)
    req = ChatCompletionRequest.model_validate(HISTORY)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    text = render_chat_template(SMOLLM2, template_messages(req.messages, tools, native=False))
    assert text.startswith("<|im_start|>system\nYou can call functions.")
    assert '"name": "get_weather"' in text  # the tool's JSON is in the prompt
    # the earlier call in the prompt's own format, the result as a user turn
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in text


def test_template_with_tool_support_gets_tools_and_calls_as_objects():
    req = ChatCompletionRequest.model_validate(HISTORY)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    messages = template_messages(req.messages, tools, native=True)
    text = render_chat_template(NATIVE, messages, tools=tools)
    assert text.startswith("TOOLS:get_weather;")
    assert 'CALL get_weather {"city": "Oslo"}' in text  # arguments as an object, not a string
    assert messages[2] == {"role": "tool", "content": "rain", "tool_call_id": "c1"}


def test_a_system_message_keeps_its_text_before_the_generic_prompt():
    out = tool_conversation(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        [TOOL],
        native=False,
    )
    assert out[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert len(out) == 2


def test_required_schema_is_an_array_of_named_calls():
    req = ChatCompletionRequest.model_validate(
        {**HISTORY, "tool_choice": "required", "parallel_tool_calls": False}
    )
    mode = tool_mode(req, auto_enabled=False, has_parser=False)
    schema = constraint_schema(req, mode)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    (one,) = schema["items"]["anyOf"]
    assert one["properties"]["name"] == {"enum": ["get_weather"]}
    json.dumps(schema)
