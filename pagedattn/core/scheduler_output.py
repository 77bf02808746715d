"""The step's contract: what the scheduler hands the runner, and what comes back."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from pagedattn.core.request import Request, RequestStatus
    from pagedattn.sampling_params import SamplingParams


class ScheduledRequest(NamedTuple):
    """One sequence's share of a step: everything the runner needs to compute and sample it."""

    req_id: str
    token_ids: Sequence[int]  # the tokens computed this step (a prompt chunk or the last sample)
    start_pos: int  # absolute position of token_ids[0] (= tokens already in the cache)
    block_ids: tuple[list[int], ...]  # the whole block table, one list per KV cache group
    needs_sample: bool  # True when this step reaches the end of the sequence's known tokens
    sampling_params: SamplingParams | None
    seed: int | None  # the sequence's own sampler seed (None: the shared generator)
    # Live views of the sequence's tokens, for penalties (read, never written, by the runner).
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Siblings (n > 1) forked from this row after the step: (request id, seed) each; they
    # sample their first token from this row's logits too.
    forks: tuple[tuple[str, int | None], ...] = ()
    # Live view of the chained hashes of the sequence's full blocks (for the KV store).
    block_hashes: Sequence[bytes] = ()
    # Draft tokens appended to token_ids (the last len(spec_token_ids) of them): the runner
    # scores every position and accepts a prefix of them (speculative decoding).
    spec_token_ids: Sequence[int] = ()
    # The LoRA adapter the sequence runs under (None: the base model).
    lora_name: str | None = None


class DecodingRequest(NamedTuple):
    """A running sequence about to decode one token, as a drafter sees it (values and live views,
    read, never written): the speculator proposes drafts from these and returns them."""

    req_id: str
    token_ids: Sequence[int]  # prompt + output tokens (a live view)
    num_output_tokens: int
    max_tokens: int | None
    sampling_params: SamplingParams | None
    seed: int | None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)


class KVLoad(NamedTuple):
    """Blocks a sequence takes from the KV store before the forward, instead of computing them."""

    req_id: str
    first_block: int  # index in the block table of the first block to load
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class SchedulerStats:
    """Per-step scheduler counters."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_preemptions: int = 0  # preemptions during this step
    num_recomputed_tokens: int = 0  # computed tokens discarded by this step's preemptions
    num_prefill_tokens: int = 0  # tokens scheduled in prompt chunks (not one-token decodes)
    schedule_time_s: float = 0.0  # CPU time of schedule() (time.perf_counter)


@dataclass
class SchedulerOutput:
    """One step's batch: the scheduled sequences in batch order, and the block copies first."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # CoW (src, dst) first
    finished_req_ids: set[str] = field(default_factory=set)  # finished since the last step
    preempted_req_ids: set[str] = field(default_factory=set)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    kv_loads: list[KVLoad] = field(default_factory=list)  # second-tier hits to load first

    @property
    def is_empty(self) -> bool:
        """True when no token is scheduled (nothing to run)."""
        return self.total_num_scheduled_tokens == 0

    def subset(self, req_ids: set[str]) -> SchedulerOutput:
        """The same step restricted to some sequences (to retry them apart after a failure).

        NOTE: their store loads come along: a retry loads the blocks again (the same bytes)."""
        scheduled = [s for s in self.scheduled if s.req_id in req_ids]
        counts = {s.req_id: len(s.token_ids) for s in scheduled}
        loads = [load for load in self.kv_loads if load.req_id in req_ids]
        return SchedulerOutput(scheduled, counts, sum(counts.values()), kv_loads=loads)

    def with_kv_load_shortfalls(self, shortfalls: Mapping[str, int]) -> SchedulerOutput:
        """The step as the runner computes it once its store loads are done: a sequence whose
        load fell short (id -> the position of its first missing block) computes from there.

        A new output (this one is left as it is), without loads."""
        if not shortfalls:
            return dataclasses.replace(self, kv_loads=[])
        scheduled = []
        counts = dict(self.num_scheduled_tokens)
        total = self.total_num_scheduled_tokens
        for s in self.scheduled:
            start = shortfalls.get(s.req_id)
            if start is None or start >= s.start_pos:
                scheduled.append(s)
                continue
            tokens = [*s.prompt_token_ids, *s.output_token_ids]
            end = s.start_pos + len(s.token_ids)
            scheduled.append(s._replace(token_ids=tokens[start:end], start_pos=start))
            counts[s.req_id] = end - start
            total += s.start_pos - start
        return dataclasses.replace(
            self,
            scheduled=scheduled,
            num_scheduled_tokens=counts,
            total_num_scheduled_tokens=total,
            kv_loads=[],
        )

    def num_prompt_tokens_computed(self) -> int:
        """Prompt tokens the step computes (cached and loaded ones excluded)."""
        return sum(
            max(0, min(len(s.prompt_token_ids) - s.start_pos, len(s.token_ids)))
            for s in self.scheduled
        )


@dataclass
class StepTimings:
    """Wall time of the parts of one runner step, in seconds."""

    prepare: float = 0.0  # store loads and the batch's tensors
    forward: float = 0.0  # the model and the LM head
    sample: float = 0.0  # sampling, draft verification, store saves

    @property
    def total(self) -> float:
        """The whole step."""
        return self.prepare + self.forward + self.sample

    def add(self, other: StepTimings) -> None:
        """Add another (partial) step's times."""
        self.prepare += other.prepare
        self.forward += other.forward
        self.sample += other.sample


@dataclass
class RunnerOutput:
    """What one model step produced: one sampled token per sampling row, plus failures."""

    req_ids: list[str] = field(default_factory=list)  # forked siblings included
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None  # per row: the worker's TokenLogprobs, or None
    # Rows whose structured-output grammar ended with this token: they stop.
    stopped_req_ids: set[str] = field(default_factory=set)
    # Requests whose own part of the step failed: request id -> message; they sampled nothing.
    failed: dict[str, str] = field(default_factory=dict)
    # Sequences that asked for prompt logprobs: id -> [(prompt position, TokenLogprobs)].
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    # Sequences whose store load fell short: id -> the position they computed from instead.
    kv_load_shortfalls: dict[str, int] = field(default_factory=dict)
    # Speculative rows: id -> the accepted draft tokens, which come before the row's sampled one.
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    # Where the runner's time went (the scheduler's step budget learns from the total).
    timings: StepTimings = field(default_factory=StepTimings)
    # Pooling sequences whose prompt ended this step: id -> pooled final hidden state.
    pooled: dict[str, list[float]] = field(default_factory=dict)

    def merge(self, other: RunnerOutput) -> None:
        """Append another (partial) output of the same step."""
        if other.logprobs is not None or self.logprobs is not None:
            # NOTE: one entry per row on both sides (None for rows that asked for none).
            mine = self.logprobs or [None] * len(self.req_ids)
            self.logprobs = mine + (other.logprobs or [None] * len(other.req_ids))
        self.req_ids += other.req_ids
        self.sampled_token_ids += other.sampled_token_ids
        self.stopped_req_ids |= other.stopped_req_ids
        self.failed.update(other.failed)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.pooled.update(other.pooled)
        self.kv_load_shortfalls.update(other.kv_load_shortfalls)
        self.accepted_draft_ids.update(other.accepted_draft_ids)
        self.timings.add(other.timings)


class CoreOutput(NamedTuple):
    """What the scheduler made of one sequence's step: its new token and whether it ended."""

    req_id: str
    new_token_ids: list[int]
    logprobs: Any  # the worker's TokenLogprobs of the new token, or None
    status: RequestStatus | None  # a FINISHED_* status when the sequence ended this step
    stop_reason: int | None = None  # the stop token id that ended it (not EOS)
    forked_from: str | None = None  # set on a sibling's first output: its parent's id
    fork: Request | None = None  # ... and the sibling itself
    error: str | None = None  # set with FINISHED_ERROR
