"""What the scheduler hands to the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedattn.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen yet: first scheduling, a resume or a forked child."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (or inherited by a fork); recomputed with the prompt.
    output_token_ids: list[int]
    block_ids: tuple[list[int], ...]  # the whole block table, one list per KV cache group
    num_computed_tokens: int  # tokens already in the cache before this step (prefix-cache hits)
    sampling_params: SamplingParams | None = None


@dataclass
class CachedRequestData:
    """A request the runner already holds, continuing with a decode token or a prefill chunk."""

    req_id: str
    new_token_ids: list[int]  # the tokens fed this step (all_token_ids[num_computed_tokens:][:n])
    new_block_ids: tuple[list[int], ...]  # blocks appended to each group's table this step
    num_computed_tokens: int  # tokens in the cache before this step
    # The whole table when a block was replaced in place (copy-on-write); None: just append.
    block_ids: tuple[list[int], ...] | None = None


@dataclass
class SchedulerStats:
    """Per-step scheduler counters."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_preemptions: int = 0  # preemptions during this step
    num_recomputed_tokens: int = 0  # computed tokens discarded by this step's preemptions
    schedule_time_s: float = 0.0  # CPU time of schedule() (time.perf_counter)


@dataclass
class SchedulerOutput:
    """One step's batch: which requests run, how many tokens each, and their blocks."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # CoW (src, dst) first
    finished_req_ids: set[str] = field(default_factory=set)  # finished since the last step
    preempted_req_ids: set[str] = field(default_factory=set)  # the runner drops their state
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    @property
    def is_empty(self) -> bool:
        """True when no token is scheduled (nothing to run)."""
        return self.total_num_scheduled_tokens == 0
