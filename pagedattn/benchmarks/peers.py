"""Peer engines for the throughput benchmark: HF static generate, HF generate_batch, llama.cpp.

(OpenVINO GenAI and vLLM's CPU build, which need their own venvs: peers_cpu_engines.py.)

Same contract as benchmarks.pagedattn_runner.run_pagedattn: warm up, time the whole workload
(every request arrives at t0), return a RunResult.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import torch

from pagedattn.benchmarks.gguf_retype import gguf_type_name, retyped_gguf
from pagedattn.benchmarks.pagedattn_runner import (
    WARMUP_MAX_TOKENS,
    PeerUnavailableError,
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
    """The same checkpoint in transformers: a GGUF file is dequantised by transformers itself."""
    from transformers import AutoModelForCausalLM

    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import resolve_checkpoint

    dtype = getattr(torch, opts.dtype)
    ckpt = resolve_checkpoint(opts.model)
    if isinstance(ckpt, GGUFCheckpoint):
        model = AutoModelForCausalLM.from_pretrained(
            ckpt.path.parent, gguf_file=ckpt.path.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dtype)
    return model.eval()


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
        extra={"batches": batches},
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
    )


# llama.cpp.


def _gguf_path(opts: RunOptions) -> tuple[Path, str]:
    """The GGUF file llama.cpp runs (see RunOptions.llama_cpp_weights) and its weight type."""
    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import resolve_checkpoint

    ckpt = resolve_checkpoint(opts.model)
    if not isinstance(ckpt, GGUFCheckpoint):
        raise PeerUnavailableError(f"llama.cpp needs a .gguf model; {opts.model!r} is not one")
    if opts.llama_cpp_weights == "gguf":
        return ckpt.path, "as shipped: " + ckpt.path.stem.rsplit(".", 1)[-1]
    dtype = opts.dtype if opts.llama_cpp_weights == "dtype" else opts.llama_cpp_weights
    return retyped_gguf(ckpt.path, dtype), gguf_type_name(dtype) + ", dequantised from the GGUF"


def parse_batched_bench(text: str) -> dict[str, float]:
    """The first data row of llama-batched-bench's markdown table, keyed by column name."""
    header = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "T_PP s" in cells:
            header = cells
        elif header and len(cells) == len(header) and re.fullmatch(r"[\d.]+", cells[0]):
            return {k: float(v) for k, v in zip(header, cells, strict=True)}
    raise ValueError("no result row in llama-batched-bench output (is it a llama.cpp build?)")


def run_llama_cpp(opts: RunOptions, workload: Workload) -> RunResult:
    """llama.cpp on the same GGUF: `llama-batched-bench` if given, else llama-cpp-python."""
    if opts.llama_batched_bench:
        return _run_batched_bench(opts, workload)
    try:
        import llama_cpp
    except ImportError as exc:
        raise PeerUnavailableError(
            "llama-cpp-python is not installed (make bench-peers installs it) and no "
            "--llama-batched-bench binary was given"
        ) from exc
    return _run_llama_cpp_python(llama_cpp, opts, workload)


def _run_llama_cpp_python(L, opts: RunOptions, workload: Workload) -> RunResult:  # noqa: N803
    """Continuous batching through llama.cpp's C API (as llama-server's slots do it).

    Up to ``hf_batch_size`` sequences run at once, each with its own sequence id and its own KV
    stream sized for the longest request (llama.cpp's default, non-unified cache: with a unified
    one every token attends over all cells, masked, and a 32-sequence uniform run measured 62.6
    tok/s); every llama_decode call carries one token per running sequence plus prompt tokens
    of newly admitted ones (up to n_batch), greedy argmax over each returned row of logits. A
    finished sequence's cells are released (llama_memory_seq_rm) and the next request takes its
    slot. No prefix reuse between sequences.
    """
    import numpy as np

    gguf_file, weights = _gguf_path(opts)
    path = str(gguf_file)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    reqs = workload.requests
    slots = max(1, min(opts.hf_batch_size, len(reqs)))
    per_seq = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs) + 16
    per_seq = -(-per_seq // 256) * 256
    n_batch = 2048
    cparams = L.llama_context_default_params()
    cparams.n_ctx = slots * per_seq
    cparams.n_batch = n_batch
    cparams.n_ubatch = 512
    cparams.n_seq_max = slots
    cparams.kv_unified = False
    cparams.n_threads = cparams.n_threads_batch = opts.threads
    ctx = L.llama_init_from_model(model, cparams)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(n_batch, 0, 1)
    memory = L.llama_get_memory(ctx)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, seq_id, wants_logits)."""
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want
        batch.n_tokens = len(entries)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(i: int) -> int:
        row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
        return int(row.argmax())

    # Warm-up on a throwaway sequence.
    warm = warmup_ids(workload)
    decode([(t, p, 0, p == len(warm) - 1) for p, t in enumerate(warm)])
    L.llama_memory_seq_rm(memory, 0, -1, -1)

    free_slots = list(range(slots))
    waiting = list(range(len(reqs)))
    running: dict[int, dict] = {}  # seq id -> state
    ttft, tpot, num_out = [0.0] * len(reqs), [], 0
    t0 = time.perf_counter()
    while waiting or running:
        entries, owners = [], []
        for seq, st in running.items():
            if st["prefilled"]:
                entries.append((st["out"][-1], st["pos"], seq, True))
                owners.append(seq)
        while waiting and free_slots:  # admit into free slots; prompts are fed below
            seq = free_slots.pop(0)
            running[seq] = {"req": waiting.pop(0), "pos": 0, "prefilled": False, "out": []}
        budget = n_batch - len(entries)
        for seq, st in running.items():  # prompts in admission order, chunk by chunk
            prompt = reqs[st["req"]].prompt_token_ids
            while not st["prefilled"] and budget > 0:
                p = st["pos"]
                last = p == len(prompt) - 1
                entries.append((prompt[p], p, seq, last))
                owners.append(seq if last else -1)
                st["pos"] += 1
                st["prefilled"] = last
                budget -= 1
        decode(entries)
        now = time.perf_counter()
        for i, seq in enumerate(owners):
            if seq < 0:
                continue
            st = running[seq]
            if st["out"]:
                st["pos"] += 1  # the token fed this step now sits in the cache
            st["out"].append(argmax(i))
            if len(st["out"]) == 1:
                st["first"] = now
                ttft[st["req"]] = now - t0
            if len(st["out"]) >= reqs[st["req"]].max_tokens:
                num_out += len(st["out"])
                if len(st["out"]) > 1:
                    tpot.append((now - st["first"]) / (len(st["out"]) - 1))
                L.llama_memory_seq_rm(memory, seq, -1, -1)
                del running[seq]
                free_slots.append(seq)
    elapsed = time.perf_counter() - t0
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return RunResult(
        "llama_cpp",
        workload.name,
        elapsed,
        len(reqs),
        workload.num_prompt_tokens,
        num_out,
        ttft,
        tpot,
        extra={
            "note": f"llama-cpp-python {L.__version__}, continuous batching over {slots} "
            f"sequences, weights {weights}, no prefix reuse",
            "kv_cache_dtype": _ggml_type_name(L, cparams.type_k, cparams.type_v),
        },
    )


def _ggml_type_name(L, type_k: int, type_v: int) -> str:  # noqa: N803
    """llama.cpp's KV cache types by name (f16 unless a context parameter says otherwise)."""
    names = {
        int(getattr(L, f"GGML_TYPE_{n.upper()}")): n
        for n in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
        if hasattr(L, f"GGML_TYPE_{n.upper()}")
    }
    k, v = names.get(int(type_k), f"type {type_k}"), names.get(int(type_v), f"type {type_v}")
    return k if k == v else f"key {k} / value {v}"


def _run_batched_bench(opts: RunOptions, workload: Workload) -> RunResult:
    binary = shutil.which(opts.llama_batched_bench) or opts.llama_batched_bench
    if not Path(binary).exists():
        raise PeerUnavailableError(f"llama-batched-bench not found at {opts.llama_batched_bench}")
    reqs = workload.requests
    shapes = {(len(r.prompt_token_ids), r.max_tokens) for r in reqs}
    if len(shapes) != 1 and workload.warm_prefix is None:
        raise PeerUnavailableError(
            f"llama-batched-bench runs equal-length requests only; skipped on {workload.name}"
        )
    shared = workload.warm_prefix is not None
    num_prompt, num_new = max(shapes)
    batch = len(reqs)
    ctx = num_prompt + batch * num_new if shared else batch * (num_prompt + num_new)
    gguf_file, weights = _gguf_path(opts)
    cmd = [
        binary,
        "-m",
        str(gguf_file),
        "-c",
        str(ctx + 16),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(num_prompt),
        "-ntg",
        str(num_new),
        "-npl",
        str(batch),
        "-t",
        str(opts.threads),
    ] + (["-pps"] if shared else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-500:]}")
    row = parse_batched_bench(proc.stdout + proc.stderr)
    num_prompt_total = num_prompt if shared else batch * num_prompt
    return RunResult(
        "llama_cpp",
        workload.name,
        row["T s"],
        batch,
        num_prompt_total,
        batch * num_new,
        [row["T_PP s"]] * batch,
        [row["T_TG s"] / num_new] * batch,
        extra={
            "note": f"llama-batched-bench, weights {weights}",
            "kv_cache_dtype": "f16",  # llama-batched-bench's default -ctk / -ctv
            "shared_prompt": shared,
            "row": row,
        },
    )


RUNNERS = {
    "pagedattn": run_pagedattn,
    "pagedattn_nocache": lambda opts, w: run_pagedattn(opts, w, prefix_caching=False),
    "pagedattn_ngram": lambda opts, w: run_pagedattn(opts, w, speculative_method="ngram"),
    "hf_static": run_hf_static,
    "hf_batch": run_hf_batch,
    "llama_cpp": run_llama_cpp,
}
