"""A compact continuous-batching loop for the baseline policies, stepping like the real scheduler.

Each step has a token budget. Running requests go first (one decode token each, or the next
prefill chunk); when one cannot grow, the most recently admitted request is preempted (its KV is
freed and recomputed later). Then waiting requests are admitted first-come-first-served until the
budget, the batch size or memory stops the queue (head-of-line blocking, as in vLLM).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pagedattn.sim.contiguous import MemoryPolicy, SimAllocationError
from pagedattn.sim.metrics import MemoryMeter, SimResult
from pagedattn.sim.traces import TraceRequest


@dataclass(frozen=True)
class SimSchedulerConfig:
    """Batch limits shared by every policy of one comparison."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_steps: int = 1_000_000

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_steps < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and max_steps must be >= 1")


class _SimRequest:
    """Progress of one trace request."""

    __slots__ = ("trace", "num_computed", "num_output")

    def __init__(self, trace: TraceRequest) -> None:
        self.trace = trace
        self.num_computed = 0  # KV tokens in the cache
        self.num_output = 0

    @property
    def num_tokens(self) -> int:
        return self.trace.prompt_len + self.num_output


def run_policy(
    trace: list[TraceRequest], policy: MemoryPolicy, config: SimSchedulerConfig
) -> SimResult:
    """Replay ``trace`` under ``policy`` and return its time-averaged memory metrics."""
    pending = deque(sorted(trace, key=lambda r: r.arrival_time))
    waiting: deque[_SimRequest] = deque()
    running: list[_SimRequest] = []
    meter = MemoryMeter(policy.capacity_slots)
    num_preemptions = num_output_tokens = 0
    clock = 0.0
    while pending or waiting or running:
        if not waiting and not running:
            clock = max(clock, math.ceil(pending[0].arrival_time))
        while pending and pending[0].arrival_time <= clock:
            waiting.append(_SimRequest(pending.popleft()))
        budget = config.max_num_batched_tokens
        scheduled: list[tuple[_SimRequest, int]] = []
        preempted_this_step = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            preempted_self = False
            while not policy.allocate(req.trace, req.num_computed + n):
                victim = running.pop()  # the most recently admitted
                policy.free(victim.trace.request_id)
                victim.num_computed = 0
                waiting.appendleft(victim)
                num_preemptions += 1
                preempted_this_step = True
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break  # nothing newer is left to grow this step
            scheduled.append((req, n))
            budget -= n
            i += 1
        while (
            waiting
            and not preempted_this_step
            and budget > 0
            and len(running) < config.max_num_seqs
        ):
            req = waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if not policy.allocate(req.trace, n):
                if not running:
                    raise SimAllocationError(
                        f"{policy.name}: request {req.trace.request_id} can never fit in "
                        f"{policy.capacity_slots} slots; give the simulation more memory"
                    )
                break
            waiting.popleft()
            running.append(req)
            scheduled.append((req, n))
            budget -= n
        for req, n in scheduled:
            req.num_computed += n
        held = [r.num_computed for r in running]
        allocated = [policy.allocated_slots(r.trace.request_id) for r in running]
        final = [r.trace.final_kv_len for r in running]
        stranded = policy.stranded_free_slots(waiting[0].trace) if waiting else 0
        meter.record(held, allocated, final, policy.total_allocated(), stranded, len(waiting))
        for req, _ in scheduled:
            if req.num_computed == req.num_tokens:  # caught up: the step samples a token
                req.num_output += 1
                num_output_tokens += 1
                if req.num_output == req.trace.output_len:
                    running.remove(req)
                    policy.free(req.trace.request_id)
        clock += 1
        if meter.num_steps >= config.max_steps:
            raise SimAllocationError(f"{policy.name}: no progress after {config.max_steps} steps")
    return meter.result(policy.name, num_output_tokens, num_preemptions)
