"""Owns the model and its paged KV cache tensors; runs one step: copies, forward, sampling."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pagedattn.attention.backends.base import get_attn_backend
from pagedattn.attention.ops import copy_blocks
from pagedattn.config import EngineConfig, context_error
from pagedattn.core.scheduler_output import (
    KVLoad,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    StepTimings,
)
from pagedattn.cpu.extension import flush_denormals_all_threads, keep_freed_heap_memory
from pagedattn.cpu.features import has_bf16_hardware, resolve_dtype, vector_isa
from pagedattn.cpu.linear import kernel_available
from pagedattn.cpu.plan import KernelOptions
from pagedattn.model.layers import PagedAttention
from pagedattn.model.loader import (
    backend_options,
    checkpoint_config,
    choose_model_plan,
    load_model,
    resolve_checkpoint,
)
from pagedattn.model.parallel_layers import shard_key_name, shard_text_config
from pagedattn.sampling_params import SamplingParams
from pagedattn.spec_decode.policy import verify_row_bound
from pagedattn.worker.input_batch import InputBatch, build_input_batch
from pagedattn.worker.kv_cache_sizing import plan_kv_cache
from pagedattn.worker.logprobs import compute_logprobs, gather_logprobs
from pagedattn.worker.pooler import Pooler
from pagedattn.worker.sampler import Sampler
from pagedattn.worker.sampling_metadata import build_sampling_metadata, make_generator
from pagedattn.worker.verify_rows import verify_rows

if TYPE_CHECKING:
    from pagedattn.distributed.parallel_state import TensorParallelGroup

logger = logging.getLogger(__name__)

# Sampling settings of a sequence that carries none (the simulator's and some tests').
_GREEDY = SamplingParams(temperature=0.0)


class BlockCopyError(RuntimeError):
    """Copy-on-write of KV blocks failed: the cache itself is suspect, not one request."""


class _SampleRow:
    """One sampled sequence of the step: a scheduled one, or a sibling forked from its row."""

    __slots__ = ("req_id", "logits_row", "params", "seed", "prompt_token_ids", "output_token_ids")

    def __init__(self, req_id: str, logits_row: int, sched: ScheduledRequest, seed: int | None):
        self.req_id = req_id
        self.logits_row = logits_row
        self.params = sched.sampling_params or _GREEDY
        self.seed = seed
        self.prompt_token_ids = sched.prompt_token_ids
        self.output_token_ids = sched.output_token_ids


def _note_bf16_without_hardware() -> None:
    """Say what bfloat16 weights cost on a CPU without bf16 instructions."""
    if kernel_available("panels", torch.bfloat16):
        # NOTE: AVX2 cap on the AMX Xeon, SmolLM2-135M, bf16 against float32 in the same hour:
        # batch-1 TPOT 11.4 against 27.0 ms, uniform 285 against 292 tok/s; the panel GEMM's
        # prefill at 2,048 rows 280 ms against oneDNN's float32 236 ms (four layers).
        logger.info(
            "dtype=bfloat16 on a CPU without bf16 instructions (%s): the panel GEMM widens the "
            "weights to float32 as it reads them, so decode streams half of float32's bytes "
            "(batch 1 ~2x faster) and prefill runs ~1.2x slower; dtype=auto picks float32 here",
            vector_isa(),
        )
    else:
        logger.warning(
            "dtype=bfloat16 on a CPU without bf16 instructions (%s) and without the vectorized "
            "panel GEMM: every matmul converts to float32 first (prefill measured ~3x slower); "
            "dtype=auto picks float32 here",
            vector_isa(),
        )


class ModelRunner:
    """Owns the device: chooses the kernel plan, builds the attention backend with its decode
    kernel, loads the model for the plan, sets the threads, sizes and allocates one
    (key_cache, value_cache) pair per layer and connects the KV store; then executes steps.

    What the engine needs from it: ``kv_cache_groups``, ``num_blocks``, ``vocab_size``,
    ``eos_token_ids``, ``max_model_len``, ``tokenizer``, ``model_name`` and ``kv_connector``.
    """

    def __init__(self, config: EngineConfig, parallel: TensorParallelGroup | None = None) -> None:
        """``parallel``: this runner is one rank of a tensor-parallel model (worker.tp_executor)
        and holds only its shard of the weights and of every KV block."""
        model_config, cache = config.model, config.cache
        self.parallel = parallel
        self.device = torch.device(model_config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and not has_bf16_hardware():
            _note_bf16_without_hardware()
        checkpoint = resolve_checkpoint(model_config.model)
        options = KernelOptions(
            linear_kernel=model_config.linear_kernel,
            attention_kernel=model_config.attention_kernel,
            quantization=model_config.quantization,
            weights=model_config.weights,
            # NOTE: the decode stack runs whole layers in one call: no room for an all-reduce.
            decode_stack=model_config.decode_stack and parallel is None,
            step_ops=model_config.step_ops,
            kv_cache_dtype=cache.kv_cache_dtype,
            verify_rows=verify_row_bound(config.speculative),
        )
        text_config = checkpoint_config(checkpoint)
        if parallel is not None:
            text_config = shard_text_config(text_config, parallel)
        self.plan = choose_model_plan(text_config, self.dtype, self.device, options, checkpoint)
        self.attn_backend = get_attn_backend(
            config.attn_backend,
            self.device,
            **backend_options(config.attn_backend, self.device, self.plan),
        )
        loaded = load_model(
            checkpoint,
            self.dtype,
            self.device,
            self.attn_backend,
            plan=self.plan,
            parallel=parallel,
        )
        if config.num_threads is None and self.plan.threads == 1:
            torch.set_num_threads(1)  # NOTE: the kernel tuner measured one thread faster here
        self.model = loaded.model
        # LoRA adapters: the projections wrapped once, with --max-loras stacked slots.
        self.lora_manager = None
        if config.lora.enable_lora:
            from pagedattn.lora.manager import LoRAManager

            lora = config.lora
            self.lora_manager = LoRAManager(
                self.model, lora.max_loras, lora.max_lora_rank, self.dtype
            )
        self.tokenizer = loaded.tokenizer  # also for structured-output grammars
        self.model_name = loaded.model_name
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.vocab_size = int(loaded.hf_config["vocab_size"])
        wanted = config.scheduler.max_model_len
        if wanted is not None and wanted > loaded.max_model_len:
            # NOTE: as vLLM does; clamping silently left a caller planning for contexts the
            # model never serves (the CLI says the same before loading: cli_checks).
            raise ValueError(
                context_error("max_model_len", wanted, self.model_name, loaded.max_model_len, "=")
            )
        self.max_model_len = wanted or loaded.max_model_len
        self.block_size = cache.block_size
        self.kv_cache_groups = self.model.kv_cache_groups(cache.block_size)
        self.num_groups = len(self.kv_cache_groups)
        self.kv_cache_plan = plan_kv_cache(
            cache,
            config.scheduler,
            self.model,
            self.dtype,
            self.attn_backend.name,
            self.device,
            self.max_model_len,
        )
        if parallel is not None:  # NOTE: every rank holds its shard of the same block ids
            num_blocks = parallel.min_int(self.kv_cache_plan.num_blocks)
            self.kv_cache_plan = self.kv_cache_plan._replace(num_blocks=num_blocks)
        self.num_blocks = self.kv_cache_plan.num_blocks
        self.kv_cache_dtype = self.kv_cache_plan.dtype
        if self.device.type == "cpu":
            flush_denormals_all_threads()
            keep_freed_heap_memory()
        self.kv_caches = [
            self.attn_backend.allocate_kv_cache(
                self.num_blocks,
                self.block_size,
                self.model.num_kv_heads,
                self.model.head_size,
                self.kv_cache_dtype,
                self.device,
                prefault=cache.kv_cache_prefault,
            )
            for _ in range(self.model.num_layers)
        ]
        if cache.calculate_kv_scales:  # FP8 KV: scales from the engine's calibration prefill
            for module in self.model.modules():
                if isinstance(module, PagedAttention):
                    module.calculate_kv_scales = True
        # The second KV tier (kv_transfer.KVConnector): its worker side reads and writes these
        # caches; the scheduler asks it what the store holds.
        self.kv_connector = None
        if cache.kv_store is not None:
            from pagedattn.kv_transfer import connector_for_engine

            self.kv_connector = connector_for_engine(
                cache.kv_store,
                self.model_name if parallel is None else shard_key_name(self.model_name, parallel),
                self.num_groups,
                self.kv_caches,
                self.kv_cache_dtype,
            )
        self.sampler = Sampler()
        # NOTE: requests without a seed of their own draw from one generator seeded here.
        self.sampler.generator = make_generator(model_config.seed, self.device)
        # Seeded sequences' own generators and structured-output matchers, kept until the
        # sequence finishes.
        self._generators: dict[str, torch.Generator] = {}
        # Per sequence: its blocks [0, n) went to the KV store (or were there before it ran).
        self._num_saved_blocks: dict[str, int] = {}
        self._matchers: dict[str, object] = {}
        self.pooler = Pooler()

    def close(self) -> None:
        """Release what the runner holds besides memory (a tensor-parallel runner's workers)."""

    def check_health(self) -> None:
        """Raise if the runner can no longer run a step (a tensor-parallel rank died); one
        process has nothing to check."""

    def copy_blocks(self, src_to_dst: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks in every layer before the step writes into them."""
        if src_to_dst:
            copy_blocks(self.kv_caches, list(src_to_dst))

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step: block copies, store loads, the forward, then one sample per
        sampling row. ``scheduler_output`` is read, never written: loads that fall short are
        reported in ``RunnerOutput.kv_load_shortfalls`` (the engine applies them)."""
        for req_id in scheduler_output.finished_req_ids:
            self._generators.pop(req_id, None)
            self._num_saved_blocks.pop(req_id, None)
            self._matchers.pop(req_id, None)
            self.pooler.release(req_id)
        try:
            self.copy_blocks(scheduler_output.block_copies)
        except Exception as exc:
            raise BlockCopyError(f"copying blocks {scheduler_output.block_copies} failed") from exc
        t0 = time.perf_counter()
        shortfalls = {}
        if scheduler_output.kv_loads:
            shortfalls = self._load_from_store(scheduler_output.kv_loads)
            # NOTE: a sequence whose load fell short computes from its first missing block.
            scheduler_output = scheduler_output.with_kv_load_shortfalls(shortfalls)
        scheduled = scheduler_output.scheduled
        batch: InputBatch = build_input_batch(
            scheduled, self.block_size, self.num_groups, self.device
        )
        t1 = time.perf_counter()
        with self._lora_step(scheduled):
            hidden = self.model(
                batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata
            )
        # NOTE: the LM head runs only on the rows that are sampled (the last token of each span).
        # NOTE: in the LM head's dtype; the sampler widens them to float32 only where it must.
        logits = self.model.compute_logits(
            hidden.index_select(0, batch.logits_indices),
            verify=batch.logits_rows is not None,
            float32=False,
        )
        prompt_logprobs = self._prompt_logprobs(scheduled, hidden)
        pooled = self.pooler(scheduled, hidden)
        t2 = time.perf_counter()
        rows = []
        speculative = []  # (sequence, logits row of its last position): verified apart
        for j, index in enumerate(batch.sampled):
            sched = scheduled[index]
            logits_row = j if batch.logits_rows is None else batch.logits_rows[j]
            if sched.spec_token_ids:
                speculative.append((sched, logits_row))
                continue
            rows.append(_SampleRow(sched.req_id, logits_row, sched, sched.seed))
            for child_id, seed in sched.forks:
                rows.append(_SampleRow(child_id, logits_row, sched, seed))
        output = self.sample(logits, rows)
        if speculative:
            verify_rows(output, logits.float(), speculative, self.sampler.generator)
        output.prompt_logprobs = prompt_logprobs
        output.pooled = pooled
        output.kv_load_shortfalls = shortfalls
        if self.kv_connector is not None:
            self._save_to_store(scheduled, output.failed)
        output.timings = StepTimings(t1 - t0, t2 - t1, time.perf_counter() - t2)
        return output

    def _lora_step(self, scheduled: Sequence[ScheduledRequest]):
        """Each row's adapter slot for this forward (a no-op without LoRA)."""
        if self.lora_manager is None:
            return contextlib.nullcontext()
        return self.lora_manager.activate(
            [s.lora_name for s in scheduled], [len(s.token_ids) for s in scheduled]
        )

    def _load_from_store(self, kv_loads: Sequence[KVLoad]) -> dict[str, int]:
        """Copy the store's blocks in before the forward; returns, for each load that fell short,
        id -> the position of its first missing block (the sequence computes from there)."""
        block_size = self.block_size
        shortfalls = {}
        for load in kv_loads:
            try:
                num_loaded = self.kv_connector.load_blocks(
                    self.kv_caches, load.block_ids, load.block_hashes
                )
            except Exception:  # NOTE: no store failure may fail a request: recompute instead.
                logger.exception("loading %d blocks from the KV store failed", len(load.block_ids))
                num_loaded = 0
            if self.parallel is not None:  # NOTE: the ranks must compute the same tokens
                num_loaded = self.parallel.min_int(num_loaded)
            if num_loaded < len(load.block_ids):
                shortfalls[load.req_id] = (load.first_block + num_loaded) * block_size
        return shortfalls

    def _save_to_store(self, scheduled: Sequence[ScheduledRequest], failed: dict) -> None:
        """Hand the blocks this step filled to the store's background writer (never waits)."""
        block_size = self.block_size
        block_ids: list[int] = []
        block_hashes: list[bytes] = []
        for s in scheduled:
            if s.req_id in failed:
                continue
            # NOTE: from the first block not saved yet, not from start_pos: a block that accepted
            # drafts completed is hashed only after its step, so the next step saves it.
            first = s.start_pos // block_size
            first = min(first, self._num_saved_blocks.get(s.req_id, first))
            last = min((s.start_pos + len(s.token_ids)) // block_size, len(s.block_hashes))
            if last > first:
                block_ids += s.block_ids[0][first:last]
                block_hashes += s.block_hashes[first:last]
                self._num_saved_blocks[s.req_id] = last
        if block_ids:
            try:
                self.kv_connector.save_blocks(self.kv_caches, block_ids, block_hashes)
            except Exception:
                logger.exception("saving %d blocks to the KV store failed", len(block_ids))

    def _prompt_logprobs(
        self, scheduled: Sequence[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, list]:
        """For sequences that ask: logprobs of each prompt token given the tokens before it.

        Returns request id -> [(position, TokenLogprobs)] for the prompt positions this step
        computed (position p scores prompt token p; position 0 has no logprob).
        """
        out: dict[str, list] = {}
        offset = 0
        for s in scheduled:
            num_tokens = len(s.token_ids)
            params = s.sampling_params
            k = None if params is None else params.prompt_logprobs
            num_prompt = len(s.prompt_token_ids)
            # Row j predicts position start + j + 1; only prompt tokens are scored.
            num_rows = min(num_tokens, num_prompt - 1 - s.start_pos)
            if k is not None and num_rows > 0:
                rows = hidden[offset : offset + num_rows]  # [num_rows, hidden]
                logprobs = compute_logprobs(self.model.compute_logits(rows))
                first = s.start_pos + 1
                targets = torch.tensor(
                    s.prompt_token_ids[first : first + num_rows], dtype=torch.int64
                )
                entries = gather_logprobs(logprobs, targets, [k] * num_rows, k)
                out[s.req_id] = list(zip(range(first, first + num_rows), entries, strict=True))
            offset += num_tokens
        return out

    def sample(self, logits: torch.Tensor, rows: list[_SampleRow]) -> RunnerOutput:
        """Sample every row; a row whose own sampling fails is reported, the others go on."""
        if not rows:
            return RunnerOutput()
        try:
            return self._sample(logits, rows)
        except Exception:
            if len(rows) == 1:
                raise
        # NOTE: the batch failed: sample each row alone so only the faulty ones fail.
        output = RunnerOutput()
        for row in rows:
            try:
                output.merge(self._sample(logits, [row]))
            except Exception as exc:
                output.failed[row.req_id] = f"sampling failed: {exc}"
        return output

    def _sample(self, logits: torch.Tensor, rows: list[_SampleRow]) -> RunnerOutput:
        index = [r.logits_row for r in rows]
        if index != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(index, dtype=torch.int64))
        matchers = [self._matcher(r) for r in rows]
        meta = build_sampling_metadata(
            [r.params for r in rows],
            [r.output_token_ids for r in rows],
            [r.prompt_token_ids for r in rows],
            [self._generator(r) for r in rows],
            self.vocab_size,
            self.eos_token_ids,
            matchers=matchers if any(m is not None for m in matchers) else None,
        )
        out = self.sampler(logits, meta)
        return RunnerOutput(
            req_ids=[r.req_id for r in rows],
            sampled_token_ids=out.sampled_token_ids.tolist(),
            logprobs=out.logprobs,
            stopped_req_ids={rows[i].req_id for i in out.terminated_rows},
        )

    def _matcher(self, row: _SampleRow):
        """The sequence's structured-output matcher (made on first sight), or None."""
        if row.params.structured_outputs is None:
            return None
        matcher = self._matchers.get(row.req_id)
        if matcher is None:
            from pagedattn.structured_output import new_matcher

            matcher = new_matcher(row.params, self.tokenizer, self.vocab_size)
            # NOTE: a sequence forked mid-way starts where its tokens are.
            for token in row.output_token_ids:
                matcher.accept_token(token)
            self._matchers[row.req_id] = matcher
        return matcher

    def _generator(self, row: _SampleRow) -> torch.Generator | None:
        if row.seed is None:
            return None
        generator = self._generators.get(row.req_id)
        if generator is None:
            generator = make_generator(row.seed, self.device)
            self._generators[row.req_id] = generator
        return generator
