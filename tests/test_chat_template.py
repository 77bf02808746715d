"""render_chat_template renders every template feature exactly as transformers does."""

from __future__ import annotations

import dataclasses
import enum

import pytest
from jinja2.exceptions import SecurityError, TemplateError
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

from pagedattn.chat_template import render_chat_template

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": 'Héllo <b>"x"</b> 日本 🤖', "name": None},
    {"role": "assistant", "content": "Hi.", "reasoning": "greet back"},
    {"role": "user", "content": "Again"},
]
TEMPLATES = {
    "tojson": "{{ messages | tojson }}|{{ messages[1] | tojson(indent=2, sort_keys=True) }}",
    "namespace": (
        "{% set ns = namespace(n=0, last='') %}{% for m in messages %}"
        "{% set ns.n = ns.n + 1 %}{% set ns.last = m.role %}{% endfor %}{{ ns.n }} {{ ns.last }}"
    ),
    "loop_controls": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "[{{ m.content }}]{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    ),
    "generation": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    ),
    "reasoning": (
        "{% for m in messages %}{{ m.reasoning_content | default('-') }}/"
        "{{ m.thinking | default('-') }}/{{ m.reasoning | default('-') }};{% endfor %}"
    ),
    "none_dropped": "{% for m in messages %}{{ 'name' in m }},{% endfor %}",
    "special_and_prompt": (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    ),
    "whitespace": (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n        U {{ m.content }}\n"
        "    {% else %}\n        O {{ m.content }}\n    {% endif %}\n{% endfor %}\n"
    ),
    "tools": "{% if tools %}{{ tools | tojson }}{% else %}none{% endif %}",
    "dict": "{{ dict(a=1, b=[2]) | tojson }}{{ dict.fromkeys(['x'], 0) | tojson }}",
    "extra_kwargs": "{{ custom }} {{ documents | tojson }}",
}


def _theirs(template: str, chat, **kwargs) -> str:
    """What tokenizer.apply_chat_template(chat, tokenize=False, ...) renders."""
    chat = _normalize_chat_messages(chat)
    rendered, _ = render_jinja_template(conversations=[chat], chat_template=template, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("generation", [False, True])
def test_renders_like_transformers(name: str, generation: bool) -> None:
    template = TEMPLATES[name]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    kwargs = {"add_generation_prompt": generation, **SPECIAL}
    if name == "tools":
        kwargs["tools"] = tools
    if name == "extra_kwargs":
        kwargs |= {"custom": "yes", "documents": [{"title": "t", "text": "x"}]}
    ours = render_chat_template(template, CHAT, **kwargs)
    assert ours == _theirs(template, CHAT, **kwargs)
    assert CHAT[2] == {"role": "assistant", "content": "Hi.", "reasoning": "greet back"}


def test_objects_become_plain_data() -> None:
    class Role(str, enum.Enum):  # noqa: UP042 (str() of it is "Role.USER", unlike StrEnum)
        USER = "user"

    @dataclasses.dataclass
    class Message:
        role: Role
        content: str
        extra: object = None

    chat = [Message(Role.USER, "hi", extra=object())]
    template = "{% for m in messages %}{{ m.role }}|{{ m.content }}|{{ m.extra }}{% endfor %}"
    assert render_chat_template(template, chat) == _theirs(template, chat) == "user|hi|<object>"


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{{ raise_exception('no system message allowed') }}", TemplateError),
        ("{% set ns = namespace(_x=1) %}", SecurityError),
        ("{% set ns = namespace() %}{% set ns._y = 1 %}", SecurityError),
        ("{{ messages.append(1) }}", SecurityError),
    ],
)
def test_refuses_like_transformers(template: str, error: type[Exception]) -> None:
    with pytest.raises(error) as ours:
        render_chat_template(template, CHAT)
    with pytest.raises(error):
        _theirs(template, CHAT)
    if error is TemplateError:
        assert str(ours.value) == "no system message allowed"


def test_sandbox_hides_internals() -> None:
    template = "{{ messages.__class__ }}|{{ (messages | first).__init__ }}"
    assert render_chat_template(template, CHAT) == _theirs(template, CHAT) == "|"
    with pytest.raises(SecurityError):
        render_chat_template("{{ ''.__class__.__mro__ }}", CHAT)
