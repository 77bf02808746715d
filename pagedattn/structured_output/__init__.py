"""Structured output: JSON schema, regex, choice and grammar constraints via xgrammar bitmasks."""

from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)

__all__ = ["InvalidStructuredOutputsError", "StructuredOutputsParams", "new_matcher"]


def __getattr__(name: str):
    # NOTE: lazy, so that importing SamplingParams never imports xgrammar or torch.
    if name in ("new_matcher", "Matcher", "compile_structured_outputs"):
        from pagedattn.structured_output import compiler, matcher

        return getattr(matcher, name, None) or getattr(compiler, name)
    raise AttributeError(name)
