"""LLMEngine: add_request / step / abort over the scheduler, the KV cache manager and the runner."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedattn.attention.backends.base import get_attn_backend
from pagedattn.config import EngineConfig
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.request import Request, RequestStatus
from pagedattn.core.scheduler import RequestRejectedError, Scheduler
from pagedattn.core.scheduler_output import SchedulerOutput
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.engine.outputs import RequestOutput
from pagedattn.engine.request_state import EngineRequest, SeqState
from pagedattn.model.loader import load_model
from pagedattn.sampling_params import InvalidSamplingParamsError, SamplingParams
from pagedattn.worker.input_batch import ScheduledSeq
from pagedattn.worker.model_runner import ModelRunner
from pagedattn.worker.sampler import Sampler
from pagedattn.worker.sampling_metadata import build_sampling_metadata, make_generator

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepTimes:
    """Seconds spent in each part of the engine's steps so far."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    process: float = 0.0
    num_steps: int = 0


@dataclass
class EngineStats:
    """Engine-level counters: KV usage, prefix-cache hit rate, preemptions, fragmentation."""

    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_recomputed_tokens: int
    internal_fragmentation: int
    num_running: int
    num_waiting: int
    num_prompt_tokens: int
    num_generation_tokens: int
    step_times: StepTimes = field(default_factory=StepTimes)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    # MemAvailable counts reclaimable page cache; SC_AVPHYS_PAGES (free pages) does not, and
    # after a large file read it can be a small fraction of what the cache could really use.
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class LLMEngine:
    """Continuous batching over a paged KV cache: requests join and leave between steps."""

    def __init__(self, config: EngineConfig, *, verbose: bool = False) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = torch.device(config.model.device)
        dtype = _DTYPES[config.model.dtype]
        backend = get_attn_backend(config.attn_backend, device)
        loaded = load_model(config.model.model, dtype, device, backend)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.model_name
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.vocab_size = int(loaded.hf_config["vocab_size"])
        self.max_model_len = min(
            config.scheduler.max_model_len or loaded.max_model_len, loaded.max_model_len
        )
        block_size = config.cache.block_size
        groups = self.model.kv_cache_groups(block_size)
        kv_dtype = (
            dtype if config.cache.kv_cache_dtype == "auto" else _DTYPES[config.cache.kv_cache_dtype]
        )
        if kv_dtype != dtype and backend.name != "cpu":
            raise InvalidRequestError(
                f"kv_cache_dtype={config.cache.kv_cache_dtype} differs from the model's dtype "
                f"{config.model.dtype}: only the cpu attention backend supports that, not "
                f"{backend.name}"
            )
        self.kv_cache_dtype = kv_dtype
        num_blocks = self._num_blocks(config, device, kv_dtype)
        self.kv_cache_manager = KVCacheManager(
            groups,
            num_blocks,
            enable_caching=config.cache.enable_prefix_caching,
            hash_seed=config.cache.hash_seed,
        )
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.kv_cache_manager, self.max_model_len
        )
        self.runner = ModelRunner(
            self.model, backend, num_blocks, block_size, len(groups), device, kv_dtype
        )
        self.sampler = Sampler()
        self.requests: dict[str, EngineRequest] = {}
        # Core request id -> (engine request, index of the sequence among its n).
        self._seq_of: dict[str, SeqState] = {}
        self.step_times = StepTimes()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_recomputed_tokens = 0
        self.kv_summary = (
            f"KV cache: {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} "
            f"token slots per layer group, "
            f"{num_blocks * self._bytes_per_block(kv_dtype) / 2**20:.1f} MiB "
            f"({len(groups)} KV cache group(s), backend {backend.name}, {config.model.dtype}"
            + ("" if kv_dtype == dtype else f", KV cache {config.cache.kv_cache_dtype}")
            + ")"
        )
        if verbose:
            print(f"[pagedattn] model {self.model_name}; {self.kv_summary}")

    # Capacity.

    def _bytes_per_block(self, dtype: torch.dtype) -> int:
        return ModelRunner.kv_cache_bytes_per_block(self.model, self.config.cache.block_size, dtype)

    def _num_blocks(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> int:
        cache = config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = self._bytes_per_block(dtype)
        if cache.kv_cache_memory is not None:
            num_blocks = cache.kv_cache_memory // per_block
            if num_blocks < 2:
                raise InvalidRequestError(
                    f"kv_cache_memory={cache.kv_cache_memory} bytes holds {num_blocks} blocks of "
                    f"{per_block} bytes: give the KV cache at least {2 * per_block} bytes"
                )
            return num_blocks
        budget = int(_free_memory_bytes(device) * cache.kv_cache_memory_fraction)
        # NOTE: no more blocks than max_num_seqs full-length sequences could ever use.
        per_seq = -(-self.max_model_len // cache.block_size)
        return max(2, min(budget // per_block, config.scheduler.max_num_seqs * per_seq + 1))

    # Requests in and out.

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt"
            )
        return list(prompt)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(f"model {self.model_name} has no chat template")
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError if it can never be served."""
        params = SamplingParams() if params is None else params
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("the prompt is empty: send at least one token", "prompt")
        prompt_ids = self.tokenize(prompt)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token", "prompt")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(self.max_model_len - len(prompt_ids), 1)
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: together "
                f"{len(prompt_ids) + max_tokens}, more than the model's max_model_len "
                f"{self.max_model_len}; shorten the prompt or lower max_tokens",
                param="max_tokens" if len(prompt_ids) < self.max_model_len else "prompt",
            )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        ereq = EngineRequest(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt_ids,
            params=params,
            max_tokens=max_tokens,
            arrival_time=arrival,
            cache_salt=cache_salt,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
        )
        core = self._make_core_request(ereq, 0, request_id)
        try:
            self.scheduler.add_request(core, max_tokens=max_tokens)
        except RequestRejectedError as exc:
            raise InvalidRequestError(str(exc), param="prompt") from exc
        self.requests[request_id] = ereq
        self._seq_of[request_id] = ereq.seqs[0]

    def _make_core_request(self, ereq: EngineRequest, index: int, core_id: str) -> Request:
        core = Request(
            request_id=core_id,
            prompt_token_ids=ereq.prompt_token_ids,
            sampling_params=ereq.params,
            arrival_time=ereq.arrival_time,
            priority=ereq.priority,
            cache_salt=ereq.cache_salt,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            block_size=self.config.cache.block_size,
            hash_seed=self.config.cache.hash_seed,
        )
        seed = ereq.params.seed
        generator = None if seed is None else make_generator(seed + index, self.config.model.device)
        ereq.seqs.append(SeqState(ereq, index, core, self.tokenizer, generator))
        return core

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests now: their blocks return to the pool before this call returns."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req_id in ids:
            ereq = self.requests.pop(req_id, None)
            if ereq is None:
                continue
            core_ids = [s.core.request_id for s in ereq.seqs]
            self.scheduler.finish_requests(core_ids, RequestStatus.FINISHED_ABORTED)
            for core_id in core_ids:
                self._seq_of.pop(core_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # One step.

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, check stops; return outputs of requests that moved."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        times = self.step_times
        times.schedule += t1 - t0
        self.num_recomputed_tokens += sched.stats.num_recomputed_tokens
        if sched.is_empty:
            return []
        requests = self.scheduler.requests
        seqs = self.scheduled_seqs(sched)
        for seq in seqs:
            core = requests[seq.req_id]
            self.num_prompt_tokens += max(
                0, min(core.num_prompt_tokens - seq.start_pos, len(seq.token_ids))
            )
        logits, sampled_ids = self.runner.execute(seqs, sched.block_copies)
        times.prepare += self.runner.last_timings.prepare
        times.forward += self.runner.last_timings.forward
        t2 = time.perf_counter()

        # NOTE: a request with n > 1 forks its siblings when its prompt is done: they share every
        # prompt block (ref counts) and sample from the same logits row.
        rows: list[int] = []
        row_seqs: list[SeqState] = []
        for row, core_id in enumerate(sampled_ids):
            state = self._seq_of[core_id]
            targets = [state]
            if state.index == 0 and state.owner.needs_fork():
                targets += self._fork_siblings(state)
            rows += [row] * len(targets)
            row_seqs += targets
        if not row_seqs:  # only partial prefill chunks ran: nothing to sample
            self.scheduler.update_from_output(sched, {}, {})
            times.num_steps += 1
            return []
        if rows != list(range(len(rows))):
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.int64))
        meta = build_sampling_metadata(
            [s.owner.params for s in row_seqs],
            [s.core.output_token_ids for s in row_seqs],
            [s.core.prompt_token_ids for s in row_seqs],
            [s.generator for s in row_seqs],
            self.vocab_size,
            self.eos_token_ids,
        )
        out = self.sampler(logits, meta)
        t3 = time.perf_counter()
        times.sample += t3 - t2

        token_ids = out.sampled_token_ids.tolist()
        now = time.monotonic()
        finished: dict[str, RequestStatus] = {}
        touched: dict[str, EngineRequest] = {}
        for i, state in enumerate(row_seqs):
            token = token_ids[i]
            # NOTE: the engine appends sampled tokens itself (the scheduler gets none), so that
            # the stop check sees them and forked siblings are handled like everyone else.
            state.core.append_output_token_ids(token)
            status = state.on_token(token, out.logprobs[i] if out.logprobs else None, now)
            if status is not None:
                finished[state.core.request_id] = status
            touched[state.owner.request_id] = state.owner
        self.num_generation_tokens += len(row_seqs)
        self.scheduler.update_from_output(sched, {}, finished)
        for core_id in finished:
            self._seq_of.pop(core_id, None)
        outputs = []
        for ereq in touched.values():
            ereq.metrics.num_preemptions = sum(s.core.num_preemptions for s in ereq.seqs)
            ereq.metrics.num_recomputed_tokens = sum(
                s.core.num_recomputed_tokens for s in ereq.seqs
            )
            outputs.append(ereq.make_output())
            if ereq.finished:
                ereq.metrics.finished_time = now
                self.requests.pop(ereq.request_id, None)
        times.process += time.perf_counter() - t3
        times.num_steps += 1
        return outputs

    def scheduled_seqs(self, sched: SchedulerOutput) -> list[ScheduledSeq]:
        """The runner's view of a scheduled step: each request's new tokens and block tables."""
        requests = self.scheduler.requests
        seqs = []
        for req_id, num_tokens in sched.num_scheduled_tokens.items():
            core = requests[req_id]
            start = core.num_computed_tokens - num_tokens  # schedule() already advanced it
            seqs.append(
                ScheduledSeq(
                    req_id=req_id,
                    token_ids=core.all_token_ids[start : start + num_tokens],
                    start_pos=start,
                    block_ids=self.kv_cache_manager.get_block_ids(req_id),
                    needs_sample=core.num_computed_tokens == core.num_tokens,
                )
            )
        return seqs

    def _fork_siblings(self, parent: SeqState) -> list[SeqState]:
        ereq = parent.owner
        children = []
        for index in range(1, ereq.params.n):
            core = self._make_core_request(ereq, index, f"{ereq.request_id}#{index}")
            core.num_computed_tokens = parent.core.num_computed_tokens
            self.kv_cache_manager.fork(parent.core, core)
            self.scheduler.add_running_request(core)
            state = ereq.seqs[-1]
            self._seq_of[core.request_id] = state
            children.append(state)
        return children

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
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            step_times=self.step_times,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def kv_snapshot(self) -> dict:
        from pagedattn.core.kv_snapshot import kv_snapshot

        return kv_snapshot(self.kv_cache_manager, self.scheduler.requests)

    def beam_search(self, prompt, params):
        from pagedattn.engine.beam_search import run_beam_search

        return run_beam_search(self, prompt, params)


__all__ = ["LLMEngine", "EngineStats", "InvalidRequestError", "InvalidSamplingParamsError"]
