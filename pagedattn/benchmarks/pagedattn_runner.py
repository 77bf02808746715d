"""The measured side of the throughput benchmark: run options, results, and the pagedattn runner.

Each runner warms its engine up, then times the whole workload (every request arrives at t0) and
returns a RunResult. The benchmark calls each runner in a fresh subprocess, so the peak RSS it
reports belongs to that engine alone. ``measure_ceiling`` times the decode step's matmuls alone.
"""

from __future__ import annotations

import gc
import math
import re
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedattn.benchmarks.workloads import Workload

WARMUP_PROMPT_LEN = 16
WARMUP_MAX_TOKENS = 4
_STEP_FIELDS = ("schedule", "prepare", "forward", "sample", "process")


class PeerUnavailableError(RuntimeError):
    """A peer engine cannot run here (not installed, wrong model format); the message says why."""


@dataclass(frozen=True)
class RunOptions:
    """What every engine shares: model, dtype, threads, plus engine-specific knobs."""

    model: str | None
    dtype: str = "float32"
    threads: int = 2
    seed: int = 0
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_dtype: str = "auto"  # pagedattn's; fp8 ones compute their scales (first prefill)
    hf_batch_size: int = 32
    llama_batched_bench: str | None = None
    # llama.cpp's weights: "dtype" = the GGUF's numbers retyped to `dtype` (F32 / BF16), "f16" /
    # "bf16" / "f32" = retyped to that type, "gguf" = the file as shipped (Q4_1 for SmolLM2).
    llama_cpp_weights: str = "dtype"
    # A GGUF file llama.cpp runs as stored, instead of ``model`` per llama_cpp_weights.
    llama_cpp_model: str | None = None
    # llama.cpp's extra (repacked, AMX) buffer types: auto = on, and off where on crashes.
    llama_cpp_extra_bufts: str = "auto"
    # The checkpoint of the peers that load an HF folder (transformers, OpenVINO, vLLM CPU);
    # None: ``model``.
    hf_model: str | None = None


@dataclass
class RunResult:
    """Measured numbers of one engine on one workload (times in seconds)."""

    engine: str
    workload: str
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int  # useful tokens: each request's own, not padding or overrun
    ttft_s: list[float]
    tpot_s: list[float]
    peak_rss_mib: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def peak_rss_mib() -> float:
    """Peak resident set in MiB: this process's VmHWM, or a finished child's if larger."""
    own = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            own = int(line.split()[1]) / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return max(own, children)


def checkpoint_weight_bytes(model: str | None, dtype: str | None = None) -> int:
    """Bytes of a checkpoint's weights: a GGUF file's tensors as stored, an HF folder's in
    ``dtype`` (None: as stored)."""
    from safetensors import safe_open

    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import resolve_checkpoint

    ckpt = resolve_checkpoint(model)
    if isinstance(ckpt, GGUFCheckpoint):
        return sum(t.num_bytes for t in ckpt.file.tensors)
    total = 0
    for file in ckpt.safetensors_files():
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                itemsize = getattr(torch, dtype).itemsize if dtype else _itemsize(part.get_dtype())
                total += math.prod(part.get_shape()) * itemsize
    return total


def _itemsize(safetensors_dtype: str) -> int:
    """Bytes per element of a safetensors dtype name ("BF16", "F32", "I8", ...)."""
    bits = re.search(r"\d+", safetensors_dtype)
    return max(1, int(bits.group()) // 8) if bits else 1


def warmup_ids(workload: Workload) -> list[int]:
    return workload.requests[0].prompt_token_ids[:WARMUP_PROMPT_LEN]


# pagedattn.


def _sequence_lens(workload: Workload) -> list[int]:
    lens = [len(r.prompt_token_ids) + r.max_tokens for r in workload.requests]
    return (
        lens + [len(workload.warm_prefix or []) + 1] + [WARMUP_PROMPT_LEN + WARMUP_MAX_TOKENS] * 2
    )


def auto_num_blocks(workload: Workload, block_size: int) -> int:
    """Blocks for every request of the workload at once (no prefix sharing) plus the warm-ups,
    for a model with one KV cache group (run_pagedattn sizes again for more)."""
    return sum(-(-n // block_size) for n in _sequence_lens(workload)) + 1


def _blocks_needed(llm, workload: Workload) -> int:
    """auto_num_blocks by the engine's own count: every KV cache group's blocks (a model with
    sliding-window layers holds blocks in two groups)."""
    manager = llm.engine.kv_cache_manager
    budget = llm.engine.scheduler.step_budget.max_tokens
    return sum(manager.num_blocks_needed(n, budget) for n in _sequence_lens(workload)) + 1


def run_pagedattn(
    opts: RunOptions,
    workload: Workload,
    *,
    prefix_caching: bool = True,
    speculative_method: str | None = None,
) -> RunResult:
    """Drive LLM's engine step by step (as LLM.generate does), timing every step.

    A workload with info["sequential"] sends its requests one at a time (batch 1 each).
    """
    from pagedattn import LLM, SamplingParams

    spec = {} if speculative_method is None else {"speculative_method": speculative_method}

    def engine(num_blocks: int):
        return LLM(
            opts.model,
            dtype=opts.dtype,
            block_size=opts.block_size,
            num_blocks=num_blocks,
            kv_cache_dtype=opts.kv_cache_dtype,
            calculate_kv_scales=opts.kv_cache_dtype.startswith("fp8"),
            # NOTE: the pool's pages are written before timing, as vLLM's cache is allocated up
            # front: a first touch ran at 0.8-1.4 GB/s on the AMX Xeon VM, 3-5% of a uniform
            # run spent in the OS zeroing pages while the other thread waited.
            kv_cache_prefault=True,
            enable_prefix_caching=prefix_caching,
            num_threads=opts.threads,
            seed=opts.seed,
            **spec,
        )

    llm = engine(opts.num_blocks or auto_num_blocks(workload, opts.block_size))
    num_blocks = None if opts.num_blocks else _blocks_needed(llm, workload)
    if num_blocks is not None and num_blocks > llm.engine.kv_cache_manager.num_usable_blocks:
        # NOTE: more than one KV cache group (Gemma 3's sliding-window layers): built again
        # with the blocks every group holds, which only the loaded model can count.
        del llm
        gc.collect()
        llm = engine(num_blocks)
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([warmup_ids(workload)] * 2, SamplingParams(max_tokens=WARMUP_MAX_TOKENS, **greedy))
    if workload.warm_prefix:
        llm.generate([workload.warm_prefix], SamplingParams(max_tokens=1, **greedy))
    engine = llm.engine
    stats0 = llm.get_stats()
    t0 = time.perf_counter()
    pending = list(enumerate(workload.requests))
    sequential = workload.info.get("sequential", False)

    def add_next() -> None:
        i, req = pending.pop(0)
        engine.add_request(
            f"bench-{i}", req.prompt_token_ids, SamplingParams(max_tokens=req.max_tokens, **greedy)
        )

    while pending and not (sequential and engine.has_unfinished_requests()):
        add_next()
    steps, finished = [], {}
    times = engine.step_times
    while engine.has_unfinished_requests() or pending:
        if not engine.has_unfinished_requests():
            add_next()
        before = [getattr(times, f) for f in _STEP_FIELDS]
        num_prompt, num_gen = engine.num_prompt_tokens, engine.num_generation_tokens
        ts = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - ts
        parts = [getattr(times, f) - b for f, b in zip(_STEP_FIELDS, before, strict=True)]
        steps.append(
            (
                wall,
                *parts,
                engine.num_prompt_tokens - num_prompt,
                engine.num_generation_tokens - num_gen,
            )
        )
        finished |= {o.request_id: o for o in outputs if o.finished}
    elapsed = time.perf_counter() - t0
    outs = [finished[f"bench-{i}"] for i in range(len(workload.requests))]
    stats = llm.get_stats()
    extra = {
        "steps": steps,
        "prefix_caching": prefix_caching,
        "prefix_cache_hits": stats.prefix_cache_hits - stats0.prefix_cache_hits,
        "prefix_cache_queries": stats.prefix_cache_queries - stats0.prefix_cache_queries,
        "num_preemptions": stats.num_preemptions - stats0.num_preemptions,
        "num_blocks": stats.num_blocks,
        "weight_bytes": checkpoint_weight_bytes(opts.model, opts.dtype),
        "kv_cache_dtype": "u8"
        if engine.kv_cache_dtype == torch.uint8
        else str(engine.kv_cache_dtype).removeprefix("torch."),
    }
    if stats.spec_decode is not None:
        sd = stats.spec_decode
        extra["spec_decode"] = {
            "num_drafts": sd.num_drafts,
            "num_draft_tokens": sd.num_draft_tokens,
            "num_accepted_tokens": sd.num_accepted_tokens,
            "acceptance_rate": sd.acceptance_rate,
            "mean_accepted_length": sd.mean_accepted_length,
        }
    name = "pagedattn" if prefix_caching else "pagedattn_nocache"
    return RunResult(
        engine=name if speculative_method is None else f"pagedattn_{speculative_method}",
        workload=workload.name,
        elapsed_s=elapsed,
        num_requests=len(outs),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
        ttft_s=[o.metrics.ttft for o in outs if o.metrics.ttft is not None],
        tpot_s=[o.metrics.tpot for o in outs if o.metrics.tpot is not None],
        extra=extra,
    )


def median_time(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls of fn (no warm-up: the caller does it if needed)."""
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return sorted(samples)[reps // 2]


def _linear_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of a linear layer's weight (what one call reads, whichever kernel packed it): its
    GGUF blocks where it computes on them, else the float matrix."""
    quantized = module.quantized_bytes()
    return quantized or module.out_features * module.in_features * dtype.itemsize


def measure_ceiling(opts: RunOptions, batches: list[int], reps: int) -> dict:
    """Decode-step matmuls alone (the model's own linear layers and LM head, through the same
    kernels the engine runs) and copy bandwidth."""
    import torch.nn.functional as F

    from pagedattn.attention.layout import bytes_per_block
    from pagedattn.cpu.extension import flush_denormals_all_threads, keep_freed_heap_memory
    from pagedattn.cpu.linear import candidates
    from pagedattn.cpu.tuner import measure_kernels
    from pagedattn.model.layers import Linear
    from pagedattn.model.loader import load_model

    # NOTE: the process settings the engine's runner makes, so that the matmuls run as in a step.
    flush_denormals_all_threads()
    keep_freed_heap_memory()
    loaded = load_model(opts.model, opts.dtype, "cpu", None)
    model = loaded.model
    untied_head = getattr(model, "lm_head", None)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not untied_head]
    dtype = model.dtype
    embed = model.model.embed_tokens
    vocab_size, hidden_size = embed.num_embeddings, embed.embedding_dim
    if isinstance(untied_head, Linear):
        head_bytes = _linear_bytes(untied_head, dtype)
    elif getattr(embed, "lookup", None) is not None:
        head_bytes = embed.lookup.nbytes()  # NOTE: the tied head's blocks, the lookups' too
    else:
        head_bytes = vocab_size * hidden_size * dtype.itemsize
    result = {
        "matmul_s": {},
        "linear_kernel": loaded.plan.describe().removeprefix("linear "),
        "weight_bytes": sum(_linear_bytes(m, dtype) for m in linears) + head_bytes,
        "kv_bytes_per_token": bytes_per_block(
            model.num_layers, 1, model.num_kv_heads, model.head_size, dtype
        ),
    }
    with torch.inference_mode():
        for batch in batches:
            xs = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype) for m in linears}
            xh = torch.randn(batch, hidden_size, dtype=dtype)

            def one_pass(xs=xs, xh=xh) -> None:
                for m in linears:
                    m(xs[m.in_features])
                model.compute_logits(xh)

            one_pass()  # warm-up
            result["matmul_s"][str(batch)] = median_time(one_pass, reps)
        # NOTE: the same matmuls through every kernel that can run them (random weights of the
        # model's shapes), so the ceiling is the machine's best, not only the engine's choice.
        shapes = [(m.out_features, m.in_features) for m in linears] + [(vocab_size, hidden_size)]
        result["kernel_matmul_s"] = {
            str(batch): measure_kernels(candidates(dtype), shapes, batch, dtype)
            for batch in batches
        }
        src = torch.ones(256 * 2**20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        # NOTE: a copy reads and writes each byte, so it moves twice the buffer size.
        result["bandwidth_Bps"] = 2 * src.numel() / median_time(lambda: dst.copy_(src), 7)
        # NOTE: one decode-shaped linear with opts.threads and with 1 thread: when the first is
        # much slower, the threads wait on each other (a busy machine), not on the work.
        x, w = torch.randn(8, 576, dtype=dtype), torch.randn(3072, 576, dtype=dtype)
        for key, threads in (("probe_linear_s", opts.threads), ("probe_linear_1thread_s", 1)):
            torch.set_num_threads(threads)
            result[key] = median_time(lambda: F.linear(x, w), 21)
        torch.set_num_threads(opts.threads)
    return result
