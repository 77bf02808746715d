"""LLMEngine: add_request / step / abort over the scheduler, the KV cache manager and the runner."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable

import torch

from pagedattn.config import EngineConfig
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.request import Request, RequestStatus
from pagedattn.core.scheduler import RequestRejectedError, Scheduler
from pagedattn.core.scheduler_output import RunnerOutput, SchedulerOutput
from pagedattn.engine.errors import EngineFaultError, InvalidRequestError
from pagedattn.engine.input_processor import InputProcessor
from pagedattn.engine.kv_scales import MIN_CALIBRATION_TOKENS, calibrate_kv_scales
from pagedattn.engine.lora_registry import LoRARegistry
from pagedattn.engine.output_processor import OutputProcessor
from pagedattn.engine.outputs import RequestOutput
from pagedattn.engine.request_state import EngineRequest
from pagedattn.engine.stats import EngineStats, StepTimes
from pagedattn.lora.request import LoRARequest
from pagedattn.sampling_params import InvalidSamplingParamsError, SamplingParams
from pagedattn.worker.model_runner import BlockCopyError
from pagedattn.worker.tp_executor import WorkerFaultError, make_model_runner

logger = logging.getLogger(__name__)

# Steps in a row whose every request failed before the engine counts itself as broken.
MAX_FAILED_STEPS = 3


class LLMEngine:
    """Continuous batching over a paged KV cache: requests join and leave between steps.

    One step: ``Scheduler.schedule()`` -> ``ModelRunner.execute()`` ->
    ``Scheduler.update_from_output()`` -> ``OutputProcessor.process()``. A request whose own part
    of a step fails ends with an error and the others go on; only a fault of the engine itself
    raises ``EngineFaultError``.
    """

    def __init__(self, config: EngineConfig, *, verbose: bool = False) -> None:
        self.config = config
        cache = config.cache
        self.runner = runner = make_model_runner(config)
        if cache.calculate_kv_scales:
            ran = calibrate_kv_scales(runner, runner.max_model_len)
            if ran < MIN_CALIBRATION_TOKENS:
                logger.warning(
                    "--calculate-kv-scales: the calibration prefill fit only %d tokens "
                    "(max_model_len or the KV cache is that small): the fp8 scales may clip",
                    ran,
                )
        self.model = runner.model
        self.tokenizer = runner.tokenizer
        self.model_name = runner.model_name
        self.eos_token_ids = runner.eos_token_ids
        self.vocab_size = runner.vocab_size
        self.max_model_len = runner.max_model_len
        self.kv_cache_dtype = runner.kv_cache_dtype
        self.kv_cache_manager = KVCacheManager(
            runner.kv_cache_groups,
            runner.num_blocks,
            enable_caching=cache.enable_prefix_caching,
            hash_seed=cache.hash_seed,
            enable_kv_cache_events=cache.kv_events_endpoint is not None,
        )
        self.kv_event_publisher = None
        if cache.kv_events_endpoint is not None:
            from pagedattn.distributed.kv_events import ZmqEventPublisher

            self.kv_event_publisher = ZmqEventPublisher(cache.kv_events_endpoint, topic="kv-events")
        self.kv_connector = runner.kv_connector
        self.scheduler = Scheduler(
            config.scheduler,
            cache,
            self.kv_cache_manager,
            self.max_model_len,
            self.kv_connector,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
        )
        # Speculative decoding (--speculative-method): drafts proposed before each step.
        self.speculator = None
        if config.speculative.speculative_method is not None:
            from pagedattn.spec_decode.factory import make_speculator

            self.speculator = make_speculator(config, self.max_model_len, self.tokenizer)
        self.loras = LoRARegistry(runner, self.scheduler, self.kv_cache_manager, self.model_name)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.model_name)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._core_ids = itertools.count()
        self._num_failed_steps = 0
        self.step_times = StepTimes()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_recomputed_tokens = 0
        self.num_failed_requests = 0
        kv, dtype = runner.kv_cache_plan, runner.dtype
        self.kv_summary = (
            f"KV cache: {kv.num_blocks} blocks x {cache.block_size} tokens = "
            f"{kv.num_blocks * cache.block_size} token slots per layer group, "
            f"{kv.num_bytes / 2**20:.1f} MiB ({runner.num_groups} KV cache group(s), backend "
            f"{runner.attn_backend.name}, {_dtype_name(dtype)}"
            + ("" if kv.dtype == dtype else f", KV cache {_dtype_name(kv.dtype)}")
            + ")"
        )
        if verbose:
            print(f"[pagedattn] model {self.model_name}; {self.kv_summary}")

    # Requests in and out.

    @property
    def requests(self) -> dict[str, EngineRequest]:
        """Live user requests by id."""
        return self.output_processor.requests

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text or checked ids)."""
        return self.input_processor.tokenize(prompt)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the model's chat template."""
        return self.input_processor.apply_chat_template(messages, add_generation_prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError if it can never be served.

        ``lora_request``: the adapter it runs under, loaded from its path on first use."""
        params = SamplingParams() if params is None else params
        lora_name = None if lora_request is None else self.loras.resolve(lora_request)
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("the request id must be a non-empty string")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids, max_tokens = self.input_processor.process(
            prompt,
            params,
            self.scheduler.max_tokens_that_fit,
            f"max_model_len={self.max_model_len} or the KV cache's "
            f"{self.kv_cache_manager.num_usable_blocks} blocks of {self.config.cache.block_size} "
            "tokens",
        )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        ereq = EngineRequest(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt_ids,
            params=params,
            arrival_time=arrival,
            cache_salt=cache_salt,
            priority=priority,
        )
        num_seqs = ereq.num_seqs
        core_params = params
        if num_seqs > params.n and params.logprobs is None:
            # NOTE: best_of ranks candidates by cumulative logprob: the sampler must compute it.
            core_params = dataclasses.replace(params, logprobs=0)
        core = Request(
            request_id=f"{request_id}@{next(self._core_ids)}",
            prompt_token_ids=prompt_ids,
            sampling_params=core_params,
            arrival_time=arrival,
            priority=priority,
            cache_salt=cache_salt,
            lora_id=lora_name,
            eos_token_ids=self.eos_token_ids,
            seed=params.seed,
            num_forks=num_seqs - 1,
            max_tokens=max_tokens,
            block_size=self.config.cache.block_size,
            hash_seed=self.config.cache.hash_seed,
        )
        try:
            self.scheduler.add_request(core)
        except RequestRejectedError as exc:
            if num_seqs > 1 and "lower n or best_of" in str(exc):
                param = "n" if num_seqs == params.n else "best_of"
            else:
                param = "max_tokens" if params.max_tokens is not None else "prompt"
            raise InvalidRequestError(str(exc), param=param) from exc
        self.output_processor.add(ereq, core)

    def fork_request(
        self, request_id: str, new_request_id: str, *, last_token_id: int | None = None
    ) -> None:
        """A new request that continues a live one: same tokens, params, salt and priority.

        The two share every KV block (reference counts) until one writes a shared block, which
        it copies first. ``last_token_id`` replaces the new request's last generated token.
        """
        ereq = self.requests.get(request_id)
        if ereq is None or len(ereq.seqs) != 1:
            raise InvalidRequestError(f"cannot fork {request_id!r}: no live request with n=1")
        if new_request_id in self.requests:
            raise InvalidRequestError(f"request id {new_request_id!r} is already in use")
        core_id = f"{new_request_id}@{next(self._core_ids)}"
        parent = ereq.seqs[0].core
        try:
            core = self.scheduler.fork_request(
                parent.request_id, core_id, seed=parent.seed, last_token_id=last_token_id
            )
        except (RequestRejectedError, ValueError) as exc:
            raise InvalidRequestError(str(exc)) from exc
        child = EngineRequest(
            request_id=new_request_id,
            prompt=ereq.prompt,
            prompt_token_ids=ereq.prompt_token_ids,
            params=ereq.params,
            arrival_time=ereq.arrival_time,
            cache_salt=ereq.cache_salt,
            priority=ereq.priority,
        )
        self.output_processor.add(child, core)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests now: their blocks return to the pool before this call returns."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req_id in ids:
            core_ids = self.output_processor.core_ids(req_id)
            self.output_processor.remove(req_id)
            self.scheduler.finish_requests(core_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # One step.

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, check stops; return outputs of requests that moved."""
        times = self.step_times
        t0 = time.perf_counter()
        try:
            if self.speculator is not None:
                drafts = self.speculator.propose(
                    self.scheduler.decoding_requests(),
                    self.scheduler.get_num_unfinished_requests(),
                )
                self.scheduler.update_draft_token_ids(drafts)
            sched = self.scheduler.schedule()
        except Exception as exc:
            raise EngineFaultError(f"the scheduler failed: {exc!r}") from exc
        t1 = time.perf_counter()
        times.schedule += t1 - t0
        self.num_recomputed_tokens += sched.stats.num_recomputed_tokens
        if sched.is_empty:
            return []
        runner_output = self._execute(sched)
        # NOTE: a sequence whose store load fell short computed from its first missing block:
        # the step as computed counts those tokens too.
        sched = sched.with_kv_load_shortfalls(runner_output.kv_load_shortfalls)
        self.num_prompt_tokens += sched.num_prompt_tokens_computed()
        timings = runner_output.timings
        self.scheduler.observe_step_time(
            sched.total_num_scheduled_tokens, timings.total, sched.stats.num_prefill_tokens
        )
        times.prepare += timings.prepare
        times.forward += timings.forward
        times.sample += timings.sample
        t2 = time.perf_counter()
        try:
            core_outputs = self.scheduler.update_from_output(sched, runner_output)
        except Exception as exc:
            raise EngineFaultError(f"updating the scheduler failed: {exc!r}") from exc
        self.num_generation_tokens += len(runner_output.req_ids)
        if self.speculator is not None:
            self.speculator.observe(sched, runner_output)
            self.num_generation_tokens += sum(map(len, runner_output.accepted_draft_ids.values()))
        self.num_failed_requests += len(runner_output.failed)
        if runner_output.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(runner_output.prompt_logprobs)
        pooled = self._pooled_by_request(runner_output.pooled)
        outputs, stopped, to_abort = self.output_processor.process(core_outputs)
        for out in outputs:
            if out.request_id in pooled:
                out.extra["pooled"] = pooled[out.request_id]
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.scheduler.finish_requests(to_abort, RequestStatus.FINISHED_ABORTED)
        if self.speculator is not None:
            self.speculator.release_finished(self.scheduler.requests.keys())
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
        times.process += time.perf_counter() - t2
        times.num_steps += 1
        return outputs

    def _pooled_by_request(self, pooled: dict[str, list[float]]) -> dict[str, list[float]]:
        """Pooled vectors (SamplingParams.pooling) by request id, from core sequence ids."""
        by_request = {}
        for core_id, vector in pooled.items():
            state = self.output_processor.seq_of.get(core_id)
            if state is not None:
                by_request[state.owner.request_id] = vector
        return by_request

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run the step; if the batch fails, run each sequence alone and fail only the faulty."""
        try:
            output = self.runner.execute(sched)
            self._num_failed_steps = 0
            return output
        except BlockCopyError as exc:
            raise EngineFaultError(f"copy-on-write of KV blocks failed: {exc!r}") from exc
        except WorkerFaultError as exc:
            raise EngineFaultError(str(exc)) from exc
        except Exception as exc:
            batch_error = exc
        logger.warning(
            "a step of %d sequences failed (%r); retrying each alone",
            len(sched.scheduled),
            batch_error,
        )
        output = RunnerOutput()
        for s in sched.scheduled:
            try:
                output.merge(self.runner.execute(sched.subset({s.req_id})))
            except Exception as exc:
                logger.exception("request %s failed in its step", s.req_id)
                output.failed[s.req_id] = f"the model step failed for this request: {exc}"
        if len(output.failed) == len(sched.scheduled):
            self._num_failed_steps += 1
            if len(sched.scheduled) > 1 or self._num_failed_steps >= MAX_FAILED_STEPS:
                raise EngineFaultError(
                    f"every request of the step failed: {batch_error!r}"
                ) from batch_error
        else:
            self._num_failed_steps = 0
        return output

    # The second KV tier.

    def check_health(self) -> None:
        """Raise `EngineFaultError` if the engine cannot run another step (a dead TP rank)."""
        try:
            self.runner.check_health()
        except WorkerFaultError as exc:
            raise EngineFaultError(str(exc)) from exc

    def close(self) -> None:
        """Flush and close the KV store and the event publisher, if any; stop TP workers."""
        self.runner.close()
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    # KV cache events.

    def enable_kv_cache_events(self) -> None:
        """Queue KV cache events from now on (the engine must not have stepped yet)."""
        self.kv_cache_manager.block_pool.enable_kv_cache_events = True

    def take_kv_events(self) -> list:
        """The KV cache events since the last call, oldest first (core.kv_events types)."""
        return self.kv_cache_manager.take_events()

    def publish_kv_events(self) -> None:
        """Send this step's events as one batch (nothing when there are none)."""
        events = self.take_kv_events()
        if events:
            self.kv_event_publisher.publish(events)

    # Introspection.

    def get_stats(self) -> EngineStats:
        kv = self.kv_cache_manager.stats
        return EngineStats(
            num_blocks=self.kv_cache_manager.num_blocks,
            block_size=self.config.cache.block_size,
            num_free_blocks=kv.num_free_blocks,
            num_cached_blocks=kv.num_cached_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions_total,
            num_recomputed_tokens=self.num_recomputed_tokens,
            internal_fragmentation=kv.internal_fragmentation,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_failed_requests=self.num_failed_requests,
            step_times=self.step_times,
            kv_store=None if self.kv_connector is None else self.kv_connector.stats,
            spec_decode=None if self.speculator is None else self.speculator.stats,
        )

    def reset_prefix_cache(self) -> bool:
        done = self.kv_cache_manager.reset_prefix_cache()
        if done and self.kv_event_publisher is not None:
            self.publish_kv_events()
        return done

    def kv_snapshot(self) -> dict:
        """The block pool's state and block tables as plain JSON (/debug/kv, the dashboard).

        Sequences appear under their user request id; the n - 1 siblings as ``<id>#<index>``.
        """
        snapshot = self.output_processor.rename_snapshot(self.scheduler.kv_snapshot())
        plan = self.runner.kv_cache_plan
        snapshot["kv_cache_dtype"] = _dtype_name(plan.dtype)  # e.g. float8_e4m3fn
        snapshot["bytes_per_block"] = plan.bytes_per_block  # K and V, all layers
        return snapshot

    def check_fits_together(self, num_seqs: int, num_tokens: int) -> None:
        """Raise InvalidRequestError unless num_seqs sequences can all run every step."""
        try:
            self.scheduler.check_fits_together(num_seqs, num_tokens)
        except RequestRejectedError as exc:
            raise InvalidRequestError(str(exc)) from exc

    def beam_search(self, prompt, params):
        from pagedattn.engine.beam_search import run_beam_search

        return run_beam_search(self, prompt, params)


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype == torch.uint8:  # NOTE: the u8 KV cache (attention.u8), by its option's name
        return "u8"
    return str(dtype).removeprefix("torch.")


__all__ = [
    "EngineFaultError",
    "EngineStats",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "LLMEngine",
]
