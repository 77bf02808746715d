"""The engine's side of speculation: propose drafts before each step, count what was accepted."""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedattn.spec_decode.ngram_proposer import NgramProposer
from pagedattn.spec_decode.policy import BatchSizePolicy, can_speculate, num_draft_slots

if TYPE_CHECKING:
    from pagedattn.config import SpeculativeConfig
    from pagedattn.core.scheduler_output import DecodingRequest, RunnerOutput, SchedulerOutput


@dataclass
class SpecDecodeStats:
    """Speculation counters since start-up (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # sequence-steps that carried draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_steps_off: int = 0  # steps the batch-size policy turned speculation off

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculative step emits on average: 1 + accepted drafts per draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """Proposes drafts for the requests about to decode before the scheduler runs (the engine
    hands them to ``Scheduler.update_draft_token_ids``), and counts the verified outcome after
    the step. It reads requests, never writes them."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer=None) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.policy = BatchSizePolicy(config.speculative_disable_by_batch_size)
        # NOTE: a proposer has propose(requests, num_slots) -> list of drafts per request.
        self.proposer = proposer or _NgramBatch(NgramProposer(config.ngram_min, config.ngram_max))
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * self.num_speculative_tokens)

    def propose(
        self, decoding: Iterable[DecodingRequest], num_unfinished: int
    ) -> dict[str, list[int]]:
        """This step's drafts: request id -> draft tokens (empty: none this step) for each
        request about to decode that may speculate; {} while the batch-size policy is off
        (``decoding`` is then not read)."""
        if not self.policy.enabled(num_unfinished):
            self.stats.num_steps_off += 1
            return {}
        ready = []
        slots = []
        for request in decoding:
            if not can_speculate(request):
                continue
            num_slots = num_draft_slots(request, self.num_speculative_tokens, self.max_model_len)
            if num_slots > 0:
                ready.append(request)
                slots.append(num_slots)
        if not ready:
            return {}
        drafts = self.proposer.propose(ready, slots)
        return {r.req_id: list(draft) for r, draft in zip(ready, drafts, strict=True)}

    def observe(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> None:
        """Count the drafts of a step and how many of each were accepted."""
        stats = self.stats
        per_pos = stats.num_accepted_tokens_per_pos
        accepted = runner_output.accepted_draft_ids
        for s in scheduler_output.scheduled:
            if not s.spec_token_ids or s.req_id not in accepted:
                continue
            num_accepted = len(accepted[s.req_id])
            stats.num_drafts += 1
            stats.num_draft_tokens += len(s.spec_token_ids)
            stats.num_accepted_tokens += num_accepted
            for pos in range(num_accepted):
                per_pos[pos] += 1

    def release_finished(self, live_request_ids: Container[str]) -> None:
        """Forget sequences no longer live (a draft model frees their blocks)."""
        finish = getattr(self.proposer, "finish", None)
        seqs = getattr(self.proposer, "seqs", None)
        if finish is not None and seqs:
            finish([req_id for req_id in seqs if req_id not in live_request_ids])


class _NgramBatch:
    """Prompt lookup for each request on its own tokens."""

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram

    def propose(self, requests: Sequence[DecodingRequest], slots: Sequence[int]) -> list[list[int]]:
        return [self.ngram.propose(r.token_ids, k) for r, k in zip(requests, slots, strict=True)]
