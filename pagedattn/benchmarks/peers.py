"""Peer engines for the throughput benchmark: HF static generate, HF generate_batch, llama.cpp.

(llama.cpp: llama_cpp_peer.py; OpenVINO GenAI and vLLM's CPU build, which need their own venvs:
peers_cpu_engines.py.)

Same contract as benchmarks.pagedattn_runner.run_pagedattn: warm up, time the whole workload
(every request arrives at t0), return a RunResult.
"""

from __future__ import annotations

import time

import torch

from pagedattn.benchmarks.llama_cpp_peer import run_llama_cpp
from pagedattn.benchmarks.pagedattn_runner import (
    WARMUP_MAX_TOKENS,
    RunOptions,
    RunResult,
    run_pagedattn,
    warmup_ids,
)
from pagedattn.benchmarks.workloads import Workload

# transformers' continuous batching treats a negative eos id as "no EOS" (ignore_eos).
HF_NO_EOS = -1
HF_PAGE_SIZE = 256
# The same token budget per step as pagedattn's default max_num_batched_tokens.
HF_MAX_BATCH_TOKENS = 2048


# Hugging Face transformers.


def load_hf_model(opts: RunOptions):
    """The same checkpoint in transformers (RunOptions.hf_model where given): a GGUF file is
    dequantised by transformers itself."""
    from transformers import AutoModelForCausalLM

    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import resolve_checkpoint

    dtype = getattr(torch, opts.dtype)
    ckpt = resolve_checkpoint(opts.hf_model or opts.model)
    if isinstance(ckpt, GGUFCheckpoint):
        model = AutoModelForCausalLM.from_pretrained(
            ckpt.path.parent, gguf_file=ckpt.path.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dtype)
    return model.eval()


def hf_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a transformers model's parameters as it holds them (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _TokenClock:
    """A stopping criterion that never stops: it stamps the time each new token appears."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _hf_static_batch(model, prompts: list[list[int]], num_new: int, pad_id: int) -> list[float]:
    from transformers import GenerationConfig, StoppingCriteriaList

    max_len = max(len(p) for p in prompts)
    ids = [[pad_id] * (max_len - len(p)) + p for p in prompts]  # left padding
    mask = [[0] * (max_len - len(p)) + [1] * len(p) for p in prompts]
    clock = _TokenClock()
    config = GenerationConfig(
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=None,
    )
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    return [start, *clock.stamps]


def run_hf_static(opts: RunOptions, workload: Workload) -> RunResult:
    """Static batches in arrival order, left padded, each run to its longest request."""
    model = load_hf_model(opts)
    pad_id = model.config.pad_token_id
    pad_id = 0 if pad_id is None else int(pad_id)
    _hf_static_batch(model, [warmup_ids(workload)] * 2, WARMUP_MAX_TOKENS, pad_id)
    reqs = workload.requests
    ttft, tpot, batches = [], [], []
    t0 = time.perf_counter()
    for lo in range(0, len(reqs), opts.hf_batch_size):
        batch = reqs[lo : lo + opts.hf_batch_size]
        num_new = max(r.max_tokens for r in batch)
        stamps = _hf_static_batch(model, [r.prompt_token_ids for r in batch], num_new, pad_id)
        prefill = stamps[1] - stamps[0]
        decode = (stamps[-1] - stamps[1]) / max(1, len(stamps) - 2)
        # NOTE: TTFT counts from the common arrival t0, so a later batch's wait is included.
        ttft += [stamps[1] - t0] * len(batch)
        tpot += [decode] * len(batch)
        batches.append(
            {"size": len(batch), "num_new": num_new, "prefill_s": prefill, "decode_step_s": decode}
        )
    elapsed = time.perf_counter() - t0
    return RunResult(
        "hf_static",
        workload.name,
        elapsed,
        len(reqs),
        workload.num_prompt_tokens,
        workload.num_output_tokens,
        ttft,
        tpot,
        extra={"batches": batches, "weight_bytes": hf_weight_bytes(model)},
    )


def run_hf_batch(opts: RunOptions, workload: Workload) -> RunResult:
    """transformers' continuous batching (generate_batch's manager), per-request max_new_tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = load_hf_model(opts)
    reqs = workload.requests
    # NOTE: sized like pagedattn's KV cache (every request at once); left alone, transformers
    # takes 90% of free host memory for it on CPU.
    pages = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // HF_PAGE_SIZE) for r in reqs)
    cb_config = ContinuousBatchingConfig(
        page_size=HF_PAGE_SIZE, num_blocks=pages + 2, max_batch_tokens=HF_MAX_BATCH_TOKENS
    )
    warm = GenerationConfig(max_new_tokens=WARMUP_MAX_TOKENS, do_sample=False)
    model.generate_batch(
        inputs=[warmup_ids(workload)] * 2,
        generation_config=warm,
        continuous_batching_config=cb_config,
    )
    config = GenerationConfig(max_new_tokens=max(r.max_tokens for r in reqs), do_sample=False)
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5
    ) as manager:
        t0 = time.perf_counter()
        for i, r in enumerate(reqs):
            manager.add_request(
                r.prompt_token_ids,
                request_id=f"bench-{i}",
                max_new_tokens=r.max_tokens,
                record_timestamps=True,
                eos_token_id=HF_NO_EOS,
            )
        while len(results) < len(reqs):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError(f"transformers' batch thread died after {len(results)} results")
        elapsed = time.perf_counter() - t0
    outs = [results[f"bench-{i}"] for i in range(len(reqs))]
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed in generate_batch: {errors[0]}")
    ttft = [o.timestamps[0] - o.created_time for o in outs if o.timestamps]
    tpot = [
        (o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1)
        for o in outs
        if o.timestamps and len(o.timestamps) > 1
    ]
    num_out = sum(
        min(len(o.generated_tokens), r.max_tokens) for o, r in zip(outs, reqs, strict=True)
    )
    return RunResult(
        "hf_batch",
        workload.name,
        elapsed,
        len(reqs),
        workload.num_prompt_tokens,
        num_out,
        ttft,
        tpot,
        extra={"weight_bytes": hf_weight_bytes(model)},
    )


RUNNERS = {
    "pagedattn": run_pagedattn,
    "pagedattn_nocache": lambda opts, w: run_pagedattn(opts, w, prefix_caching=False),
    "pagedattn_ngram": lambda opts, w: run_pagedattn(opts, w, speculative_method="ngram"),
    "hf_static": run_hf_static,
    "hf_batch": run_hf_batch,
    "llama_cpp": run_llama_cpp,
}
