"""The JSON protocol between the throughput benchmark and a peer runner in another venv.

The benchmark writes a job (model folder, dtype, threads, the workload's token ids, engine
options) to a file; the runner warms its engine up, times the whole workload (every request
arrives at t0) and writes a result: the timings the benchmark turns into a RunResult, or
``{"error": reason}``. Stdlib only: both the main venv and the peers' venvs import it.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

PROTOCOL_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
_JOB_KEYS = ("version", "engine", "model_dir", "dtype", "threads", "seed", "requests", "warmup")


def make_job(
    engine: str,
    model_dir: str,
    dtype: str,
    threads: int,
    seed: int,
    requests: list[tuple[list[int], int]],
    warmup_ids: list[int],
    warmup_max_tokens: int,
    warm_prefix: list[int] | None = None,
    options: dict | None = None,
) -> dict:
    """A job as a JSON-able dict; requests are (prompt token ids, max new tokens)."""
    job = {
        "version": PROTOCOL_VERSION,
        "engine": engine,
        "model_dir": model_dir,
        "dtype": dtype,
        "threads": threads,
        "seed": seed,
        "requests": [{"prompt_token_ids": list(p), "max_tokens": int(n)} for p, n in requests],
        "warmup": {"prompt_token_ids": list(warmup_ids), "max_tokens": warmup_max_tokens},
        "warm_prefix": list(warm_prefix) if warm_prefix else None,
        "options": dict(options or {}),
    }
    check_job(job)
    return job


def check_job(job: dict) -> None:
    """Raise ValueError naming the first field that is missing or wrong."""
    missing = [k for k in _JOB_KEYS if k not in job]
    if missing:
        raise ValueError(f"peer job lacks {missing}")
    if job["version"] != PROTOCOL_VERSION:
        raise ValueError(f"peer job version {job['version']}, this runner reads {PROTOCOL_VERSION}")
    if job["dtype"] not in DTYPES:
        raise ValueError(f"peer job dtype {job['dtype']!r}: choose from {', '.join(DTYPES)}")
    if not job["requests"]:
        raise ValueError("peer job has no requests")
    for i, r in enumerate(job["requests"]):
        if not r["prompt_token_ids"] or r["max_tokens"] < 1:
            raise ValueError(f"peer job request {i}: needs a prompt and max_tokens >= 1")


def max_seq_len(job: dict) -> int:
    """The longest prompt + output of the job (warm-ups included)."""
    reqs = [*job["requests"], job["warmup"]]
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    return max(longest, len(job["warm_prefix"] or []) + 1)


class TokenStamps:
    """When each request's tokens appeared: first-token time, last time and the count."""

    def __init__(self, num_requests: int, t0: float) -> None:
        self.t0 = t0
        self.first = [0.0] * num_requests
        self.last = [0.0] * num_requests
        self.count = [0] * num_requests

    def saw(self, index: int, num_tokens: int, now: float) -> None:
        """Request ``index`` now has ``num_tokens`` generated tokens in all."""
        if num_tokens <= self.count[index]:
            return
        if self.count[index] == 0:
            self.first[index] = now
        self.last[index] = now
        self.count[index] = num_tokens

    def result(self, elapsed_s: float, max_tokens: list[int], extra: dict) -> dict:
        """TTFT from t0; TPOT over the tokens after the first; output counts capped per request."""
        ttft = [f - self.t0 for f, n in zip(self.first, self.count, strict=True) if n > 0]
        tpot = [
            (last - first) / (n - 1)
            for first, last, n in zip(self.first, self.last, self.count, strict=True)
            if n > 1
        ]
        num_out = sum(min(n, m) for n, m in zip(self.count, max_tokens, strict=True))
        return {
            "elapsed_s": elapsed_s,
            "num_output_tokens": num_out,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "extra": extra,
        }


def check_result(result: dict) -> dict:
    """A runner's result, or ValueError if it is neither timings nor an error."""
    if "error" in result:
        return result
    missing = [k for k in ("elapsed_s", "num_output_tokens", "ttft_s", "tpot_s") if k not in result]
    if missing:
        raise ValueError(f"peer result lacks {missing}")
    return result


def runner_main(run: Callable[[dict], dict], argv: list[str] | None = None) -> int:
    """A runner's entry point: ``runner.py JOB RESULT``; failures are written as an error."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: runner.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    job_path, result_path = map(Path, argv)
    try:
        job = json.loads(job_path.read_text())
        check_job(job)
        result = run(job)
    except Exception as exc:  # NOTE: the benchmark shows the reason in the engine's error row
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result_path.write_text(json.dumps(result))
    return 0
