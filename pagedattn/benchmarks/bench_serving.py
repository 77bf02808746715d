"""Serving benchmark: Poisson arrivals of ShareGPT-like requests against live HTTP servers.

    pagedattn bench serve --seed 0 [--model M] [--rates 1,4] [--num-prompts 16]

Starts `pagedattn serve` on a free port and, beside it, `transformers serve` on the same weights
when that runs offline on this machine (else it prints why and skips that column). Both get the
same requests (same seed) through `/v1/completions` with streaming; each request's TTFT (first
text chunk), TPOT ((end - first chunk) / (tokens - 1)) and end-to-end latency are measured on the
client. A GGUF model (the default SmolLM2-135M) is converted once to an HF folder under bench_out/
so that both servers load identical weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pagedattn.benchmarks.serving_procs import (
    ServerProc,
    hf_model_dir,
    start_pagedattn,
    start_transformers,
)

# ShareGPT conversations have a long tail: lognormal lengths, clipped (scaled down for CPU runs).
PROMPT_LEN_MEDIAN, PROMPT_LEN_SIGMA, PROMPT_LEN_MAX = 48, 0.8, 384
OUTPUT_LEN_MEDIAN, OUTPUT_LEN_SIGMA, OUTPUT_LEN_MAX = 32, 0.7, 128
WORST_TOKENS_PER_WORD = 2
DEFAULT_MAX_MODEL_LEN = 2048
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have "
         "from or one had by word but not what all were we when your can said there use an each "
         "which she do how their if will up other about out many then them these so some her "
         "would make like him into time has look two more write go see number no way could "
         "people my than first water been call who oil its now find long down day did get come "
         "made may part").split()  # fmt: skip


@dataclass
class BenchRequest:
    """One request of the workload: its prompt and how many tokens it asks for."""

    prompt: str
    max_tokens: int


@dataclass
class RequestResult:
    """Client-side timings of one request."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    num_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.num_tokens - 1) if self.num_tokens > 1 else None


def make_workload(seed: int, num_prompts: int, max_model_len: int) -> list[BenchRequest]:
    """ShareGPT-like prompt and output lengths (lognormal, clipped), from a seeded RNG."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        num_words = min(PROMPT_LEN_MAX, max(4, int(rng.lognormvariate(0, PROMPT_LEN_SIGMA) *
                                                   PROMPT_LEN_MEDIAN)))  # fmt: skip
        max_tokens = min(OUTPUT_LEN_MAX, max(2, int(rng.lognormvariate(0, OUTPUT_LEN_SIGMA) *
                                                    OUTPUT_LEN_MEDIAN)))  # fmt: skip
        # NOTE: a word is at most ~2 tokens in common tokenizers; keep every request servable.
        num_words = min(num_words, (max_model_len - max_tokens) // WORST_TOKENS_PER_WORD)
        prompt = " ".join(rng.choice(WORDS) for _ in range(num_words))
        requests.append(BenchRequest(prompt, max_tokens))
    return requests


async def _one(
    http: httpx.AsyncClient, server: ServerProc, req: BenchRequest, timeout: float
) -> RequestResult:
    body = {"model": server.model_id, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **server.extra_body}  # fmt: skip
    t0 = time.perf_counter()
    ttft, num_chunks, usage_tokens = None, 0, None
    try:
        async with http.stream("POST", f"{server.base_url}/v1/completions", json=body,
                               timeout=timeout) as resp:  # fmt: skip
            if resp.status_code != 200:
                return RequestResult(False, error=f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        num_chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(False, error=repr(exc))
    e2e = time.perf_counter() - t0
    return RequestResult(True, ttft if ttft is not None else e2e, e2e, usage_tokens or num_chunks)


async def run_rate(
    server: ServerProc, workload: list[BenchRequest], rate: float, seed: int, timeout: float
) -> tuple[list[RequestResult], float]:
    """Send the workload with Poisson arrivals at `rate` req/s (inf: all at once)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(workload) + 4)
    async with httpx.AsyncClient(limits=limits) as http:
        tasks, t = [], 0.0
        start = time.perf_counter()
        for req in workload:
            delay = t - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(http, server, req, timeout)))
            if rate != float("inf"):
                t += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(name: str, rate: float, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [r.tpot * 1000 for r in ok if r.tpot is not None]
    e2e = [r.e2e * 1000 for r in ok]
    num_tokens = sum(r.num_tokens for r in ok)
    return {
        "server": name, "rate": rate, "ok": len(ok), "errors": len(results) - len(ok),
        "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
        "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
        "e2e_p50": _pct(e2e, 50), "e2e_p99": _pct(e2e, 99),
        "req_s": len(ok) / duration, "tok_s": num_tokens / duration,
    }  # fmt: skip


COLUMNS = ("server", "rate", "ok", "errors", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
           "e2e_p50", "e2e_p99", "req_s", "tok_s")  # fmt: skip


def _fmt(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def print_table(rows: list[dict]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in COLUMNS}
    print("  ".join(c.rjust(widths[c]) for c in COLUMNS))
    for row in rows:
        print("  ".join(_fmt(row[c]).rjust(widths[c]) for c in COLUMNS))
    print("(latencies in ms; req_s and tok_s = completed requests and output tokens per second)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--replicas" or a.startswith(("--replicas=", "--router")) for a in argv):
        # NOTE: `pagedattn bench serve --replicas N --router R`: the Ray Serve replicas benchmark.
        from pagedattn.benchmarks.bench_replicas import main as replicas_main

        return replicas_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--rates", default="1,4", help="request rates (req/s), 'inf' = burst")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per rate")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per server")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out-dir", default="bench_out", help="converted models, server logs")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    model_dir = hf_model_dir(args.model, out_dir)
    starters = [("pagedattn", start_pagedattn)]
    if not args.skip_transformers:
        starters.append(("transformers", start_transformers))
    rows: list[dict] = []
    max_model_len = DEFAULT_MAX_MODEL_LEN
    for name, start in starters:
        server = start(model_dir, out_dir, args.threads)
        if isinstance(server, str):
            print(f"[bench_serving] {name}: skipped: {server}")
            continue
        # NOTE: pagedattn starts first; its max_model_len bounds the workload of both servers.
        max_model_len = server.max_model_len or max_model_len
        workload = make_workload(args.seed, args.num_prompts, max_model_len)
        try:
            warmup = make_workload(args.seed + 1, 2, max_model_len)
            asyncio.run(run_rate(server, warmup, float("inf"), args.seed, args.timeout))
            for rate in rates:
                results, duration = asyncio.run(
                    run_rate(server, workload, rate, args.seed, args.timeout)
                )
                row = summarize(name, rate, results, duration)
                rows.append(row)
                print("[bench_serving] " + " ".join(f"{c}={_fmt(row[c])}" for c in COLUMNS))
                errors = {r.error for r in results if not r.ok}
                if errors:
                    print(f"[bench_serving] {name} errors: {sorted(errors)[:3]}")
        finally:
            server.stop()
    if rows:
        print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
