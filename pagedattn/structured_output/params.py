"""StructuredOutputsParams: what an output must match (JSON schema, regex, choice, grammar).

Pure Python (no xgrammar import), so that SamplingParams can hold one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class InvalidStructuredOutputsError(ValueError):
    """A structured-output spec is malformed or cannot be compiled; the message says why."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a schema), `json_object`, `regex`, `choice` or `grammar`."""

    # A JSON schema, as a dict or as JSON text.
    json: dict[str, Any] | str | None = None
    # Any JSON object (OpenAI's response_format {"type": "json_object"}).
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    # An EBNF grammar (GBNF, as llama.cpp and xgrammar read it).
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as exc:
                raise InvalidStructuredOutputsError(
                    f"structured_outputs.json is not valid JSON: {exc}"
                ) from None
            object.__setattr__(self, "json", parsed)
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidStructuredOutputsError(
                "structured_outputs=... is invalid: set exactly one of json, json_object, regex, "
                f"choice, grammar (got {given or 'none'})"
            )
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise InvalidStructuredOutputsError(
                "structured_outputs.json must be a JSON schema object"
            )
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise InvalidStructuredOutputsError(
                "structured_outputs.choice must be a list of non-empty strings"
            )

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): equal constraints share one compiled grammar."""
        if self.json is not None:
            return "json", json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar or ""
