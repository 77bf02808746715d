"""Request traces: ShareGPT-like and Alpaca-like generators, and JSONL load/save."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


class TraceError(ValueError):
    """A trace file or trace parameter is malformed; the message names the line or value."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: lengths in tokens, arrival time in simulated steps."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival_time: float = 0.0
    # The client's max_tokens; output_len <= max_tokens. Contiguous policy (b) reserves it.
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise TraceError(
                f"request {self.request_id!r}: prompt_len={self.prompt_len} and "
                f"output_len={self.output_len} must both be >= 1"
            )
        if self.max_tokens < self.output_len:
            raise TraceError(
                f"request {self.request_id!r}: max_tokens={self.max_tokens} is below "
                f"output_len={self.output_len}; set max_tokens >= output_len"
            )
        if self.arrival_time < 0:
            raise TraceError(f"request {self.request_id!r}: arrival_time must be >= 0")

    @property
    def final_kv_len(self) -> int:
        """Most KV slots the request ever fills: the last sampled token is never written."""
        return self.prompt_len + self.output_len - 1


@dataclass(frozen=True)
class WorkloadShape:
    """Log-normal prompt and output length distributions, given by their means."""

    name: str
    prompt_mean: float
    output_mean: float
    sigma: float
    max_tokens: int


# NOTE: the means are the PagedAttention paper's dataset statistics (ShareGPT: 161 in / 338 out,
# Alpaca: 19 in / 58 out); sigma sets the spread of a log-normal with that mean.
SHAREGPT = WorkloadShape(
    "sharegpt", prompt_mean=161.0, output_mean=338.0, sigma=1.0, max_tokens=1024
)
ALPACA = WorkloadShape("alpaca", prompt_mean=19.0, output_mean=58.0, sigma=0.8, max_tokens=256)
WORKLOADS = {w.name: w for w in (SHAREGPT, ALPACA)}


def _clipped_lognormal_mean(mu: float, sigma: float, hi: float) -> float:
    """E[min(X, hi)] for X = exp(N(mu, sigma^2))."""

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    log_hi = math.log(hi)
    return math.exp(mu + sigma**2 / 2) * phi((log_hi - mu - sigma**2) / sigma) + hi * (
        1.0 - phi((log_hi - mu) / sigma)
    )


def _lognormal_lengths(
    rng: np.random.Generator, mean: float, sigma: float, n: int, hi: int
) -> np.ndarray:
    """Log-normal lengths clipped to [1, hi] whose clipped mean is ``mean`` (mu by bisection)."""
    lo_mu, hi_mu = math.log(mean) - sigma**2 / 2, math.log(hi)
    if mean >= hi:
        raise TraceError(f"mean length {mean} must be below the clip bound {hi}")
    for _ in range(60):
        mid = (lo_mu + hi_mu) / 2
        lo_mu, hi_mu = (
            (mid, hi_mu) if _clipped_lognormal_mean(mid, sigma, hi) < mean else (lo_mu, mid)
        )
    return np.clip(np.rint(rng.lognormal(lo_mu, sigma, n)), 1, hi).astype(np.int64)


def generate_trace(
    workload: str | WorkloadShape,
    num_requests: int,
    *,
    max_seq_len: int = 2048,
    arrival_rate: float = math.inf,
    seed: int = 0,
) -> list[TraceRequest]:
    """Draw a trace; arrivals are Poisson with ``arrival_rate`` requests/step (inf: all at 0)."""
    if isinstance(workload, str):
        if workload not in WORKLOADS:
            raise TraceError(f"unknown workload {workload!r}: use one of {sorted(WORKLOADS)}")
        workload = WORKLOADS[workload]
    if num_requests < 1 or arrival_rate <= 0:
        raise TraceError("num_requests must be >= 1 and arrival_rate > 0")
    rng = np.random.default_rng(seed)
    max_tokens = min(workload.max_tokens, max_seq_len - 1)
    prompts = _lognormal_lengths(
        rng, workload.prompt_mean, workload.sigma, num_requests, max_seq_len - 1
    )
    outputs = _lognormal_lengths(
        rng, workload.output_mean, workload.sigma, num_requests, max_tokens
    )
    if math.isinf(arrival_rate):
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / arrival_rate, num_requests))
    trace = []
    for i in range(num_requests):
        prompt_len = int(prompts[i])
        # NOTE: a request never outgrows the context: max_tokens <= max_seq_len - prompt_len.
        req_max_tokens = min(max_tokens, max_seq_len - prompt_len)
        output_len = min(int(outputs[i]), req_max_tokens)
        trace.append(
            TraceRequest(
                f"{workload.name}-{i}", prompt_len, output_len, float(arrivals[i]), req_max_tokens
            )
        )
    return trace


def with_system_prompt(
    trace: list[TraceRequest], system_prompt_len: int, max_seq_len: int
) -> list[TraceRequest]:
    """Each prompt grows by a shared system prompt; requests that no longer fit are dropped."""
    shifted = [
        TraceRequest(
            r.request_id,
            r.prompt_len + system_prompt_len,
            r.output_len,
            r.arrival_time,
            min(r.max_tokens, max_seq_len - r.prompt_len - system_prompt_len),
        )
        for r in trace
        if r.prompt_len + system_prompt_len + r.output_len <= max_seq_len
    ]
    if not shifted:
        raise TraceError(
            f"no request fits max_seq_len={max_seq_len} after a {system_prompt_len}-token system "
            "prompt: shorten the system prompt"
        )
    return shifted


def save_jsonl(trace: list[TraceRequest], path: str | Path) -> None:
    """Write one JSON object per request."""
    with open(path, "w") as f:
        for req in trace:
            f.write(json.dumps(asdict(req)) + "\n")


def load_jsonl(path: str | Path, *, default_max_tokens: int | None = None) -> list[TraceRequest]:
    """Read a trace: each line has prompt_len, output_len and optionally arrival_time,
    max_tokens (default: ``default_max_tokens`` or output_len) and request_id."""
    trace = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                output_len = int(obj["output_len"])
                trace.append(
                    TraceRequest(
                        request_id=str(obj.get("request_id", f"req-{lineno}")),
                        prompt_len=int(obj["prompt_len"]),
                        output_len=output_len,
                        arrival_time=float(obj.get("arrival_time", 0.0)),
                        max_tokens=int(obj.get("max_tokens", default_max_tokens or output_len)),
                    )
                )
            except (KeyError, ValueError, TypeError) as e:
                raise TraceError(
                    f"{path}:{lineno}: {e}; each line needs prompt_len and output_len "
                    "(ints), optionally arrival_time, max_tokens, request_id"
                ) from e
    if not trace:
        raise TraceError(f"{path}: the trace is empty")
    return trace
