"""Size limits a server puts on one output constraint before compiling it.

Compile time grows with the constraint's size (a 40,000-string enum took 90 s of one core) and
with the counted repeats of its patterns: xgrammar unrolls `{m,n}`, so a JSON-schema string of
pattern `[a-z]{1,8000}` took 20 s and `[a-z]{1,50000}` over 165 s. A compile that slips through
these limits is still killed at the server's deadline (compile_worker.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)

MAX_CHOICES = 256
MAX_CHOICE_CHARS = 16_384
MAX_SCHEMA_CHARS = 16_384
MAX_REGEX_CHARS = 2_048
MAX_GRAMMAR_CHARS = 16_384
# The largest counted repeat a pattern may ask for: the bound of `{m,n}` (or `{m}`, `{m,}`),
# multiplied by the bounds of the repeated groups around it (`(x{1,40}){1,25}` counts 1,000).
MAX_REPEAT = 1_000


def check_constraint_size(params: StructuredOutputsParams) -> None:
    """Raise InvalidStructuredOutputsError if the constraint is larger than a server compiles."""
    kind, spec = params.key
    if kind == "choice":
        choices = params.choice or ()
        if len(choices) > MAX_CHOICES:
            _too_large(f"{len(choices)} choices", f"{MAX_CHOICES} choices")
        num_chars = sum(len(c) for c in choices)
        if num_chars > MAX_CHOICE_CHARS:
            _too_large(f"choices of {num_chars} characters", f"{MAX_CHOICE_CHARS} in all")
        return
    limits = {"json": MAX_SCHEMA_CHARS, "regex": MAX_REGEX_CHARS, "grammar": MAX_GRAMMAR_CHARS}
    limit = limits.get(kind)
    if limit is not None and len(spec) > limit:
        _too_large(f"a {kind} of {len(spec)} characters", f"{limit} characters")
    if kind == "regex":
        _check_repeats(spec, "regex", quoted_strings=False)
    elif kind == "grammar":
        _check_repeats(spec, "grammar", quoted_strings=True)
    elif kind == "json":
        for where, pattern in schema_patterns(params.json):
            _check_repeats(pattern, f"json schema {where}", quoted_strings=False)


def _too_large(what: str, limit: str) -> None:
    raise InvalidStructuredOutputsError(
        f"the output constraint is too large to compile: {what}, more than this server accepts "
        f"({limit}); send a smaller constraint (fewer choices, a shorter schema, regex or grammar)"
    )


def schema_patterns(schema: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(JSON path, regex) of every `pattern` and `patternProperties` key in a JSON schema."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "pattern" and isinstance(value, str):
                yield path, value
            elif key == "patternProperties" and isinstance(value, dict):
                for regex in value:
                    yield f"{path}[{regex!r}]", regex
            yield from schema_patterns(value, path)
    elif isinstance(schema, list):
        for index, item in enumerate(schema):
            yield from schema_patterns(item, f"{where}[{index}]")


def max_repeat(text: str, quoted_strings: bool = False) -> tuple[int, str]:
    """The largest counted repeat in a regex (or an EBNF grammar with `quoted_strings`), with
    the quantifier that asks for it: each `{m,n}` bound times those of the groups around it."""
    # (start, end, bound, quantifier text): the span a quantifier repeats.
    repeats: list[tuple[int, int, int, str]] = []
    groups: list[int] = []  # start offsets of the open groups
    last_atom = (0, 0)  # span of the atom a quantifier would repeat
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            last_atom, i = (i, i + 2), i + 2
        elif c == "[":
            end = _class_end(text, i)
            last_atom, i = (i, end), end
        elif quoted_strings and c == '"':
            end = _string_end(text, i)
            last_atom, i = (i, end), end
        elif c == "(":
            groups.append(i)
            i += 1
        elif c == ")":
            start = groups.pop() if groups else 0
            last_atom, i = (start, i + 1), i + 1
        elif c == "{":
            close = text.find("}", i)
            body = text[i + 1 : close] if close > 0 else ""
            low, sep, high = body.partition(",")
            if close > 0 and low.strip().isdigit() and (high.strip().isdigit() or not high.strip()):
                bound = int(high) if sep and high.strip() else int(low)
                repeats.append((*last_atom, bound, text[i : close + 1]))
                i = close + 1
            else:
                last_atom, i = (i, i + 1), i + 1
        else:
            last_atom, i = (i, i + 1), i + 1
    worst, worst_text = 0, ""
    for start, end, bound, quantifier in repeats:
        total = bound
        for outer_start, outer_end, outer_bound, _ in repeats:
            if (
                outer_start <= start
                and end <= outer_end
                and (outer_start, outer_end)
                != (
                    start,
                    end,
                )
            ):
                total *= max(outer_bound, 1)
        if total > worst:
            worst, worst_text = total, quantifier
    return worst, worst_text


def _class_end(text: str, start: int) -> int:
    """The offset just past the `]` closing the character class opened at `start`."""
    i = start + 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return min(i + 1, len(text))


def _string_end(text: str, start: int) -> int:
    """The offset just past the `"` closing the string literal opened at `start`."""
    i = start + 1
    while i < len(text) and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return min(i + 1, len(text))


def _check_repeats(text: str, where: str, quoted_strings: bool) -> None:
    worst, quantifier = max_repeat(text, quoted_strings)
    if worst > MAX_REPEAT:
        raise InvalidStructuredOutputsError(
            f"the output constraint is too large to compile: the {where} repeats "
            f"{quantifier} ({worst} times counting the groups around it), more than this "
            f"server accepts ({MAX_REPEAT} per pattern); use a smaller bound, or `*`/`+`"
        )
