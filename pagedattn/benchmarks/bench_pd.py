"""PD benchmark: 2 co-located replicas against 1 prefill + 1 decode replica, mixed traffic.

    pagedattn bench pd --layouts colocated,pd [--duration 90] [--num-short 4] [--short-len 64]
                       [--short-tokens 32] [--long-len 4096] [--long-interval 20] [--long-tokens 8]
                       [--pd-min-prompt-tokens 0] [--long-prefill-token-threshold 64]
    (also: pagedattn bench replicas --layouts colocated,pd ...)

Both layouts run on one local Ray instance, in turn, on the same cores (one torch thread per
replica, each replica bound to a core of its own: --cpu-bind auto), in serve's default dtype
(auto: bf16 on bf16 hardware). Traffic: --num-short closed-loop clients stream short
chat-sized completions back to back, and a long prompt (--long-len tokens) arrives every
--long-interval seconds. Greedy (temperature 0, ignore_eos), so outputs are comparable across
layouts. Prints per layout: ITL p50/p99 of the short streams, TTFT p50/p99 of both classes,
output tokens/s, lost requests, leaked blocks (idle replicas that hold blocks), and for PD the
bytes and seconds per transfer and the decode replica's step times; then ratios and how many
requests of both layouts gave identical text. Results are written into --out after each
layout, so layouts may also run in separate invocations. --trace-hops also prints, for the
later ITLs, their p50/p99 at the engine, the replica's event loop, the ingress and the client,
and each hop's delay (where the client's tail grows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import httpx

KEY = "bench-key"
APP = "pagedattn"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _stream(client, base, model, prompt, max_tokens, timeout) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    start = time.perf_counter()
    times, text, error = [], [], ""
    # --trace-hops: per token, the monotonic times its event left each hop (': hop' lines).
    hops, pending = [], {}
    try:
        async with client.stream(
            "POST", f"{base}/v1/completions", json=body,
            headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout,
        ) as r:  # fmt: skip
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if line.startswith(": hop "):
                    pending.update(kv.split("=") for kv in line[6:].split())
                    continue
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"].get("message", ""))[:160]
                    break
                piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
                if piece:
                    times.append(time.perf_counter() - start)
                    text.append(piece)
                    if pending:
                        stamps = {k: float(v) for k, v in pending.items()}
                        hops.append({"c": time.monotonic(), **stamps})
                pending = {}
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    ok = not error and bool(times)
    return {"ok": ok, "error": error, "times": times, "text": "".join(text),
            "start": start, "end": time.perf_counter(), "hops": hops}  # fmt: skip


async def run_traffic(base: str, model: str, args) -> tuple[dict, dict, float]:
    """Short closed-loop streams and periodic long prompts for --duration seconds."""
    rng = random.Random(args.seed)
    long_prompts = [[rng.randrange(100, 30000) for _ in range(args.long_len)] for _ in range(64)]
    shorts: dict[str, dict] = {}
    longs: dict[str, dict] = {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        stop_at = t0 + args.duration

        async def user(u: int) -> None:
            urng = random.Random(args.seed * 1000 + u)
            i = 0
            while time.perf_counter() < stop_at:
                prompt = [urng.randrange(100, 30000) for _ in range(args.short_len)]
                shorts[f"s{u}-{i}"] = await _stream(
                    client, base, model, prompt, args.short_tokens, args.timeout
                )
                i += 1

        async def long_sender() -> None:
            tasks, j = [], 0
            while True:
                at = t0 + args.long_start + j * args.long_interval
                if at >= stop_at:
                    break
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                key = f"l{j}"
                prompt = long_prompts[j % len(long_prompts)]
                coro = _stream(client, base, model, prompt, args.long_tokens, args.timeout)
                tasks.append((key, asyncio.ensure_future(coro)))
                j += 1
            for key, task in tasks:
                longs[key] = await task

        await asyncio.gather(long_sender(), *(user(u) for u in range(args.num_short)))
        ends = [r["end"] for r in [*shorts.values(), *longs.values()] if r.get("end")]
        makespan = max(ends) - t0 if ends else float("nan")
    return shorts, longs, makespan


def summarize(layout: str, shorts: dict, longs: dict, makespan: float) -> dict:
    def ok(rs):
        return [r for r in rs.values() if r["ok"]]

    itls = [b - a for r in ok(shorts) for a, b in zip(r["times"], r["times"][1:], strict=False)]
    # The first ITL of a stream: in PD, the handoff from the prefill replica to the decode one.
    gaps = [r["times"][1] - r["times"][0] for r in ok(shorts) if len(r["times"]) > 1]
    rest = [b - a for r in ok(shorts) for a, b in zip(r["times"][1:], r["times"][2:], strict=False)]
    num_out = sum(len(r["times"]) for r in [*ok(shorts), *ok(longs)])
    return {
        "layout": layout,
        "num_short": len(ok(shorts)),
        "num_long": len(ok(longs)),
        "num_failed": len(shorts) + len(longs) - len(ok(shorts)) - len(ok(longs)),
        "itl_p50_ms": 1000 * _pct(itls, 0.5),
        "itl_p99_ms": 1000 * _pct(itls, 0.99),
        "itl_max_ms": 1000 * max(itls, default=float("nan")),
        "first_itl_p50_ms": 1000 * _pct(gaps, 0.5),
        "first_itl_p99_ms": 1000 * _pct(gaps, 0.99),
        "later_itl_p99_ms": 1000 * _pct(rest, 0.99),
        "short_ttft_p50_s": _pct([r["times"][0] for r in ok(shorts)], 0.5),
        "short_ttft_p99_s": _pct([r["times"][0] for r in ok(shorts)], 0.99),
        "long_ttft_p50_s": _pct([r["times"][0] for r in ok(longs)], 0.5),
        "long_ttft_p99_s": _pct([r["times"][0] for r in ok(longs)], 0.99),
        "output_tok_s": num_out / makespan,
        "makespan_s": makespan,
        "errors": sorted({r["error"] for r in [*shorts.values(), *longs.values()] if r["error"]})[
            :3
        ],
        "texts": {k: r["text"] for k, r in [*shorts.items(), *longs.items()] if r["ok"]},
        # Per request: its start (s, after the first start) and its token times (ms after it).
        "timelines": _timelines({**shorts, **longs}),
        "hops": hop_breakdown(shorts),
        # --trace-hops: per short stream, each token's hop times (HOPS order, monotonic s).
        "hop_stamps": {
            k: [[h.get(x) for x in HOPS] for h in r["hops"]]
            for k, r in shorts.items()
            if r.get("ok") and r.get("hops")
        },
    }


# Where a token's event was (time.monotonic()): made by the engine, read by the replica's event
# loop, forwarded by the ingress, received by the client.
HOPS = ("e", "r", "i", "c")


def hop_breakdown(shorts: dict) -> dict:
    """--trace-hops: the later ITLs of the short streams as seen at each hop, and each hop's
    delay (ms, p50 / p99), so the growth from the engine's ITL to the client's shows by hop."""
    itl: dict[str, list[float]] = {h: [] for h in HOPS}
    delay: dict[str, list[float]] = {f"{a}{b}": [] for a, b in zip(HOPS, HOPS[1:], strict=False)}
    for r in shorts.values():
        hops = r.get("hops") or []
        if not r.get("ok") or len(hops) != len(r["times"]):
            continue
        for prev, cur in zip(hops[1:], hops[2:], strict=False):
            if not all(h in prev and h in cur for h in HOPS):
                continue
            for h in HOPS:
                itl[h].append(cur[h] - prev[h])
            for a, b in zip(HOPS, HOPS[1:], strict=False):
                delay[f"{a}{b}"].append(cur[b] - cur[a])
    out = {"num_itls": len(itl["c"])}
    if not itl["c"]:
        return out  # NOTE: not traced (no NaN in the JSON)
    for name, values in [*(("itl_" + h, v) for h, v in itl.items()), *delay.items()]:
        out[name] = [round(1000 * _pct(values, q), 1) for q in (0.5, 0.99)]
    return out


def _timelines(results: dict) -> dict[str, list]:
    starts = [r["start"] for r in results.values() if "start" in r]
    t0 = min(starts, default=0.0)
    return {
        k: [round(r["start"] - t0, 4), [round(1000 * t, 1) for t in r["times"]]]
        for k, r in results.items()
        if r.get("ok")
    }


def _config(args, threshold: int = 0):
    from pagedattn.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, seed=args.seed),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            long_prefill_token_threshold=threshold,
        ),
        num_threads=1,
    )


def deploy(layout: str, args) -> None:
    from ray import serve

    from pagedattn.entrypoints.serve_config import ServeConfig
    from pagedattn.serve.pd_app import build_pd_app
    from pagedattn.serve.serve_app import build_app

    common = dict(api_key=[KEY], kv_transfer_host="127.0.0.1", replica_cpus=0.5)
    tuning = dict(seed=args.seed, cpu_bind=args.cpu_bind)
    if layout == "pd":
        serve_config = ServeConfig(
            prefill_replicas=1,
            decode_replicas=1,
            pd_min_prompt_tokens=args.pd_min_prompt_tokens,
            pd_decode_step_time=args.pd_decode_step_time,
            pd_prefill_nice=args.pd_prefill_nice,
            **common,
        )
        app = build_pd_app(
            _config(args, args.long_prefill_token_threshold),
            serve_config,
            ingress_on_prefill=args.pd_ingress_on_prefill,
            **tuning,
        )
    else:
        threshold = args.long_prefill_token_threshold if args.cap_colocated else 0
        serve_config = ServeConfig(data_parallel_size=2, router="prefix", **common)
        app = build_app(_config(args, threshold), serve_config, **tuning)
    serve.run(app, name=APP, route_prefix="/")


def _process_cpus(name: str) -> list[str]:
    """Cpus_allowed_list of the local processes whose command line names `name` (Ray sets a
    replica's to ray::ServeReplica:<app>:<deployment>)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and name in (proc / "cmdline").read_text():
                status = (proc / "status").read_text()
                out += [ln.split()[-1] for ln in status.splitlines() if "Cpus_allowed_list" in ln]
        except OSError:
            continue
    return out


def replica_check(layout: str, base: str, timeout_s: float = 120.0) -> dict:
    """Once idle: blocks each replica still holds (leaks), and for PD the transfers."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        if layout == "pd":
            usages = [
                serve.get_deployment_handle(name, app_name=APP).kv_usage.remote().result()
                for name in ("PrefillReplica", "DecodeReplica")
            ]
        else:
            stats = httpx.get(
                f"{base}/debug/replicas", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
            ).json()
            usages = list(stats.values())
        busy = any(u["num_requests"] for u in usages)
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out = {"leaked_blocks": sum(u["num_usable_blocks"] - u["num_free_blocks"] for u in usages)}
    if layout == "pd":
        steps = usages[1]["step_seconds"]
        transfers = [t for t in usages[1]["transfers"] if t["num_blocks"]]
        # The handoffs of the short prompts: pull, queued in the engine, first decoded token.
        short = [t for t in usages[1]["transfers"] if "first_decode_s" in t]
        short = [t for t in short if t["num_local_blocks"] + t["num_blocks"] <= 32]
        for key in ("pulled_s", "added_s", "first_decode_s"):
            name = key.removesuffix("_s")
            out[f"handoff_{name}_ms_p50"] = 1000 * _pct([t[key] for t in short], 0.5)
            out[f"handoff_{name}_ms_p99"] = 1000 * _pct([t[key] for t in short], 0.99)
        out.update(
            cpus=[u["cpus"] for u in usages],
            ingress_cpus=_process_cpus(f"{APP}:OpenAIIngress"),
            decode_step_ms_p50=1000 * _pct(steps, 0.5),
            decode_step_ms_p99=1000 * _pct(steps, 0.99),
            decode_step_ms_max=1000 * max(steps, default=float("nan")),
            # As the decode engine's loop delivered the tokens (but the handoffs).
            decode_itl_ms_p50=1000 * _pct(usages[1].get("itl_seconds", []), 0.5),
            decode_itl_ms_p99=1000 * _pct(usages[1].get("itl_seconds", []), 0.99),
            load_ms_mean=1000 * usages[1]["load_time_s"] / max(1, len(transfers)),
        )
        out.update(
            num_transfers=len(transfers),
            transfer_mb_mean=statistics.mean([t["num_bytes"] / 1e6 for t in transfers] or [0]),
            transfer_ms_mean=statistics.mean([1000 * t["seconds"] for t in transfers] or [0]),
            transfer_ms_max=max([1000 * t["seconds"] for t in transfers] or [0]),
            num_local=usages[1]["num_local"],
            num_prefill_retries=usages[1]["num_prefill_retries"],
        )
    return out


COLUMNS = ["layout", "num_short", "num_long", "num_failed", "itl_p50_ms", "itl_p99_ms",
           "itl_max_ms", "short_ttft_p50_s", "short_ttft_p99_s", "long_ttft_p50_s",
           "long_ttft_p99_s", "output_tok_s", "leaked_blocks"]  # fmt: skip


def print_report(rows: dict[str, dict]) -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows.values():
        cells = [row.get(c, row.get("check", {}).get(c)) for c in COLUMNS]
        print("| " + " | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells))
    for row in rows.values():
        gaps = [row.get(k, float("nan")) for k in ("first_itl_p50_ms", "first_itl_p99_ms")]
        print(
            f"{row['layout']}: first ITL (PD: the handoff) p50 {gaps[0]:.0f} ms, p99 "
            f"{gaps[1]:.0f} ms; later ITLs p99 {row.get('later_itl_p99_ms', float('nan')):.0f} ms"
        )
    pd = rows.get("pd")
    if pd and pd.get("check", {}).get("num_transfers"):
        c = pd["check"]
        print(
            f"pd transfers: {c['num_transfers']}, {c['transfer_mb_mean']:.1f} MB and "
            f"{c['transfer_ms_mean']:.0f} ms mean (max {c['transfer_ms_max']:.0f} ms); "
            f"{c['num_local']} requests computed wholly on decode, "
            f"{c['num_prefill_retries']} prefill retries; loading them into the decode cache "
            f"{c['load_ms_mean']:.0f} ms mean"
        )
        print(
            f"pd decode replica steps: p50 {c['decode_step_ms_p50']:.0f} ms, p99 "
            f"{c['decode_step_ms_p99']:.0f} ms, max {c['decode_step_ms_max']:.0f} ms; "
            f"CPUs (prefill, decode): {c['cpus']}, ingress {c['ingress_cpus']}; later ITLs as "
            "its engine delivered them: p50 "
            f"{c['decode_itl_ms_p50']:.0f} ms, p99 {c['decode_itl_ms_p99']:.0f} ms"
        )
        print(
            "pd handoffs of short prompts (p50 / p99 ms from the first token): pulled "
            f"{c['handoff_pulled_ms_p50']:.0f} / {c['handoff_pulled_ms_p99']:.0f}, in the engine "
            f"{c['handoff_added_ms_p50']:.0f} / {c['handoff_added_ms_p99']:.0f}, first decoded "
            f"{c['handoff_first_decode_ms_p50']:.0f} / {c['handoff_first_decode_ms_p99']:.0f}"
        )
    for row in rows.values():
        hops = row.get("hops") or {}
        if hops.get("num_itls"):
            print(
                f"{row['layout']} hops of {hops['num_itls']} later ITLs (p50 / p99 ms): ITL at the "
                f"engine {hops['itl_e']}, replica loop {hops['itl_r']}, ingress {hops['itl_i']}, "
                f"client {hops['itl_c']}; delay engine->loop {hops['er']}, loop->ingress "
                f"{hops['ri']}, ingress->client {hops['ic']}"
            )
    co = rows.get("colocated")
    if co and pd:
        print(
            f"ratios: ITL p99 colocated/pd = {co['itl_p99_ms'] / pd['itl_p99_ms']:.2f}x "
            f"(target >= 5x); throughput pd/colocated = "
            f"{pd['output_tok_s'] / co['output_tok_s']:.2f}x (target >= 0.8x)"
        )
        same = [k for k in pd["texts"] if k in co["texts"]]
        equal = sum(pd["texts"][k] == co["texts"][k] for k in same)
        print(f"greedy identity: {equal}/{len(same)} requests served by both gave the same text")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pagedattn bench pd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layouts", default="colocated,pd")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--dtype", default="auto", help="auto: what serve runs (bf16 on bf16 hardware)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=90.0, help="seconds of traffic")
    p.add_argument("--num-short", type=int, default=4, help="closed-loop short streams")
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument("--long-len", type=int, default=4096)
    p.add_argument("--long-tokens", type=int, default=8)
    p.add_argument("--long-start", type=float, default=5.0)
    p.add_argument("--long-interval", type=float, default=20.0)
    p.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=0,
        help="serve's option; 0 (every prompt to the prefill replica) with the prefill cap below "
        "measured the lowest ITL p99 at >= 0.8x throughput (serve's default is 256)",
    )
    p.add_argument(
        "--cap-colocated",
        action="store_true",
        help="give the co-located layout's replicas --long-prefill-token-threshold too",
    )
    p.add_argument(
        "--pd-prefill-nice",
        type=int,
        default=5,
        help="nice value of the prefill replica's threads (serve's --pd-prefill-nice)",
    )
    p.add_argument(
        "--pd-ingress-on-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the PD layout's ingress on the prefill replica's core (build_pd_app's default)",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=64,
        help="the engine option of the PD layout's replicas, so short prompts are prefilled "
        "beside a long one (the co-located layout runs the engine's default, 0: no cap)",
    )
    p.add_argument(
        "--pd-decode-step-time",
        type=float,
        default=None,
        help="target step seconds of the decode replica (serve's --pd-decode-step-time)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=640, help="KV blocks per replica")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument(
        "--cpu-bind",
        default="auto",
        help="replica CPU sets (PAGEDATTN_CPU_BIND): auto (one core per replica), off, or 0|1",
    )
    p.add_argument(
        "--driver-cpus",
        default=None,
        help="CPU list (e.g. 0) for this process and the Ray processes it starts (proxy, ingress, "
        "controller, the clients): by default they float over every core; give replicas "
        "explicit --cpu-bind lists with it (e.g. --driver-cpus 0 --cpu-bind '0|1')",
    )
    p.add_argument(
        "--trace-hops",
        action="store_true",
        help="stamp each streamed token at the engine, the replica's event loop and the ingress "
        "(PAGEDATTN_TRACE_HOPS) and print where the later ITLs grow",
    )
    p.add_argument(
        "--ray-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for Ray's workers only (replicas, ingress, proxy), e.g. "
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0; repeatable",
    )
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default="bench_out/pd.json")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out = Path(args.out)
    rows: dict[str, dict] = json.loads(out.read_text())["rows"] if out.exists() else {}
    print(f"load before: {open('/proc/loadavg').read().strip()}", flush=True)
    if args.trace_hops:
        # NOTE: before ray.init, so Ray's workers inherit it.
        os.environ.update(PAGEDATTN_TRACE_HOPS="1")
    if args.driver_cpus is not None:
        from pagedattn.distributed.cpu_bind import parse_cpu_list

        # NOTE: before ray.init: Ray's processes inherit the set (the replicas bind their own).
        os.sched_setaffinity(0, parse_cpu_list(args.driver_cpus))
    worker_env = dict(kv.split("=", 1) for kv in args.ray_env)
    ray.init(
        num_cpus=max(2, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": worker_env} if worker_env else None,
    )
    try:
        port = 8766
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        for layout in [x for x in args.layouts.split(",") if x]:
            if layout not in ("colocated", "pd"):
                raise SystemExit(f"--layouts: {layout!r} is unknown: use colocated and/or pd")
            deploy(layout, args)
            models = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            model = models.json()["data"][0]["id"]
            warm = argparse.Namespace(**{**vars(args), "duration": 3.0, "long_start": 1e9})
            asyncio.run(run_traffic(base, model, warm))
            shorts, longs, makespan = asyncio.run(run_traffic(base, model, args))
            row = summarize(layout, shorts, longs, makespan)
            row["check"] = replica_check(layout, base)
            row["load"] = open("/proc/loadavg").read().strip()
            row["cpu_bind"] = args.cpu_bind
            rows[layout] = row
            brief = {k: v for k, v in row.items() if k not in ("texts", "timelines", "hop_stamps")}
            print(json.dumps(brief), flush=True)
            # NOTE: written per layout, so a later layout that fails keeps this one's row.
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
            serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
    print_report(rows)
    failed = any(r["num_failed"] or r["check"]["leaked_blocks"] for r in rows.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
