"""Continuous batching: chunked prefill, prefix-cache reuse and preemption by recompute."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedattn.core.kv_cache_spec import SlidingWindowSpec
from pagedattn.core.request import RequestStatus
from pagedattn.core.request_queue import create_request_queue
from pagedattn.core.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from pagedattn.core.single_type_manager import cdiv

if TYPE_CHECKING:
    from pagedattn.config import CacheConfig, SchedulerConfig
    from pagedattn.core.kv_cache_manager import KVCacheManager
    from pagedattn.core.request import Request


class RequestRejectedError(ValueError):
    """A request can never be scheduled (too long for the model or for the KV cache)."""


class Scheduler:
    """Decides each step which requests run and how many tokens each computes.

    NOTE: ``request.num_computed_tokens`` advances in ``schedule()`` (as in vLLM v1): at the end of
    a step every scheduled token counts as computed, so ``update_from_output`` only appends the
    sampled tokens of requests whose prefill is complete and frees the finished ones. A scheduled
    request yields a token this step iff ``num_computed_tokens == num_tokens`` after schedule().
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.policy = scheduler_config.policy
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Requests in `running` the runner has not seen (forked children): sent as new requests.
        self._unseen_running: set[str] = set()
        self._finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0

    # Requests in and out.

    def add_request(self, request: Request, max_tokens: int | None = None) -> None:
        """Queue a request; raises RequestRejectedError if it can never be scheduled.

        max_tokens: the most tokens it may generate; None: ``sampling_params.max_tokens``, and
        when that is None too, up to max_model_len.
        """
        if request.request_id in self.requests:
            raise RequestRejectedError(f"request id {request.request_id!r} is already in use")
        if max_tokens is None and request.sampling_params is not None:
            max_tokens = request.sampling_params.max_tokens
        self._check_fits(request, max_tokens)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def add_running_request(self, request: Request) -> None:
        """Insert an already-prefilled request (a fork whose blocks the manager shares).

        Call ``kv_cache_manager.fork(parent, request)`` first; it runs from the next step on.
        """
        if request.request_id in self.requests:
            raise RequestRejectedError(f"request id {request.request_id!r} is already in use")
        self.kv_cache_manager.get_block_ids(request.request_id)  # raises if it was not forked
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)
        self._unseen_running.add(request.request_id)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Abort or finish requests now: their blocks are freed at once; unknown ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status}")
        for req_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""
        return len(self.requests)

    # One step.

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: running requests first, then admit waiting ones."""
        start = time.perf_counter()
        config = self.scheduler_config
        token_budget = config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, tuple[list[int], ...]] = {}
        preempted: list[Request] = []
        num_recomputed = 0

        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            if len(num_scheduled) >= config.max_num_seqs:
                break
            request = self.running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if num_new_tokens <= 0:
                # NOTE: the runner produced no token for it (e.g. finished but not yet reported).
                req_index += 1
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            while new_blocks is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                del self.running[victim_index]
                if victim.request_id in num_scheduled:  # priority policy: already in this batch
                    token_budget += num_scheduled.pop(victim.request_id)
                    new_blocks_of.pop(victim.request_id, None)
                if victim_index < req_index:
                    req_index -= 1
                num_recomputed += self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                break
            num_scheduled[request.request_id] = num_new_tokens
            new_blocks_of[request.request_id] = new_blocks.get_block_ids()
            token_budget -= num_new_tokens
            req_index += 1

        new_reqs = [r for r in self.running if r.request_id in self._unseen_running]
        new_reqs = [r for r in new_reqs if r.request_id in num_scheduled]
        # NOTE: no admission in a step that preempted: the freed blocks go to the preempted first.
        while not preempted and self.waiting and token_budget > 0:
            if len(self.running) >= config.max_num_seqs:
                break
            request = self.waiting.peek()
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed
            if num_new_tokens > token_budget:
                # NOTE: without chunked prefill a prompt waits for a step with room for all of it;
                # a resumed request longer than any step (prompt + outputs) is chunked anyway.
                whole_fits = num_new_tokens <= config.max_num_batched_tokens
                if not config.enable_chunked_prefill and whole_fits:
                    break
                num_new_tokens = token_budget
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, computed_blocks, num_computed
            )
            if new_blocks is None:
                break  # NOTE: no skipping ahead: later requests wait behind this one.
            self.waiting.pop()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_reqs.append(request)
            num_scheduled[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens

        output = self._make_output(new_reqs, num_scheduled, new_blocks_of, preempted)
        output.stats.num_recomputed_tokens = num_recomputed
        output.stats.schedule_time_s = time.perf_counter() - start
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        finished: dict[str, RequestStatus] | None = None,
    ) -> list[Request]:
        """Append sampled tokens, then free the requests the engine says finished; returns them.

        A request whose prefill is still partial after this step gets no token (its sample, if
        any, is ignored). ``finished`` is the engine's stop decision, made on the sampled tokens.
        """
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted since schedule()
            if request.num_computed_tokens < request.num_tokens:
                continue  # partial prefill chunk
            token_ids = sampled_token_ids.get(req_id)
            if token_ids:
                request.append_output_token_ids(token_ids)
        newly_finished = []
        for req_id, status in (finished or {}).items():
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, status)
                newly_finished.append(request)
        return newly_finished

    # Internals.

    def _make_output(
        self,
        new_reqs: list[Request],
        num_scheduled: dict[str, int],
        new_blocks_of: dict[str, tuple[list[int], ...]],
        preempted: list[Request],
    ) -> SchedulerOutput:
        new_ids = {r.request_id for r in new_reqs}
        new_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                sampling_params=r.sampling_params,
            )
            for r in new_reqs
        ]
        cow_ids = self.kv_cache_manager.take_cow_request_ids()
        cached_data = []
        for req_id, num_tokens in num_scheduled.items():
            if req_id in new_ids:
                continue
            request = self.requests[req_id]
            start = request.num_computed_tokens
            cached_data.append(
                CachedRequestData(
                    req_id=req_id,
                    new_token_ids=request.all_token_ids[start : start + num_tokens],
                    new_block_ids=new_blocks_of[req_id],
                    num_computed_tokens=start,
                    block_ids=self.kv_cache_manager.get_block_ids(req_id)
                    if req_id in cow_ids
                    else None,
                )
            )
        for req_id, num_tokens in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self._unseen_running -= new_ids
        finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            block_copies=self.kv_cache_manager.take_block_copies(),
            finished_req_ids=finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            stats=SchedulerStats(
                num_running_reqs=len(self.running),
                num_waiting_reqs=len(self.waiting),
                num_preemptions=len(preempted),
            ),
        )

    def _pick_victim(self) -> Request:
        """FCFS: the latest admitted; priority: the highest priority value, then latest arrival."""
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> int:
        """Free the request's blocks, queue it to recompute later; returns its discarded tokens."""
        self.kv_cache_manager.free(request)
        num_discarded = request.num_computed_tokens
        request.num_recomputed_tokens += num_discarded
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._unseen_running.discard(request.request_id)
        self.waiting.prepend(request)
        self.num_preemptions_total += 1
        return num_discarded

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if not RequestStatus.is_finished(status):
            raise ValueError(f"a finished request needs a FINISHED_* status, got {status}")
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = status
        del self.requests[request.request_id]
        self._unseen_running.discard(request.request_id)
        self._finished_req_ids.add(request.request_id)

    def _check_fits(self, request: Request, max_tokens: int | None) -> None:
        num_prompt = request.num_prompt_tokens
        if max_tokens is None:
            max_tokens = max(self.max_model_len - num_prompt, 1)
        num_total = num_prompt + max_tokens
        if num_total > self.max_model_len:
            raise RequestRejectedError(
                f"request {request.request_id!r} needs {num_prompt} prompt + {max_tokens}"
                f" max_tokens = {num_total} tokens, more than max_model_len={self.max_model_len}:"
                " shorten the prompt or lower max_tokens"
            )
        config = self.scheduler_config
        if not config.enable_chunked_prefill and num_prompt > config.max_num_batched_tokens:
            raise RequestRejectedError(
                f"request {request.request_id!r} has {num_prompt} prompt tokens, more than"
                f" max_num_batched_tokens={config.max_num_batched_tokens} with chunked prefill"
                " off: enable chunked prefill or raise max_num_batched_tokens"
            )
        num_needed = self._num_blocks_needed(num_total)
        num_usable = self.kv_cache_manager.num_usable_blocks
        if num_needed > num_usable:
            raise RequestRejectedError(
                f"request {request.request_id!r} needs {num_needed} KV cache blocks for"
                f" {num_total} tokens, more than the {num_usable} blocks of the pool: lower"
                " max_tokens or give the KV cache more memory"
            )

    def _num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of num_tokens holds at its peak, summed over the KV cache groups."""
        block_size = self.kv_cache_manager.block_size
        num_full = cdiv(num_tokens, block_size)
        num_needed = 0
        for group in self.kv_cache_manager.kv_cache_groups:
            if isinstance(group.spec, SlidingWindowSpec):
                # The window plus the largest chunk of one step, and a partial block at each end.
                span = group.spec.sliding_window - 1 + self.scheduler_config.max_num_batched_tokens
                num_needed += min(num_full, cdiv(span, block_size) + 1)
            else:
                num_needed += num_full
        return num_needed
