"""Replicas benchmark: a multi-tenant trace against Ray Serve replicas, per router, in one run.

    pagedattn bench replicas --seed 0 [--replicas 2] [--routers prefix,round_robin,pow2]
                             [--single-replica] [--num-requests 160] [--rate 1.5]

Each tenant has its own API key (so its own cache salt) and its own long system prompt; a request
is that prompt plus a short user turn, sent by Poisson arrivals through `/v1/completions` with
streaming. Every configuration (N replicas with each router, and 1 replica with
`--single-replica`) is deployed on one local Ray instance, in turn, on the same cores, and gets
the same requests. Per configuration: prefix-cache hit rate (cached / prompt tokens, from the
usage the server reports), TTFT p50/p99, TPOT p50, output tokens/s and the longest run; then,
once the replicas are idle, the lost requests, the blocks each idle replica still holds (leaked)
and whether the router's event index equals each replica's cache (exit status 1 if not).
The KV cache of each replica is sized (--num-blocks) to hold about half the tenants' prompts
(640 blocks: 9.6 of 16 prompts of 67 blocks), so routing decides whether a replica keeps its
tenants cached or thrashes. With equal tenant popularity the prefix router's hit rate is at most
min(2, tenants / prompts a pool holds) times round robin's (docs/replicas.md).
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

from pagedattn.serve.router import DEFAULT_IMBALANCE_RATIO, DEFAULT_IMBALANCE_THRESHOLD


@dataclass
class TraceRequest:
    """One request: its tenant, prompt token ids and send time (seconds from the start)."""

    tenant: int
    prompt: list[int]
    arrival: float


@dataclass
class Result:
    """Client-side timings and the server's token counts of one request."""

    ok: bool
    ttft: float = 0.0
    end: float = 0.0
    num_output: int = 0
    num_prompt: int = 0
    num_cached: int = 0
    error: str = ""


def make_trace(
    seed: int,
    num_tenants: int,
    system_len: int,
    num_requests: int,
    rate: float,
    vocab: int,
) -> list[TraceRequest]:
    """Tenants' system prompts, then requests: uniform tenant, short user turn, Poisson times."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, vocab) for _ in range(system_len)] for _ in range(num_tenants)]
    t = 0.0
    out = []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        tenant = rng.randrange(num_tenants)
        user = [rng.randrange(100, vocab) for _ in range(rng.randint(16, 48))]
        out.append(TraceRequest(tenant, systems[tenant] + user, t))
    return out


async def _one(client, base, model, key, req, max_tokens, t0, timeout) -> Result:
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    body = {"model": model, "prompt": req.prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    res = Result(ok=False)
    try:
        headers = {"Authorization": f"Bearer {key}"}
        async with client.stream(
            "POST", f"{base}/v1/completions", json=body, headers=headers, timeout=timeout
        ) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                if chunk.get("choices") and not res.ttft:
                    res.ttft = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage:
                    res.num_output = usage["completion_tokens"]
                    res.num_prompt = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    res.num_cached = details.get("cached_tokens") or 0
        res.end = time.perf_counter() - start
        res.ok = res.num_output > 0
        return res
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res


async def run_trace(base, model, keys, trace, max_tokens, timeout) -> tuple[list[Result], float]:
    """Send the trace; results in trace order and the makespan (first send to last answer)."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(_one(client, base, model, keys[r.tenant], r, max_tokens, t0, timeout) for r in trace)
        )
        return list(results), time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(name: str, results: list[Result], makespan: float, max_tokens: int) -> dict:
    """One row: hit rate, TTFT p50/p99, TPOT p50, throughput, failures."""
    ok = [r for r in results if r.ok]
    tpots = [(r.end - r.ttft) / (r.num_output - 1) for r in ok if r.num_output > 1]
    prompt = sum(r.num_prompt for r in ok)
    return {
        "config": name,
        "num_ok": len(ok),
        "num_failed": len(results) - len(ok),
        "hit_rate": sum(r.num_cached for r in ok) / prompt if prompt else 0.0,
        "ttft_p50_s": _pct([r.ttft for r in ok], 0.5),
        "ttft_p99_s": _pct([r.ttft for r in ok], 0.99),
        "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else float("nan"),
        "output_tok_s": sum(r.num_output for r in ok) / makespan,
        "makespan_s": makespan,
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def print_table(rows: list[dict]) -> None:
    cols = ["config", "num_ok", "num_failed", "hit_rate", "ttft_p50_s", "ttft_p99_s",
            "tpot_p50_ms", "output_tok_s", "makespan_s"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print("| " + " | ".join(cells) + " |")


def check_replicas(base: str, key: str, num_replicas: int, timeout_s: float = 120.0) -> dict:
    """After a trace: wait until every replica is idle, then count leaked blocks.

    A replica leaks when, idle, it holds blocks (num_free_blocks < num_usable_blocks). Also
    reports whether the router's event index equals each replica's cached-block set.
    """
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + timeout_s
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = httpx.get(f"{base}/debug/replicas", headers=headers, timeout=10.0).json()
        idle = len(stats) == num_replicas and all(s["num_requests"] == 0 for s in stats.values())
        if idle and all(s.get("index_digest") == s["cached_digest"] for s in stats.values()):
            break
        time.sleep(0.5)
    router = httpx.get(f"{base}/debug/router", headers=headers, timeout=10.0).json()
    counters = {}
    for r in router["routers"]:
        for name, value in r.items():
            if isinstance(value, int):
                counters[name] = counters.get(name, 0) + value
    return {
        "num_replicas_seen": len(stats),
        "num_busy_replicas": sum(s["num_requests"] > 0 for s in stats.values()),
        "leaked_blocks": {
            uid[-6:]: s["num_usable_blocks"] - s["num_free_blocks"] for uid, s in stats.items()
        },
        "index_equals_cache": all(
            s.get("index_digest") == s["cached_digest"] for s in stats.values()
        ),
        "routed": {uid[-6:]: s.get("num_routed", 0) for uid, s in stats.items()},
        "router": counters,
    }


def _deploy(args, num_replicas: int, router: str, port: int):
    from ray import serve

    from pagedattn.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pagedattn.entrypoints.serve_config import ServeConfig
    from pagedattn.serve.serve_app import APP_NAME, build_app

    threads = (
        max(1, (os.cpu_count() or 1) // num_replicas) if args.threads is None else args.threads
    )
    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, seed=args.seed),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
        num_threads=threads,
    )
    keys = [f"tenant-{i}" for i in range(args.num_tenants)]
    serve_config = ServeConfig(
        data_parallel_size=num_replicas,
        router=router,
        api_key=keys,
        kv_transfer_host="127.0.0.1",
        router_imbalance_threshold=args.imbalance_threshold,
        replica_cpus=0.5,
    )
    app = build_app(
        config,
        serve_config,
        imbalance_ratio=args.imbalance_ratio,
        routing_stats_period_s=1.0,
        seed=args.seed,
    )
    serve.run(app, name=APP_NAME, route_prefix="/")
    return keys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--layouts" or a.startswith("--layouts=") for a in argv):
        from pagedattn.benchmarks.bench_pd import main as bench_pd  # co-located vs PD

        return bench_pd(argv)
    parser = argparse.ArgumentParser(
        prog="pagedattn bench replicas",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--routers", default="prefix,round_robin,pow2")
    parser.add_argument(
        "--single-replica",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run 1 replica (router irrelevant) on the same cores",
    )
    parser.add_argument("--num-tenants", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=1024, help="system prompt tokens")
    parser.add_argument("--num-requests", type=int, default=160)
    parser.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals, req/s")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=640, help="KV blocks per replica")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--imbalance-threshold", type=int, default=DEFAULT_IMBALANCE_THRESHOLD)
    parser.add_argument("--imbalance-ratio", type=float, default=DEFAULT_IMBALANCE_RATIO)
    parser.add_argument("--threads", type=int, default=None, help="default: cores / replicas")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out", default="bench_out/replicas.json")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from pagedattn.serve.serve_app import APP_NAME

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    configs = [(args.replicas, r) for r in args.routers.split(",") if r]
    if args.single_replica:
        configs.append((1, "round_robin"))
    trace = make_trace(
        args.seed, args.num_tenants, args.system_len, args.num_requests, args.rate, vocab=30000
    )
    num_cpus = max(os.cpu_count() or 1, args.replicas)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    rows = []
    all_ok = True
    try:
        port = 8765
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        for num_replicas, router in configs:
            name = f"{num_replicas}x {router}" if num_replicas > 1 else "1 replica"
            keys = _deploy(args, num_replicas, router, port)
            model = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {keys[0]}"})
            model_id = model.json()["data"][0]["id"]
            # Warm-up (not measured): one short request per replica's worth.
            warm = [TraceRequest(0, list(range(100, 164)), 0.0)] * num_replicas
            asyncio.run(run_trace(base, model_id, keys, warm, 2, args.timeout))
            results, makespan = asyncio.run(
                run_trace(base, model_id, keys, trace, args.max_tokens, args.timeout)
            )
            row = summarize(name, results, makespan, args.max_tokens)
            check = check_replicas(base, keys[0], num_replicas)
            row["check"] = check
            rows.append(row)
            print(json.dumps(row), flush=True)
            num_leaked = sum(check["leaked_blocks"].values())
            ok = (
                row["num_failed"] == 0
                and num_leaked == 0
                and check["num_replicas_seen"] == num_replicas
                and check["num_busy_replicas"] == 0
                and check["index_equals_cache"]
            )
            print(
                f"{name}: {row['num_failed']} lost requests, {num_leaked} leaked blocks "
                f"(per replica {check['leaked_blocks']}), router index equals the replicas' "
                f"caches: {check['index_equals_cache']}, router {check['router']}"
                + ("" if ok else "  <-- CHECK FAILED"),
                flush=True,
            )
            all_ok = all_ok and ok
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print("every configuration: 0 lost requests, 0 leaked blocks" if all_ok else "CHECK FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
