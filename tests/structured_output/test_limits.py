"""Counted repeats in patterns are capped before compiling (issue 52: a 42-character schema of
pattern `[a-z]{1,50000}` held the grammar compiler for minutes)."""

from __future__ import annotations

import pytest

from pagedattn.structured_output.limits import MAX_REPEAT, check_constraint_size, max_repeat
from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("[a-z]{1,50000}", 50000),
        ("a{3}", 3),
        ("a{7,}", 7),
        (r"(\d{1,3}\.){3}\d{1,3}", 9),
        ("([a-z]{1,40}){1,25}", 1000),
        ("((a{1,10}-){1,10}){1,11}", 1100),
        (r"\{1,5000\}", 0),  # escaped braces are text
        ("[{1,5000}]", 0),  # so are braces in a class
        ("x{,5}", 0),  # not a quantifier
    ],
)
def test_max_repeat_counts_bounds_times_the_groups_around_them(pattern, expected):
    assert max_repeat(pattern)[0] == expected


def test_over_the_cap_names_the_field_and_the_cap_in_every_kind():
    too_many = "[a-z]{1," + str(MAX_REPEAT + 1) + "}"
    cases = {
        "properties.name.pattern": StructuredOutputsParams(
            json={"type": "object", "properties": {"name": {"type": "string", "pattern": too_many}}}
        ),
        "regex": StructuredOutputsParams(regex=too_many),
        "grammar": StructuredOutputsParams(grammar=f"root ::= {too_many}"),
    }
    for where, params in cases.items():
        with pytest.raises(InvalidStructuredOutputsError, match="too large to compile") as info:
            check_constraint_size(params)
        message = str(info.value)
        assert where in message and str(MAX_REPEAT) in message and f"{MAX_REPEAT + 1}" in message


def test_within_the_cap_and_quoted_text_pass():
    check_constraint_size(StructuredOutputsParams(regex="[a-z]{1," + str(MAX_REPEAT) + "}"))
    check_constraint_size(StructuredOutputsParams(grammar='root ::= "{1,99999}" [a-z]{1,20}'))
    check_constraint_size(StructuredOutputsParams(json={"type": "string", "maxLength": 50000}))
