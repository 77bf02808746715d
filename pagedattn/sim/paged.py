"""Replay a trace through the real Scheduler and KVCacheManager with a stand-in model.

The stand-in model computes nothing: after each ``schedule()`` every request whose scheduled
tokens reach the end of its sequence "samples" one token, and finishes when it has produced the
trace's ``output_len`` tokens. Memory is measured exactly as for the baselines (see
``pagedattn.sim.metrics``), from the manager's block tables.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedattn.config import CacheConfig, SchedulerConfig
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from pagedattn.core.request import Request
from pagedattn.core.scheduler import Scheduler
from pagedattn.core.scheduler_output import RunnerOutput
from pagedattn.sampling_params import SamplingParams
from pagedattn.sim.contiguous import SimAllocationError
from pagedattn.sim.metrics import MemoryMeter, SimResult
from pagedattn.sim.stepper import SimSchedulerConfig
from pagedattn.sim.traces import TraceError, TraceRequest

VOCAB_SIZE = 32000
# (step index, scheduler, manager) after each schedule(): for snapshots and extra metrics.
StepHook = Callable[[int, Scheduler, KVCacheManager], None]


@dataclass(frozen=True)
class PagedRun:
    """The metrics of a paged replay and the engine parts it ran on (for invariant checks)."""

    result: SimResult
    scheduler: Scheduler
    kv_cache_manager: KVCacheManager


def random_prompts(
    seed: int = 0, prefix: list[int] | None = None
) -> Callable[[TraceRequest], list[int]]:
    """Prompt ids per trace request: ``prefix``, then random ids (no accidental prefix hits) up to
    ``prompt_len`` (which counts the prefix)."""
    rng = np.random.default_rng(seed)
    shared = list(prefix or [])

    def make(req: TraceRequest) -> list[int]:
        if req.prompt_len <= len(shared):
            raise TraceError(
                f"{req.request_id}: prompt_len={req.prompt_len} leaves no room after the "
                f"{len(shared)}-token prefix; build the trace with with_system_prompt()"
            )
        return shared + rng.integers(0, VOCAB_SIZE, req.prompt_len - len(shared)).tolist()

    return make


def build_engine_core(
    block_size: int,
    capacity_slots: int,
    config: SimSchedulerConfig,
    max_seq_len: int,
    enable_caching: bool,
) -> tuple[Scheduler, KVCacheManager]:
    """A real KVCacheManager of ``capacity_slots // block_size`` blocks and a real Scheduler."""
    num_blocks = capacity_slots // block_size
    cache_config = CacheConfig(
        block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_caching
    )
    manager = KVCacheManager(
        [KVCacheGroupSpec(("sim",), FullAttentionSpec(block_size))],
        num_blocks,
        enable_caching=enable_caching,
        hash_seed=cache_config.hash_seed,
    )
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_seq_len,
    )
    return Scheduler(scheduler_config, cache_config, manager, max_seq_len), manager


def run_paged(
    trace: list[TraceRequest],
    *,
    block_size: int,
    capacity_slots: int,
    config: SimSchedulerConfig,
    max_seq_len: int,
    enable_caching: bool = False,
    prompts: Callable[[TraceRequest], list[int]] | None = None,
    on_step: StepHook | None = None,
    name: str | None = None,
) -> PagedRun:
    """Replay ``trace`` through the real scheduler; returns metrics and the drained engine core."""
    scheduler, manager = build_engine_core(
        block_size, capacity_slots, config, max_seq_len, enable_caching
    )
    prompts = prompts or random_prompts()
    pending = deque(sorted(trace, key=lambda r: r.arrival_time))
    by_id: dict[str, TraceRequest] = {}
    meter = MemoryMeter(manager.num_usable_blocks * block_size)
    num_output_tokens = 0
    clock = 0.0
    while pending or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            clock = max(clock, math.ceil(pending[0].arrival_time))
        while pending and pending[0].arrival_time <= clock:
            req = pending.popleft()
            by_id[req.request_id] = req
            params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
            scheduler.add_request(
                Request(
                    req.request_id,
                    prompts(req),
                    params,
                    arrival_time=req.arrival_time,
                    max_tokens=req.output_len,
                    block_size=block_size,
                    hash_seed=manager.hash_seed,
                )
            )
        output = scheduler.schedule()
        if output.is_empty:
            raise SimAllocationError(
                f"the scheduler scheduled nothing with {len(scheduler.running)} running and "
                f"{len(scheduler.waiting)} waiting requests: the pool cannot fit the head request"
            )
        if on_step is not None:
            on_step(meter.num_steps, scheduler, manager)
        running = scheduler.running
        held = [r.num_computed_tokens for r in running]
        allocated = [
            sum(map(len, manager.get_block_ids(r.request_id))) * block_size for r in running
        ]
        final = [by_id[r.request_id].final_kv_len for r in running]
        num_used_blocks = manager.num_usable_blocks - manager.num_free_blocks
        meter.record(
            held, allocated, final, num_used_blocks * block_size, 0, len(scheduler.waiting)
        )
        # NOTE: the stand-in model samples token ids in turn; the scheduler stops each request
        # at its output length (max_tokens).
        sampling = [s.req_id for s in output.scheduled if s.needs_sample]
        tokens = [(num_output_tokens + i) % VOCAB_SIZE for i in range(len(sampling))]
        num_output_tokens += len(sampling)
        scheduler.update_from_output(output, RunnerOutput(sampling, tokens))
        clock += 1
        if meter.num_steps >= config.max_steps:
            raise SimAllocationError(f"paged run made no progress after {config.max_steps} steps")
    result = meter.result(
        name or f"paged-B{block_size}", num_output_tokens, scheduler.num_preemptions_total
    )
    return PagedRun(result, scheduler, manager)
