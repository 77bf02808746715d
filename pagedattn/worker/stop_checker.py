"""Stop conditions of a request after each decode step: EOS, stop tokens, stop strings, length."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from pagedattn.sampling_params import SamplingParams

FINISH_REASON_STOP = "stop"
FINISH_REASON_LENGTH = "length"


class StopResult(NamedTuple):
    """Why a request finished (None: it goes on) and its output text, cut at a stop string."""

    finish_reason: str | None  # FINISH_REASON_STOP, FINISH_REASON_LENGTH or None
    # The stop token id or stop string that ended the request; None for EOS and for length.
    stop_reason: int | str | None
    text: str


def find_stop_string(
    text: str, num_new_chars: int, stop: Sequence[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """The first stop string that ends in the new tail of `text`, and where to cut the text."""
    best: tuple[str, int, int] | None = None  # (stop string, start index, cut index)
    for stop_str in stop:
        # A match must end inside the new characters; it may start in the older text.
        start = max(0, len(text) - num_new_chars - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index == -1 or (best is not None and index >= best[1]):
            continue
        cut = index + len(stop_str) if include_stop_str_in_output else index
        best = (stop_str, index, cut)
    return None if best is None else (best[0], best[2])


def check_stop(
    output_token_ids: Sequence[int],
    text: str,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    max_tokens: int,
    num_new_chars: int | None = None,
) -> StopResult:
    """Check one request after new tokens were appended to its output and text.

    `max_tokens` is the resolved cap (params.max_tokens, or what the context length allows);
    `num_new_chars` is how many characters at the end of `text` this step added (None: all).
    A request is never stopped by EOS, stop tokens or stop strings before min_tokens tokens.
    """
    num_output_tokens = len(output_token_ids)
    if num_new_chars is None:
        num_new_chars = len(text)
    if num_output_tokens >= params.min_tokens and num_output_tokens > 0:
        last_token_id = output_token_ids[-1]
        is_eos = not params.ignore_eos and last_token_id in eos_token_ids
        if is_eos or last_token_id in params.stop_token_ids:
            # The stop token's own text is dropped unless asked for (as vLLM does).
            if num_new_chars and not params.include_stop_str_in_output:
                text = text[: len(text) - num_new_chars]
            stop_reason = None if is_eos else last_token_id
            return StopResult(FINISH_REASON_STOP, stop_reason, text)
        if params.stop and num_new_chars:
            found = find_stop_string(
                text, num_new_chars, params.stop, params.include_stop_str_in_output
            )
            if found is not None:
                stop_str, cut = found
                return StopResult(FINISH_REASON_STOP, stop_str, text[:cut])
    if num_output_tokens >= max_tokens:
        return StopResult(FINISH_REASON_LENGTH, None, text)
    return StopResult(None, None, text)
