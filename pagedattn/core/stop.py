"""Stops the scheduler owns: EOS, stop token ids and length (stop strings are the engine's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedattn.core.request import RequestStatus

if TYPE_CHECKING:
    from pagedattn.core.request import Request

# Seeds stay in [0, 2**63): what torch.Generator.manual_seed and every client accept.
SEED_LIMIT = 2**63
_GOLDEN = 0x9E3779B97F4A7C15


def derive_seed(seed: int | None, index: int) -> int | None:
    """The seed of sibling `index` of a seeded request (index 0 keeps the request's seed)."""
    if seed is None:
        return None
    return (seed + index * _GOLDEN) % SEED_LIMIT


def check_token_stop(
    request: Request, max_model_len: int
) -> tuple[RequestStatus | None, int | None]:
    """After a token was appended: (FINISHED_* status or None, the stop token id or None).

    EOS and stop token ids count only from min_tokens output tokens on; length always counts.
    """
    num_output = request.num_output_tokens
    params = request.sampling_params
    last = request.output_token_ids[-1]
    min_tokens = params.min_tokens if params is not None else 0
    if num_output >= min_tokens:
        ignore_eos = params is not None and params.ignore_eos
        if not ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if params is not None and last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, last
    if request.max_tokens is not None and num_output >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None
