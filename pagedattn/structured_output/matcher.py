"""Matcher: one request's position in its grammar; fills its row of the token bitmask."""

from __future__ import annotations

import torch

from pagedattn.structured_output.compiler import compile_structured_outputs
from pagedattn.structured_output.params import InvalidStructuredOutputsError


class Matcher:
    """Wraps an xgrammar GrammarMatcher: which tokens may come next, and the tokens taken so far."""

    def __init__(self, compiled_grammar) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled_grammar)
        self.num_accepted = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, 1 bit per token)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        ok = self._matcher.accept_token(int(token_id))
        self.num_accepted += ok
        return ok

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""
        return self._matcher.is_terminated()

    def fork(self) -> Matcher:
        """An independent copy at the same position (a sibling sequence of an n > 1 request)."""
        twin = Matcher.__new__(Matcher)
        twin._matcher = self._matcher.fork()
        twin.num_accepted = self.num_accepted
        return twin


def new_matcher(params, tokenizer, vocab_size: int) -> Matcher | None:
    """A Matcher for a request's SamplingParams, or None when it has no structured output."""
    spec = getattr(params, "structured_outputs", None)
    if spec is None:
        return None
    return Matcher(compile_structured_outputs(spec, tokenizer, vocab_size))


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask [num_rows, ceil(vocab_size / 32)] int32."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf in the given rows (in place, float32 CPU)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


__all__ = [
    "InvalidStructuredOutputsError",
    "Matcher",
    "allocate_bitmask",
    "apply_bitmask",
    "new_matcher",
]
