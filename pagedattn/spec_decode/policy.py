"""When to speculate: which requests may (their sampling keeps its meaning) and at what batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedattn.cpu.tuner import DECODE_ROWS
from pagedattn.sampling_params import SAMPLING_EPS

if TYPE_CHECKING:
    from pagedattn.config import SpeculativeConfig
    from pagedattn.core.scheduler_output import DecodingRequest


def can_speculate(request: DecodingRequest) -> bool:
    """True when verifying drafts gives exactly the distribution of plain sampling.

    NOTE: penalties, logit_bias, min_tokens and grammars change the logits with every token, and
    logprobs are reported per token; such requests decode one token per step. A seeded request
    that samples keeps its seed's exact stream, so it does not speculate either.
    """
    params = request.sampling_params
    if params is None:
        return True
    greedy = params.temperature < SAMPLING_EPS
    return (
        (greedy or request.seed is None)
        and params.logprobs is None
        and params.structured_outputs is None
        and not params.logit_bias
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and request.num_output_tokens >= params.min_tokens
    )


def num_draft_slots(
    request: DecodingRequest, num_speculative_tokens: int, max_model_len: int
) -> int:
    """How many drafts the request can take: K, but never past max_tokens or max_model_len.

    NOTE: a step that accepts every draft also emits one more token, so max_tokens caps at
    remaining - 1; the last draft's position must stay below max_model_len.
    """
    num_left = max_model_len - request.num_tokens
    if request.max_tokens is not None:
        num_left = min(num_left, request.max_tokens - request.num_output_tokens - 1)
    return max(0, min(num_speculative_tokens, num_left))


class BatchSizePolicy:
    """Speculation pays at small batches only: off while more than max_batch_size sequences are
    unfinished (a wider forward then costs more than the accepted tokens save)."""

    def __init__(self, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size

    def enabled(self, num_unfinished: int) -> bool:
        """True when this step may carry drafts."""
        return num_unfinished <= self.max_batch_size


def verify_row_bound(spec: SpeculativeConfig) -> int:
    """Exclusive bound on the rows of a step that verifies drafts (KernelOptions.verify_rows):
    K + 1 per sequence, at most speculative_disable_by_batch_size sequences; 0 without
    speculation.

    NOTE: capped below tuner.DECODE_ROWS, the batch at which the decode kernel was measured.
    """
    if spec.speculative_method is None:
        return 0
    rows = (spec.num_speculative_tokens + 1) * spec.speculative_disable_by_batch_size
    return min(rows, DECODE_ROWS - 1) + 1
