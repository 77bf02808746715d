"""Continuous batching: chunked prefill, prefix-cache reuse, preemption by recompute and forks."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagedattn.core.request import Request, RequestStatus
from pagedattn.core.request_limits import RequestLimits, RequestRejectedError
from pagedattn.core.request_queue import create_request_queue
from pagedattn.core.scheduler_output import (
    CoreOutput,
    DecodingRequest,
    KVLoad,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from pagedattn.core.spec_tokens import append_verified, decoding_requests, reserve_draft_slots
from pagedattn.core.step_budget import DEFAULT_MAX_STEP_TOKENS, StepTokenBudget
from pagedattn.core.stop import check_token_stop, derive_seed

if TYPE_CHECKING:
    from pagedattn.config import CacheConfig, SchedulerConfig
    from pagedattn.core.kv_cache_manager import KVCacheBlocks, KVCacheManager

__all__ = ["KVConnectorLike", "RequestRejectedError", "Scheduler"]


class KVConnectorLike(Protocol):
    """The scheduler side of a KV connector (kv_transfer.KVConnector)."""

    def get_num_new_matched_tokens(
        self, block_hashes: Sequence[bytes], num_computed_tokens: int
    ) -> int: ...


@dataclass
class _Step:
    """What schedule() has decided so far in this step."""

    token_budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    prefill_ids: set[str] = field(default_factory=set)  # prompt (or recomputed) chunks
    preempted: list[Request] = field(default_factory=list)
    loads: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, blocks [a, b))
    num_recomputed: int = 0

    def add(self, request: Request, num_tokens: int, prefilling: bool) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        if prefilling:
            self.prefill_ids.add(request.request_id)


class Scheduler:
    """Decides each step which sequences run and how many tokens each computes.

    The step's contract: ``schedule() -> SchedulerOutput`` (everything the runner needs), the
    runner's ``RunnerOutput``, then ``update_from_output`` (append, fork, stop, free).

    NOTE: ``request.num_computed_tokens`` advances in ``schedule()`` (as in vLLM v1): at the end of
    a step every scheduled token counts as computed. A scheduled request yields a token this step
    iff ``num_computed_tokens == num_tokens`` after schedule().

    Speculation: a drafter reads ``decoding_requests()`` and hands its drafts to
    ``update_draft_token_ids`` before ``schedule()``; only the scheduler writes a request's
    ``spec_token_ids``.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        kv_connector: KVConnectorLike | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        # NOTE: the running set never holds more distinct LoRA adapters than the runner has
        # slots; a request of one more adapter waits at the head of the queue.
        self.max_loras = max_loras
        # A second KV tier (kv_transfer.KVConnector): prompt blocks past the local prefix hit.
        self.kv_connector = kv_connector
        self.cache_config = cache_config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.policy = scheduler_config.policy
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        # NOTE: without chunked prefill a prompt must fit one step: the budget is then fixed.
        fixed = scheduler_config.max_num_batched_tokens
        if fixed is None and not scheduler_config.enable_chunked_prefill:
            fixed = DEFAULT_MAX_STEP_TOKENS
        self.step_budget = StepTokenBudget(
            fixed,
            scheduler_config.target_step_time,
            min_tokens=scheduler_config.max_num_seqs,
            long_prefill_token_threshold=scheduler_config.long_prefill_token_threshold,
        )
        self.limits = RequestLimits(
            scheduler_config, self.step_budget, kv_cache_manager, max_model_len
        )

    # Requests in and out.

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestRejectedError if it can never be scheduled."""
        if request.request_id in self.requests:
            raise RequestRejectedError(f"request id {request.request_id!r} is already in use")
        self.limits.check(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def fork_request(
        self,
        parent_id: str,
        child_id: str,
        *,
        seed: int | None = None,
        last_token_id: int | None = None,
    ) -> Request:
        """A sibling of a live request: same tokens, params, salt and priority, shared blocks.

        With ``last_token_id`` the child's last generated token (sampled, not yet computed) is
        replaced by it (beam search). The first of the two to write a shared block copies it.
        """
        parent = self.requests.get(parent_id)
        if parent is None:
            raise RequestRejectedError(f"cannot fork {parent_id!r}: no such live request")
        if child_id in self.requests:
            raise RequestRejectedError(f"request id {child_id!r} is already in use")
        child = parent.fork(child_id, seed)
        if last_token_id is not None:
            child.replace_last_output_token(last_token_id)
        if parent.status == RequestStatus.RUNNING:
            self.kv_cache_manager.fork(parent, child)
            self.running.append(child)
        else:  # waiting or preempted: the child computes from scratch (or from the cache)
            child.num_computed_tokens = 0
            self.waiting.add(child)
        self.requests[child_id] = child
        return child

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

    @property
    def num_running(self) -> int:
        """Requests in the running set."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting (new or preempted)."""
        return len(self.waiting)

    def kv_snapshot(self) -> dict:
        """The block pool and every live request's block tables, as plain JSON."""
        from pagedattn.core.kv_snapshot import kv_snapshot

        return kv_snapshot(self.kv_cache_manager, self.requests)

    def check_fits_together(self, num_seqs: int, num_tokens: int) -> None:
        """Raise unless num_seqs sequences of num_tokens can all run every step (beam search)."""
        self.limits.check_fits_together(num_seqs, num_tokens)

    def max_tokens_that_fit(self, num_prompt_tokens: int) -> int:
        """The most output tokens a request of this prompt can ever hold (context and pool)."""
        return self.limits.max_tokens_that_fit(num_prompt_tokens)

    # Speculation.

    def decoding_requests(self) -> Iterator[DecodingRequest]:
        """The running requests about to decode one token, in running order, as a drafter reads
        them (lazily: a drafter that is off this step costs nothing)."""
        return decoding_requests(self.running)

    def update_draft_token_ids(self, draft_token_ids: Mapping[str, Sequence[int]]) -> None:
        """This step's drafts (request id -> draft tokens; empty: none), before schedule().

        Ids no longer running are ignored; schedule() trims or drops drafts it has no room for.
        """
        for req_id, draft in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = list(draft)

    # One step.

    def observe_step_time(
        self, num_tokens: int, step_time_s: float, num_prefill_tokens: int
    ) -> None:
        """The engine measured a step: num_tokens computed in step_time_s, num_prefill_tokens
        of them in prompt chunks (SchedulerStats; sizes later steps)."""
        self.step_budget.observe(num_tokens, step_time_s, num_prefill_tokens)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: running requests first, then admit waiting ones."""
        start = time.perf_counter()
        # NOTE: the budget keeps decoding streams from stalling; with none, the step may be big.
        streaming = any(r.num_output_tokens > 0 for r in self.running)
        step = _Step(self.step_budget.tokens_for(streaming))
        self._schedule_running(step)
        # NOTE: no admission in a step that preempted: the freed blocks go to the preempted first.
        if not step.preempted:
            self._admit_waiting(step)
        output = self._make_output(step.num_scheduled, step.preempted)
        output.kv_loads = [self._make_load(*load) for load in step.loads]
        output.stats.num_recomputed_tokens = step.num_recomputed
        output.stats.num_prefill_tokens = sum(
            n for rid, n in step.num_scheduled.items() if rid in step.prefill_ids
        )
        output.stats.schedule_time_s = time.perf_counter() - start
        return output

    def _schedule_running(self, step: _Step) -> None:
        """Give running requests their next tokens (and drafts), preempting where blocks lack."""
        max_num_seqs = self.scheduler_config.max_num_seqs
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            if len(step.num_scheduled) >= max_num_seqs:
                break
            request = self.running[req_index]
            # NOTE: a capped long prompt (long_prefill_token_threshold) leaves the rest of the
            # budget to the requests behind it; a decode step (1 token) is never capped.
            num_left = self.step_budget.cap_request(
                request.num_tokens - request.num_computed_tokens
            )
            num_new_tokens = min(num_left, step.token_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            new_blocks = None
            if request.spec_token_ids:
                num_new_tokens, new_blocks = reserve_draft_slots(
                    self.kv_cache_manager, request, num_new_tokens, step.token_budget
                )
            if new_blocks is None:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                new_blocks, req_index = self._preempt_for(request, num_new_tokens, req_index, step)
            if new_blocks is None:
                break
            step.add(request, num_new_tokens, prefilling=num_left > 1)
            req_index += 1

    def _preempt_for(
        self, request: Request, num_new_tokens: int, req_index: int, step: _Step
    ) -> tuple[KVCacheBlocks | None, int]:
        """Preempt victims until the request's slots fit; returns its blocks (None: it was the
        victim) and req_index moved back past the victims that ran before it."""
        new_blocks = None
        while new_blocks is None:
            victim = self._pick_victim()
            victim_index = self.running.index(victim)
            del self.running[victim_index]
            if victim.request_id in step.num_scheduled:  # priority policy: already in the batch
                step.token_budget += step.num_scheduled.pop(victim.request_id)
            if victim_index < req_index:
                req_index -= 1
            step.num_recomputed += self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                break
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        return new_blocks, req_index

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting requests in queue order while the budget, blocks and LoRA slots last."""
        config = self.scheduler_config
        running_loras = self._running_loras()
        while self.waiting and step.token_budget > 0:
            if len(self.running) >= config.max_num_seqs:
                break
            request = self.waiting.peek()
            if not self._take_lora_slot(request, running_loras):
                break  # NOTE: its adapter has no slot this step: it waits, never fails.
            computed_blocks, num_computed, num_external = self._lookup_computed(request)
            num_new_tokens = self.step_budget.cap_request(
                request.num_tokens - num_computed - num_external
            )
            if num_new_tokens > step.token_budget:
                # NOTE: without chunked prefill a prompt waits for a step with room for all of it;
                # a resumed request longer than any step (prompt + outputs) is chunked anyway.
                whole_fits = num_new_tokens <= self.step_budget.max_tokens
                if not config.enable_chunked_prefill and whole_fits:
                    break
                num_new_tokens = step.token_budget
            # NOTE: the store's blocks need slots too; they are loaded, not computed.
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_external + num_new_tokens, computed_blocks, num_computed
            )
            if new_blocks is None:
                break  # NOTE: no skipping ahead: later requests wait behind this one.
            self.waiting.pop()
            end = num_computed + num_external
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = end
            request.num_computed_tokens = end
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.add(request, num_new_tokens, prefilling=True)
            if num_external:
                block_size = self.kv_cache_manager.block_size
                step.loads.append((request, num_computed // block_size, end // block_size))

    def _take_lora_slot(self, request: Request, running_loras: set[str]) -> bool:
        """False when the request's adapter would be one more than the runner has slots for."""
        lora = request.lora_id
        if self.max_loras is not None and lora is not None and lora not in running_loras:
            if len(running_loras) >= self.max_loras:
                return False
            running_loras.add(lora)
        return True

    def _lookup_computed(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """A waiting request's prefix-cache hit (blocks, tokens), and the store's tokens past it."""
        params = request.sampling_params
        if params is not None and params.prompt_logprobs is not None:
            # NOTE: a cached prefix has no logits: score the whole prompt (as vLLM does), so
            # neither the prefix cache nor the KV store is looked up.
            return self.kv_cache_manager.empty_kv_cache_blocks, 0, 0
        computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
        return computed_blocks, num_computed, self._num_external_tokens(request, num_computed)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[CoreOutput]:
        """Fork pending siblings, append sampled tokens, apply token stops, free what ended.

        A sequence aborted since schedule() is skipped; a failed one ends with FINISHED_ERROR.
        """
        outputs: list[CoreOutput] = []
        for req_id, start in runner_output.kv_load_shortfalls.items():
            request = self.requests.get(req_id)
            if request is not None:
                request.num_cached_tokens = min(request.num_cached_tokens, start)
        failed = self._with_sharers(scheduler_output, runner_output.failed)
        for req_id, message in failed.items():
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ERROR)
                outputs.append(
                    CoreOutput(req_id, [], None, RequestStatus.FINISHED_ERROR, error=message)
                )
        forks: dict[str, tuple[str, Request]] = {}  # child id -> (parent id, child)
        for sched in scheduler_output.scheduled:
            parent = self.requests.get(sched.req_id)
            if not sched.forks or parent is None or parent.status != RequestStatus.RUNNING:
                continue
            # NOTE: before the parent appends its token, so every child starts from its state.
            for child_id, seed in sched.forks:
                child = self.fork_request(sched.req_id, child_id, seed=seed)
                forks[child_id] = (sched.req_id, child)
            parent.num_pending_forks = 0
        logprobs = runner_output.logprobs
        stopped = runner_output.stopped_req_ids
        speculated = {s.req_id for s in scheduler_output.scheduled if s.spec_token_ids}
        for row, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if req_id in failed or request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted since schedule()
            if request.num_computed_tokens < request.num_tokens:
                continue  # NOTE: a partial prefill chunk's sample is never used.
            token = runner_output.sampled_token_ids[row]
            if req_id not in speculated:
                request.append_output_token_ids(token)
                status, stop_reason = check_token_stop(request, self.max_model_len)
                new_token_ids = [token]
            else:
                accepted = runner_output.accepted_draft_ids.get(req_id, [])
                status, stop_reason, new_token_ids = append_verified(
                    self.kv_cache_manager, request, [*accepted, token], self.max_model_len
                )
            if status is None and req_id in stopped:
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self._finish(request, status)
            parent_id, fork = forks.get(req_id, (None, None))
            lp = None if logprobs is None else logprobs[row]
            outputs.append(
                CoreOutput(req_id, new_token_ids, lp, status, stop_reason, parent_id, fork)
            )
        return outputs

    # Internals.

    def _running_loras(self) -> set[str]:
        """The distinct adapters of the running set (empty when LoRA is off)."""
        if self.max_loras is None:
            return set()
        return {r.lora_id for r in self.running if r.lora_id is not None}

    def _num_external_tokens(self, request: Request, num_computed: int) -> int:
        """Prompt tokens past the local prefix hit that the KV store holds (whole blocks)."""
        if self.kv_connector is None or request.block_size is None:
            return 0
        block_size = request.block_size
        # NOTE: as for a local hit, the last token is always computed (its logits are needed).
        room = (request.num_tokens - 1) // block_size * block_size - num_computed
        if room <= 0:
            return 0
        num_hit = self.kv_connector.get_num_new_matched_tokens(request.block_hashes, num_computed)
        return max(0, min(num_hit, room))

    def _make_load(self, request: Request, first_block: int, last_block: int) -> KVLoad:
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
        return KVLoad(
            request.request_id,
            first_block,
            block_ids[first_block:last_block],
            request.block_hashes[first_block:last_block],
        )

    def _with_sharers(
        self, scheduler_output: SchedulerOutput, failed: dict[str, str]
    ) -> dict[str, str]:
        """The failed sequences plus any that read a block they failed to compute.

        NOTE: blocks are offered to the prefix cache when allocated, before the step computes
        them: a failed step's blocks leave the cache, and a sequence of the same step that hit
        them (so read them, and wrote its own blocks from them) is failed too.
        """
        if not failed:
            return failed
        failed = dict(failed)
        manager = self.kv_cache_manager
        suspect: set[int] = set()
        checked: set[str] = set()
        while len(checked) < len(failed):
            for sched in scheduler_output.scheduled:
                if sched.req_id in failed and sched.req_id not in checked:
                    suspect |= manager.uncomputed_block_ids(sched.req_id, sched.start_pos)
            checked |= failed.keys()
            for sched in scheduler_output.scheduled:
                if sched.req_id not in failed and any(
                    not suspect.isdisjoint(ids) for ids in sched.block_ids
                ):
                    failed[sched.req_id] = (
                        "this request shared KV cache blocks with a request that failed in the "
                        "same step; send it again"
                    )
        manager.uncache_block_ids(suspect)
        return failed

    def _make_output(
        self, num_scheduled: dict[str, int], preempted: list[Request]
    ) -> SchedulerOutput:
        scheduled = []
        get_block_ids = self.kv_cache_manager.get_block_ids
        for req_id, num_tokens in num_scheduled.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens
            request.num_computed_tokens = end = start + num_tokens
            # NOTE: draft tokens sit past the known tokens (their slots were reserved too).
            spec_token_ids = request.spec_token_ids if end > request.num_tokens else ()
            token_ids = request.all_token_ids[start:end]
            if spec_token_ids:
                token_ids = token_ids + spec_token_ids
            end = min(end, request.num_tokens)
            needs_sample = end == request.num_tokens
            forks: tuple[tuple[str, int | None], ...] = ()
            if needs_sample and request.num_pending_forks:
                forks = tuple(
                    (f"{req_id}#{i}", derive_seed(request.seed, i))
                    for i in range(1, request.num_pending_forks + 1)
                )
            scheduled.append(
                ScheduledRequest(
                    req_id=req_id,
                    token_ids=token_ids,
                    start_pos=start,
                    block_ids=get_block_ids(req_id),
                    needs_sample=needs_sample,
                    sampling_params=request.sampling_params,
                    seed=request.seed,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    forks=forks,
                    block_hashes=request.block_hashes,
                    spec_token_ids=tuple(spec_token_ids),
                    lora_name=request.lora_id,
                )
            )
        finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            scheduled=scheduled,
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
        request.spec_token_ids = []
        num_discarded = request.num_computed_tokens
        request.num_recomputed_tokens += num_discarded
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
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
        self._finished_req_ids.add(request.request_id)
