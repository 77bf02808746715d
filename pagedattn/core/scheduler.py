"""Continuous batching: chunked prefill, prefix-cache reuse, preemption by recompute and forks."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from pagedattn.core.request import Request, RequestStatus
from pagedattn.core.request_queue import create_request_queue
from pagedattn.core.scheduler_output import (
    CoreOutput,
    KVLoad,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from pagedattn.core.step_budget import DEFAULT_MAX_STEP_TOKENS, StepTokenBudget
from pagedattn.core.stop import check_token_stop, derive_seed

if TYPE_CHECKING:
    from pagedattn.config import CacheConfig, SchedulerConfig
    from pagedattn.core.kv_cache_manager import KVCacheManager


class KVConnectorLike(Protocol):
    """The scheduler side of a KV connector (kv_transfer.KVConnector)."""

    def get_num_new_matched_tokens(
        self, block_hashes: Sequence[bytes], num_computed_tokens: int
    ) -> int: ...


class RequestRejectedError(ValueError):
    """A request can never be scheduled (too long for the model or for the KV cache)."""


class Scheduler:
    """Decides each step which sequences run and how many tokens each computes.

    The step's contract: ``schedule() -> SchedulerOutput`` (everything the runner needs), the
    runner's ``RunnerOutput``, then ``update_from_output`` (append, fork, stop, free).

    NOTE: ``request.num_computed_tokens`` advances in ``schedule()`` (as in vLLM v1): at the end of
    a step every scheduled token counts as computed. A scheduled request yields a token this step
    iff ``num_computed_tokens == num_tokens`` after schedule().
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

    # Requests in and out.

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestRejectedError if it can never be scheduled."""
        if request.request_id in self.requests:
            raise RequestRejectedError(f"request id {request.request_id!r} is already in use")
        self._check_fits(request)
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
        """Raise unless num_seqs sequences of num_tokens can all run every step (no preemption).

        Beam search needs this: its beams advance in lockstep.
        """
        config = self.scheduler_config
        min_budget = self.step_budget.min_tokens
        if num_seqs > config.max_num_seqs or num_seqs > min_budget:
            raise RequestRejectedError(
                f"{num_seqs} sequences in lockstep need max_num_seqs and max_num_batched_tokens "
                f">= {num_seqs} (they are {config.max_num_seqs} and {min_budget})"
            )
        # NOTE: one more block per sequence for the copy of a shared partial block.
        num_needed = num_seqs * (self._num_blocks_needed(num_tokens) + 1)
        num_usable = self.kv_cache_manager.num_usable_blocks
        if num_needed > num_usable:
            raise RequestRejectedError(
                f"{num_seqs} sequences of {num_tokens} tokens need {num_needed} KV cache blocks, "
                f"more than the {num_usable} of the pool: give the KV cache more memory"
            )

    def max_tokens_that_fit(self, num_prompt_tokens: int) -> int:
        """The most output tokens a request of this prompt can ever hold (context and pool)."""
        block_size = self.kv_cache_manager.block_size
        num_tokens = self.max_model_len
        while num_tokens > num_prompt_tokens and self._num_blocks_needed(num_tokens) > (
            self.kv_cache_manager.num_usable_blocks
        ):
            # NOTE: at most one step per block over the pool's size: a short loop.
            num_tokens = (num_tokens - 1) // block_size * block_size
        return max(num_tokens - num_prompt_tokens, 0)

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
        config = self.scheduler_config
        # NOTE: the budget keeps decoding streams from stalling; with none, the step may be big.
        streaming = any(r.num_output_tokens > 0 for r in self.running)
        token_budget = self.step_budget.tokens_for(streaming)
        num_scheduled: dict[str, int] = {}
        prefill_ids: set[str] = set()  # requests computing prompt (or recomputed) chunks
        preempted: list[Request] = []
        loads: list[tuple[Request, int, int]] = []  # second-tier hits: (request, blocks [a, b))
        num_recomputed = 0

        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            if len(num_scheduled) >= config.max_num_seqs:
                break
            request = self.running[req_index]
            # NOTE: a capped long prompt (long_prefill_token_threshold) leaves the rest of the
            # budget to the requests behind it; a decode step (1 token) is never capped.
            num_left = self.step_budget.cap_request(
                request.num_tokens - request.num_computed_tokens
            )
            num_new_tokens = min(num_left, token_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            prefilling = num_left > 1
            new_blocks = None
            if request.spec_token_ids:
                # NOTE: a decode step reserves slots for its draft tokens too; without room for
                # them it drops them (a plain step) before it would preempt anyone.
                num_spec = min(len(request.spec_token_ids), token_budget - 1)
                if num_new_tokens == 1 and request.num_tokens - request.num_computed_tokens == 1:
                    new_blocks = self.kv_cache_manager.allocate_slots(request, 1 + num_spec)
                if new_blocks is None or num_spec == 0:
                    request.spec_token_ids = []
                else:
                    num_new_tokens += num_spec
                    del request.spec_token_ids[num_spec:]
            if new_blocks is None:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            while new_blocks is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                del self.running[victim_index]
                if victim.request_id in num_scheduled:  # priority policy: already in this batch
                    token_budget += num_scheduled.pop(victim.request_id)
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
            token_budget -= num_new_tokens
            if prefilling:
                prefill_ids.add(request.request_id)
            req_index += 1

        running_loras = self._running_loras()
        # NOTE: no admission in a step that preempted: the freed blocks go to the preempted first.
        while not preempted and self.waiting and token_budget > 0:
            if len(self.running) >= config.max_num_seqs:
                break
            request = self.waiting.peek()
            lora = request.lora_id
            if self.max_loras is not None and lora is not None and lora not in running_loras:
                if len(running_loras) >= self.max_loras:
                    break  # NOTE: its adapter has no slot this step: it waits, never fails.
                running_loras.add(lora)
            params = request.sampling_params
            if params is not None and params.prompt_logprobs is not None:
                # NOTE: a cached prefix has no logits: score the whole prompt (as vLLM does), so
                # neither the prefix cache nor the KV store is looked up.
                computed_blocks, num_computed = self.kv_cache_manager.empty_kv_cache_blocks, 0
                num_external = 0
            else:
                computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
                num_external = self._num_external_tokens(request, num_computed)
            num_new_tokens = self.step_budget.cap_request(
                request.num_tokens - num_computed - num_external
            )
            if num_new_tokens > token_budget:
                # NOTE: without chunked prefill a prompt waits for a step with room for all of it;
                # a resumed request longer than any step (prompt + outputs) is chunked anyway.
                whole_fits = num_new_tokens <= self.step_budget.max_tokens
                if not config.enable_chunked_prefill and whole_fits:
                    break
                num_new_tokens = token_budget
            # NOTE: the store's blocks need slots too; they are loaded, not computed.
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_external + num_new_tokens, computed_blocks, num_computed
            )
            if new_blocks is None:
                break  # NOTE: no skipping ahead: later requests wait behind this one.
            self.waiting.pop()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed + num_external
            request.num_computed_tokens = num_computed + num_external
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            prefill_ids.add(request.request_id)
            if num_external:
                block_size = self.kv_cache_manager.block_size
                end = num_computed + num_external
                loads.append((request, num_computed // block_size, end // block_size))

        output = self._make_output(num_scheduled, preempted)
        output.kv_loads = [self._make_load(*load) for load in loads]
        output.stats.num_recomputed_tokens = num_recomputed
        output.stats.num_prefill_tokens = sum(
            n for rid, n in num_scheduled.items() if rid in prefill_ids
        )
        output.stats.schedule_time_s = time.perf_counter() - start
        return output

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
                status, stop_reason, new_token_ids = self._append_speculative(
                    request, [*accepted, token]
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

    def _append_speculative(
        self, request: Request, token_ids: list[int]
    ) -> tuple[RequestStatus | None, int | None, list[int]]:
        """Append a verified step's tokens one by one (stops apply to each), then roll back.

        NOTE: the step computed the last token and every draft; after it only the accepted
        tokens count as computed, and the blocks past them (rejected drafts) are freed.
        """
        status = stop_reason = None
        appended = []
        for token in token_ids:
            request.append_output_token_ids(token)
            appended.append(token)
            status, stop_reason = check_token_stop(request, self.max_model_len)
            if status is not None:
                break
        request.spec_token_ids = []
        request.num_computed_tokens = request.num_tokens - 1
        self.kv_cache_manager.free_rejected_slots(request)
        return status, stop_reason, appended

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

    def _check_fits(self, request: Request) -> None:
        num_prompt = request.num_prompt_tokens
        max_tokens = request.max_tokens
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
        max_step_tokens = self.step_budget.max_tokens
        num_seqs = request.num_pending_forks + 1
        if num_seqs > config.max_num_seqs:
            raise RequestRejectedError(
                f"request {request.request_id!r} asks for {num_seqs} sequences (n/best_of), more"
                f" than max_num_seqs={config.max_num_seqs} can run at once: lower n or best_of"
            )
        if not config.enable_chunked_prefill and num_prompt > max_step_tokens:
            raise RequestRejectedError(
                f"request {request.request_id!r} has {num_prompt} prompt tokens, more than"
                f" max_num_batched_tokens={max_step_tokens} with chunked prefill"
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
        return self.kv_cache_manager.num_blocks_needed(num_tokens, self.step_budget.max_tokens)
