"""Reasoning parsers (`--reasoning-parser`): a model's ``<think>`` block -> `reasoning_content`.

- deepseek_r1: the reasoning ends at ``</think>``; its ``<think>`` may be in the prompt (R1's
  template opens it), so text before ``</think>`` is reasoning even without the opening tag, and
  an output with no ``</think>`` at all is still reasoning (the model was cut off thinking).
- qwen3: a block only when the output opens it with ``<think>``; otherwise it is all content
  (Qwen3 with thinking off writes no block, or an empty one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser(ABC):
    """Splits a model's output into its reasoning and its content."""

    name: ClassVar[str]

    def split(self, text: str, final: bool) -> tuple[str, str, int]:
        """(reasoning, content, num_held): the reasoning and content of `text` so far.

        While streaming (`final` False) the last `num_held` characters may still turn out to be
        part of a tag and are in neither.
        """
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            return _after_end(stripped[len(THINK_START) :], final)
        if not final and THINK_START.startswith(stripped):
            return "", "", len(text)
        return self.split_unopened(text, final)

    @abstractmethod
    def split_unopened(self, text: str, final: bool) -> tuple[str, str, int]:
        """`split` of an output that does not open with ``<think>``."""


def _held(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _after_end(body: str, final: bool) -> tuple[str, str, int]:
    """`body` is reasoning up to THINK_END; what follows is content (leading newlines dropped)."""
    end = body.find(THINK_END)
    if end >= 0:
        return body[:end], body[end + len(THINK_END) :].lstrip("\n"), 0
    held = 0 if final else _held(body, THINK_END)
    return body[: len(body) - held], "", held


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Reasoning up to ``</think>``, opened in the output or in the prompt."""

    name = "deepseek_r1"

    def split_unopened(self, text: str, final: bool) -> tuple[str, str, int]:
        return _after_end(text, final)


class Qwen3ReasoningParser(ReasoningParser):
    """A ``<think>...</think>`` block at the start of the output; without one, all content."""

    name = "qwen3"

    def split_unopened(self, text: str, final: bool) -> tuple[str, str, int]:
        return "", text, 0


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered under `name`; ValueError naming the choices otherwise."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"--reasoning-parser={name!r} is invalid: use one of {sorted(REASONING_PARSERS)}"
        ) from None
