"""The runner's side of speculation: verify each speculative row of a step's logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedattn.core.scheduler_output import RunnerOutput, ScheduledRequest
from pagedattn.worker.rejection_sampler import verify


def verify_rows(
    output: RunnerOutput,
    logits: torch.Tensor,
    speculative: Sequence[tuple[ScheduledRequest, int]],
    generator: torch.Generator | None,
) -> None:
    """Append each speculative sequence's result to output: its next token, accepted drafts.

    logits rows last - K .. last score the sequence's last known token and its K drafts. A row
    whose verification fails is reported failed; the others go on.
    """
    for sched, last in speculative:
        draft = sched.spec_token_ids
        try:
            accepted, token = verify(
                logits[last - len(draft) : last + 1], draft, sched.sampling_params, generator
            )
        except Exception as exc:
            output.failed[sched.req_id] = f"verifying draft tokens failed: {exc}"
            continue
        if output.logprobs is not None:
            output.logprobs.append(None)  # NOTE: logprob requests never speculate (policy)
        output.req_ids.append(sched.req_id)
        output.sampled_token_ids.append(token)
        output.accepted_draft_ids[sched.req_id] = accepted
