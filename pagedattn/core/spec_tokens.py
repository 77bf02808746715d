"""Draft tokens on the scheduler's side: what a drafter reads, the slots the drafts take, and the
rollback after their verification.

NOTE: only core/ writes a request's ``spec_token_ids`` (tests/core/test_spec_token_writers.py
checks it): a drafter returns its drafts and the engine hands them to
``Scheduler.update_draft_token_ids``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from pagedattn.core.scheduler_output import DecodingRequest
from pagedattn.core.stop import check_token_stop

if TYPE_CHECKING:
    from pagedattn.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from pagedattn.core.request import Request, RequestStatus


def decoding_requests(running: Iterable[Request]) -> Iterator[DecodingRequest]:
    """The requests about to decode one token, in order, as a drafter reads them."""
    for request in running:
        if request.num_tokens - request.num_computed_tokens == 1:
            yield DecodingRequest(
                request.request_id,
                request.all_token_ids,
                request.num_output_tokens,
                request.max_tokens,
                request.sampling_params,
                request.seed,
            )


def reserve_draft_slots(
    manager: KVCacheManager, request: Request, num_new_tokens: int, token_budget: int
) -> tuple[int, KVCacheBlocks | None]:
    """Slots for a decode step's draft tokens too; returns the step's tokens and its blocks
    (None: not allocated yet).

    NOTE: without room for its drafts the step drops them (a plain step) before it would preempt
    anyone; drafts past the budget are trimmed.
    """
    new_blocks = None
    num_spec = min(len(request.spec_token_ids), token_budget - 1)
    if num_new_tokens == 1 and request.num_tokens - request.num_computed_tokens == 1:
        new_blocks = manager.allocate_slots(request, 1 + num_spec)
    if new_blocks is None or num_spec == 0:
        request.spec_token_ids = []
    else:
        num_new_tokens += num_spec
        del request.spec_token_ids[num_spec:]
    return num_new_tokens, new_blocks


def append_verified(
    manager: KVCacheManager, request: Request, token_ids: list[int], max_model_len: int
) -> tuple[RequestStatus | None, int | None, list[int]]:
    """Append a verified step's tokens one by one (stops apply to each), then roll back; returns
    the stop status and reason (or None) and the tokens appended.

    NOTE: the step computed the last token and every draft; after it only the accepted tokens
    count as computed, and the blocks past them (rejected drafts) are freed.
    """
    status = stop_reason = None
    appended = []
    for token in token_ids:
        request.append_output_token_ids(token)
        appended.append(token)
        status, stop_reason = check_token_stop(request, max_model_len)
        if status is not None:
            break
    request.spec_token_ids = []
    request.num_computed_tokens = request.num_tokens - 1
    manager.free_rejected_slots(request)
    return status, stop_reason, appended
