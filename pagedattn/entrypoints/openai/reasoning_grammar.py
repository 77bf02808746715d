"""Output constraints that apply after the reasoning: the `<think>` block, then the constraint.

With `--reasoning-parser`, a structured-output constraint (response_format, structured_outputs,
or a `required`/named tool choice) must not force JSON from the first token, or the model could
not think. The constraint becomes an EBNF grammar: the parser's think block (free text up to
``</think>``) and then the original constraint, so xgrammar constrains only what follows the
reasoning, and the reasoning parser hands the constrained part to the client as content.
"""

from __future__ import annotations

import json
import re

from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)

# Any text without "</think>" in it.
THINK_BODY = (
    'think_body ::= ([^<] | "<" [^/] | "</" [^t] | "</t" [^h] | "</th" [^i] | "</thi" [^n]'
    ' | "</thin" [^k] | "</think" [^>])*'
)
# The block before the constraint, per parser: R1's template may open the block in the prompt, so
# its output may start inside it; Qwen3 writes the whole block, or none with thinking off.
THINK_HEAD = {
    "deepseek_r1": '("<think>")? think_body "</think>" [ \\n]*',
    "qwen3": '("<think>" think_body "</think>" [ \\n]*)?',
}
_ROOT_DEF = re.compile(r"^root ::=", re.M)
# `root` used as a rule reference (not in a string literal): a recursive schema.
_ROOT_REF = re.compile(r'(?<![\w"\\])root(?![\w"\\])')
_REGEX_SPECIAL = re.compile(r"([.^$*+?()\[\]{}|\\/-])")


def _grammar_of(params: StructuredOutputsParams):
    import xgrammar as xgr

    kind, spec = params.key
    if kind == "json":
        return xgr.Grammar.from_json_schema(json.dumps(params.json), any_whitespace=False)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        choices = "|".join(_REGEX_SPECIAL.sub(r"\\\1", c) for c in params.choice or ())
        return xgr.Grammar.from_regex(f"({choices})")
    return xgr.Grammar.from_ebnf(spec)


def after_reasoning(params: StructuredOutputsParams, parser_name: str) -> StructuredOutputsParams:
    """`params` with the reasoning parser's think block allowed before it (an EBNF grammar)."""
    try:
        ebnf = str(_grammar_of(params))
    except Exception as exc:  # xgrammar's errors: the compile step words them for the client
        raise InvalidStructuredOutputsError(
            f"structured_outputs=... is invalid: {str(exc).strip().splitlines()[0]}"
        ) from None
    body = _ROOT_DEF.sub("constrained_root ::=", ebnf)
    definitions = "\n".join(line.partition("::=")[2] for line in body.splitlines())
    if _ROOT_REF.search(definitions):
        raise InvalidStructuredOutputsError(
            "a recursive output constraint cannot follow a reasoning block on this server: "
            "flatten the schema, or start the server without --reasoning-parser"
        )
    head = THINK_HEAD[parser_name]
    return StructuredOutputsParams(
        grammar=f"root ::= {head} constrained_root\n{THINK_BODY}\n{body}"
    )
