"""OpenVINO GenAI's continuous-batching pipeline on one throughput job (run by .venv-openvino).

    .venv-openvino/bin/python openvino_runner.py JOB.json RESULT.json

The job's model_dir is an OpenVINO IR folder exported by optimum-intel (fp32 weights); the run's
dtype becomes the CPU plugin's inference precision hint. ``ContinuousBatchingPipeline`` is the
engine ``LLMPipeline`` runs when given a SchedulerConfig (paged attention, continuous
batching); it is driven step by step here so that each request's token times can be stamped.
"""

from __future__ import annotations

import time

from protocol import TokenStamps, runner_main

PRECISION = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# The same token budget per step as pagedattn's default max_num_batched_tokens.
MAX_NUM_BATCHED_TOKENS = 2048
# Request ids of the warm-up requests (the workload's are 0..n-1).
WARMUP_ID = 1_000_000_000


def _config(ov_genai, max_tokens: int):
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = max_tokens
    config.min_new_tokens = max_tokens
    config.ignore_eos = True
    config.do_sample = False
    return config


def _kv_precision(ov, properties: dict) -> str:
    """The KV cache element types: as set in properties, else the CPU plugin's defaults."""
    core = ov.Core()
    names = ("KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION")
    found = {}
    for name in names:
        if name in properties:
            found[name] = str(properties[name])
            continue
        try:
            value = core.get_property("CPU", name)
        except Exception:  # NOTE: older plugins know only KV_CACHE_PRECISION
            continue
        found[name] = value.to_string() if hasattr(value, "to_string") else str(value)
    key = found.get("KEY_CACHE_PRECISION", found.get("KV_CACHE_PRECISION", "?"))
    value = found.get("VALUE_CACHE_PRECISION", found.get("KV_CACHE_PRECISION", "?"))
    return key if key == value else f"key {key} / value {value}"


def run(job: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    opts = job["options"]
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = int(opts.get("cache_size_gb", 1))
    scheduler.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS
    scheduler.max_num_seqs = max(256, len(job["requests"]))
    scheduler.enable_prefix_caching = bool(opts.get("enable_prefix_caching", True))
    properties = {
        "INFERENCE_PRECISION_HINT": PRECISION[job["dtype"]],
        "INFERENCE_NUM_THREADS": int(job["threads"]),
    }
    kv = opts.get("kv_cache_precision")
    if kv:
        properties["KV_CACHE_PRECISION"] = kv
        properties["KEY_CACHE_PRECISION"] = kv
        properties["VALUE_CACHE_PRECISION"] = kv
    pipe = ov_genai.ContinuousBatchingPipeline(job["model_dir"], scheduler, "CPU", properties)

    def tensor(ids: list[int]):
        return ov.Tensor(np.array([ids], dtype=np.int64))

    def drain(handles: dict[int, object], stamps: TokenStamps | None) -> None:
        counts = dict.fromkeys(handles, 0)
        while pipe.has_non_finished_requests():
            pipe.step()
            now = time.perf_counter()
            for i, handle in handles.items():
                if handle.can_read():
                    for out in handle.read().values():
                        counts[i] += len(out.generated_ids)
                    if stamps is not None:
                        stamps.saw(i, counts[i], now)

    warm = job["warmup"]
    warm_ids, warm_config = tensor(warm["prompt_token_ids"]), _config(ov_genai, warm["max_tokens"])
    drain({i: pipe.add_request(WARMUP_ID + i, warm_ids, warm_config) for i in range(2)}, None)
    if job["warm_prefix"]:
        prefix = tensor(job["warm_prefix"])
        drain({0: pipe.add_request(WARMUP_ID + 2, prefix, _config(ov_genai, 1))}, None)
    reqs = job["requests"]
    inputs = [(tensor(r["prompt_token_ids"]), _config(ov_genai, r["max_tokens"])) for r in reqs]
    t0 = time.perf_counter()
    stamps = TokenStamps(len(reqs), t0)
    handles = {i: pipe.add_request(i, ids, config) for i, (ids, config) in enumerate(inputs)}
    drain(handles, stamps)
    elapsed = time.perf_counter() - t0
    return stamps.result(
        elapsed,
        [r["max_tokens"] for r in reqs],
        {
            "kv_cache_dtype": _kv_precision(ov, properties),
            "note": f"openvino-genai {ov_genai.__version__}, ContinuousBatchingPipeline on CPU, "
            f"inference precision {properties['INFERENCE_PRECISION_HINT']}, fp32 IR weights, "
            f"cache {scheduler.cache_size} GB, prefix caching "
            f"{'on' if scheduler.enable_prefix_caching else 'off'}",
            "version": ov_genai.__version__,
        },
    )


if __name__ == "__main__":
    raise SystemExit(runner_main(run))
