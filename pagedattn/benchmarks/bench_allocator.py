"""CPU cost of the KV cache manager: decode allocate_slots, admission, free, hashing, per step.

Run: python -m pagedattn.benchmarks.bench_allocator --seed 0
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from pagedattn.core.kv_cache_utils import hash_request_tokens
from pagedattn.core.request import Request

BLOCK_SIZE = 16
NUM_BLOCKS = 16_384
VOCAB = 32_000
SYSTEM_PROMPT_LEN = 128
# "cpu" (this thread's CPU time) ignores time the OS gives to other processes on a busy machine.
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
CLOCK = "wall"
# vLLM 0.33.0 numbers quoted in the issue (us per call, p50): (low, high).
REFERENCE = {
    "decode allocate_slots": (3.4, 3.7),
    "admission": (7.0, 25.0),
    "free": (12.0, 22.0),
    "hash 2048 tokens": (131.0, 173.0),
    "manager work / step (256 running)": (300.0, 300.0),
}


@dataclass
class Timings:
    """Per-call samples in microseconds, by metric."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, us: float) -> None:
        self.samples.setdefault(name, []).append(us)

    def p50(self, name: str) -> float:
        values = self.samples.get(name)
        return statistics.median(values) if values else math.nan


def lognormal_len(rng: random.Random, mean: float, sigma: float, limit: int) -> int:
    mu = math.log(mean) - sigma**2 / 2
    return max(1, min(limit, round(rng.lognormvariate(mu, sigma))))


def fmt_range(low: float, high: float) -> str:
    if math.isnan(low):
        return "-"
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def make_manager(enable_caching: bool) -> KVCacheManager:
    group = KVCacheGroupSpec(("layers",), FullAttentionSpec(BLOCK_SIZE))
    return KVCacheManager([group], NUM_BLOCKS, enable_caching=enable_caching)


def make_workload(rng: random.Random, num_requests: int, shared: bool) -> list[tuple[list, int]]:
    """(prompt token ids, output length) per request; half share a system prompt if `shared`."""
    systems = [[rng.randrange(VOCAB) for _ in range(SYSTEM_PROMPT_LEN)] for _ in range(8)]
    workload = []
    for i in range(num_requests):
        prompt_len = lognormal_len(rng, 160, 0.8, 2048)
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        if shared and i % 2 == 0:
            system = systems[rng.randrange(8)]
            prompt[: len(system)] = system[:prompt_len]
        workload.append((prompt, lognormal_len(rng, 340, 0.8, 2048)))
    return workload


def simulate(
    workload: list[tuple[list, int]], enable_caching: bool, max_running: int, timings: Timings
) -> None:
    """Continuous batching without a model: admit, decode one token per step, free when done."""
    manager = make_manager(enable_caching)
    block_size = BLOCK_SIZE if enable_caching else None
    rng = random.Random(0)
    waiting = list(reversed(workload))
    running: list[tuple[Request, int]] = []
    num_ids = 0
    clock = CLOCKS[CLOCK]
    while waiting or running:
        step_ns = 0
        full_step = len(running) == max_running
        # Decode: the sampled token of the previous step is appended, then gets a slot.
        tokens = [rng.randrange(VOCAB) for _ in running]
        t0 = clock()
        for (req, _), token in zip(running, tokens, strict=True):
            req.append_output_token_ids(token)
        t1 = clock()
        for req, _ in running:
            manager.allocate_slots(req, 1)
            req.num_computed_tokens += 1
        t2 = clock()
        step_ns += t2 - t1
        if running:
            timings.add("decode allocate_slots", (t2 - t1) / 1e3 / len(running))
        still = []
        for req, num_output in running:
            if req.num_output_tokens >= num_output:
                t = clock()
                manager.free(req)
                dt = clock() - t
                step_ns += dt
                timings.add("free", dt / 1e3)
            else:
                still.append((req, num_output))
        running = still
        while waiting and len(running) < max_running:
            prompt, num_output = waiting[-1]
            num_ids += 1
            req = Request(str(num_ids), prompt, block_size=block_size)
            t = clock()
            hit_blocks, num_hit = manager.get_computed_blocks(req)
            new = manager.allocate_slots(req, req.num_tokens - num_hit, hit_blocks, num_hit)
            dt = clock() - t
            if new is None:
                break
            waiting.pop()
            step_ns += dt
            timings.add("admission", dt / 1e3)
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(rng.randrange(VOCAB))  # the prefill's sampled token
            running.append((req, num_output))
        if full_step:
            timings.add("manager work / step (256 running)", step_ns / 1e3)
            timings.add("manager + token append / step", (step_ns + t1 - t0) / 1e3)


def bench_long_prompt(rng: random.Random, repeats: int, timings: Timings) -> None:
    """Hashing a 2,048-token prompt, and admitting it with a 50% prefix hit."""
    manager = make_manager(True)
    prefix = [rng.randrange(VOCAB) for _ in range(1024)]
    warm = Request("warm", prefix + [1], block_size=BLOCK_SIZE)
    manager.allocate_slots(warm, warm.num_tokens)
    manager.free(warm)
    clock = CLOCKS[CLOCK]
    for i in range(repeats):
        tokens = prefix + [rng.randrange(VOCAB) for _ in range(1024)]
        t = clock()
        hash_request_tokens(BLOCK_SIZE, tokens, "pagedattn")
        timings.add("hash 2048 tokens", (clock() - t) / 1e3)
        req = Request(f"long{i}", tokens, block_size=BLOCK_SIZE)
        t = clock()
        hit_blocks, num_hit = manager.get_computed_blocks(req)
        manager.allocate_slots(req, req.num_tokens - num_hit, hit_blocks, num_hit)
        timings.add("admission 2048 tokens, 50% hit", (clock() - t) / 1e3)
        assert num_hit == 1024
        manager.free(req)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    global CLOCK
    CLOCK = args.clock
    rng = random.Random(args.seed)
    simulate(make_workload(rng, 200, True), True, args.max_running, Timings())  # warm-up
    bench_long_prompt(rng, 20, Timings())
    scenarios = {"caching off": (False, False), "caching on": (True, False)}
    scenarios["on, 8 shared system prompts"] = (True, True)
    results: dict[str, Timings] = {}
    for name, (caching, shared) in scenarios.items():
        workload = make_workload(random.Random(args.seed), args.num_requests, shared)
        results[name] = timings = Timings()
        simulate(workload, caching, args.max_running, timings)
        for metric in timings.samples:
            print(f"{name:30s} {metric:40s} p50 {timings.p50(metric):9.2f} us")
    long = Timings()
    bench_long_prompt(rng, 200, long)
    for metric in long.samples:
        print(f"{'2048-token prompt':30s} {metric:40s} p50 {long.p50(metric):9.2f} us")
    print()
    print("| p50 us per call | " + " | ".join(results) + " | vLLM 0.33.0 (issue) | target |")
    print("|---" * (len(results) + 3) + "|")
    metrics = list(REFERENCE) + ["manager + token append / step"]
    metrics += ["admission 2048 tokens, 50% hit"]
    for metric in metrics:
        values = [t.p50(metric) for t in results.values()]
        if metric in long.samples:
            values = [long.p50(metric)] * len(results)
        low, high = REFERENCE.get(metric, (math.nan, math.nan))
        ref, target = fmt_range(low, high), fmt_range(low / 2, high / 2)
        cells = " | ".join(f"{v:.2f}" for v in values)
        print(f"| {metric} | {cells} | {ref} | {target} |")


if __name__ == "__main__":
    main()
