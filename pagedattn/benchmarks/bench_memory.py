"""Trace-driven KV memory simulation: paging vs contiguous baselines, block sizes, sharing.

Usage: python -m pagedattn.benchmarks.bench_memory [--workload sharegpt alpaca | --trace t.jsonl]
       [--model-config opt-13b --memory 12GiB] [--out bench_out/memory]
The metrics are defined in pagedattn/sim/metrics.py (time averages over simulated steps).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from pagedattn.config import parse_size
from pagedattn.sim import report
from pagedattn.sim.compare import MemorySetup, compare_policies, film_pool, sweep_block_sizes
from pagedattn.sim.kv_dtypes import KV_DTYPE_BYTES, compare_kv_dtypes, kv_dtype_table
from pagedattn.sim.model_configs import load_geometry
from pagedattn.sim.sharing import (
    simulate_beam_search,
    simulate_parallel_sampling,
    simulate_system_prompt,
)
from pagedattn.sim.stepper import SimSchedulerConfig
from pagedattn.sim.traces import WORKLOADS, generate_trace, load_jsonl, save_jsonl

# bench_attention.py may expose this: block sizes -> microseconds per decode call.
KERNEL_TIME_FN = "kernel_time_by_block_size"
DEFAULT_NUM_REQUESTS = {"sharegpt": 400, "alpaca": 2000}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedattn bench memory", description=__doc__.split("\n")[0])
    p.add_argument(
        "--workload", nargs="+", default=["sharegpt", "alpaca"], choices=sorted(WORKLOADS)
    )
    p.add_argument(
        "--trace", help="JSONL trace (prompt_len, output_len[, arrival_time, max_tokens])"
    )
    p.add_argument("--save-trace", help="write the generated traces here (one JSONL per workload)")
    p.add_argument(
        "--num-requests",
        type=int,
        help="per workload (default: sharegpt 400, alpaca 2000: enough to fill memory)",
    )
    p.add_argument(
        "--arrival-rate", type=float, default=math.inf, help="requests/step (inf: all at 0)"
    )
    p.add_argument("--model-config", default="opt-13b", help="known name or config.json path")
    p.add_argument("--memory", default="12GiB", help="KV cache memory, e.g. 8GiB")
    p.add_argument("--max-seq-len", type=int, help="default: the model's context (opt-13b: 2048)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-sizes", default="1,2,4,8,16,32,64,128")
    p.add_argument("--page-size", default="2MiB", help="vAttention physical page size")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    # NOTE: high, so that memory (not the batch limit) bounds concurrency.
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--sharing-requests", type=int, default=40)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--no-sharing", action="store_true")
    p.add_argument("--no-gif", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=sorted(KV_DTYPE_BYTES),
        help="also run the paged policy with --memory in each KV dtype (e.g. bfloat16 fp8)",
    )
    p.add_argument(
        "--out",
        default="bench_out/memory",
        help="plots and results.json go here, under the current directory unless absolute "
        "(default: %(default)s)",
    )
    return p.parse_args(argv)


def kernel_times(block_sizes: list[int], seed: int) -> dict[int, float] | None:
    """Attention kernel time per block size from bench_attention.py, if it has one."""
    try:
        bench = importlib.import_module("pagedattn.benchmarks.bench_attention")
    except ImportError:
        bench = None
    fn = getattr(bench, KERNEL_TIME_FN, None)
    if fn is None:
        print(
            f"note: bench_attention.py has no {KERNEL_TIME_FN}(block_sizes, seed=...);"
            " the kernel time column is left out"
        )
        return None
    return fn(block_sizes, seed=seed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    geometry = load_geometry(args.model_config)
    setup = MemorySetup(
        geometry=geometry,
        memory_bytes=parse_size(args.memory),
        max_seq_len=args.max_seq_len or geometry.max_seq_len,
        scheduler=SimSchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs),
        page_bytes=parse_size(args.page_size),
    )
    print(
        f"# KV memory simulation: {geometry.name}, {args.memory} of KV cache = "
        f"{setup.capacity_slots} token slots ({geometry.bytes_per_token} B/token), "
        f"max_seq_len {setup.max_seq_len}, B={args.block_size}, seed {args.seed}\n"
    )
    if args.trace:
        traces = {Path(args.trace).stem: load_jsonl(args.trace)}
    else:
        traces = {
            w: generate_trace(
                w,
                args.num_requests or DEFAULT_NUM_REQUESTS[w],
                max_seq_len=setup.max_seq_len,
                arrival_rate=args.arrival_rate,
                seed=args.seed,
            )
            for w in args.workload
        }
    summary: dict[str, dict] = {}
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    kernel_us = None if args.no_sweep else kernel_times(block_sizes, args.seed)
    for name, trace in traces.items():
        too_long = [r.request_id for r in trace if r.prompt_len + r.max_tokens > setup.max_seq_len]
        if too_long:
            raise SystemExit(
                f"{len(too_long)} requests of {name} (first: {too_long[0]}) need prompt_len + "
                f"max_tokens > max_seq_len={setup.max_seq_len}: raise --max-seq-len"
            )
        if args.save_trace:
            save_jsonl(trace, Path(args.save_trace).with_suffix(f".{name}.jsonl"))
        if args.kv_cache_dtype:
            rows = compare_kv_dtypes(trace, setup, args.block_size, args.kv_cache_dtype)
            print(kv_dtype_table(name, rows) + "\n")
            summary.setdefault("kv_cache_dtype", {})[name] = rows
        results = compare_policies(trace, setup, args.block_size)
        for r in results:
            print(
                f"[{name}] {r.policy}: utilisation {100 * r.utilization:.1f}%, mean concurrent "
                f"{r.mean_concurrent:.1f}, {r.tokens_per_step:.1f} tokens/step"
            )
        print(f"\n## {name}: {len(trace)} requests\n")
        print(report.policy_table(results, baseline=results[0]) + "\n")
        title = f"{name}-like trace, {geometry.name}, {args.memory} KV"
        report.plot_breakdown(results, title, out / f"utilisation_{name}.png")
        report.plot_concurrency(results, title, out / f"concurrency_{name}.png")
        summary[name] = {"policies": [asdict(r) for r in results]}
        if not args.no_sweep:
            sweep = sweep_block_sizes(trace, setup, block_sizes)
            _print_sweep(name, block_sizes, sweep, kernel_us, args.block_size)
            report.plot_block_sweep(block_sizes, sweep, kernel_us, out / f"block_sizes_{name}.png")
            summary[name]["block_sizes"] = {
                b: asdict(r) for b, r in zip(block_sizes, sweep, strict=True)
            }
    if not args.no_sharing:
        summary["sharing"] = _run_sharing(traces, setup, args, out)
    if not args.no_gif:
        # NOTE: short requests fill a small pool with many block tables; prefer Alpaca-like.
        trace = traces.get("alpaca") or next(iter(traces.values()))
        gif = film_pool(trace[:32], out, block_size=args.block_size, max_seq_len=setup.max_seq_len)
        print(f"pool animation: {gif}")
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"plots and results.json in {out}/")
    return 0


def _print_sweep(
    name: str, block_sizes: list[int], sweep: list, kernel_us: dict | None, block_size: int
) -> None:
    headers = ["B", "utilisation", "waste", "mean conc", "max conc", "preemptions", "tokens/step"]
    if kernel_us:
        headers.append("kernel us")
    rows = []
    for b, r in zip(block_sizes, sweep, strict=True):
        row = [
            b,
            f"{100 * r.utilization:.1f}%",
            f"{100 * (1 - r.utilization):.1f}%",
            f"{r.mean_concurrent:.1f}",
            r.max_concurrent,
            r.num_preemptions,
            f"{r.tokens_per_step:.1f}",
        ]
        if kernel_us:
            row.append(f"{kernel_us.get(b, float('nan')):.1f}")
        rows.append(row)
    print(f"### {name}: block size sweep (capacity planning: concurrent requests that fit)\n")
    print(report.markdown_table(headers, rows) + "\n")
    if block_size in block_sizes:
        r = sweep[block_sizes.index(block_size)]
        print(
            f"capacity at B={block_size}: {r.mean_concurrent:.1f} concurrent {name} requests "
            f"on average while requests wait (max {r.max_concurrent})\n"
        )


def _run_sharing(traces: dict, setup: MemorySetup, args: argparse.Namespace, out: Path) -> dict:
    series: dict[str, list] = {}
    rows = []
    for name, trace in traces.items():
        subset = trace[: args.sharing_requests]
        for mode, fn in (("parallel", simulate_parallel_sampling), ("beam", simulate_beam_search)):
            series[f"{name} {mode}"] = [
                fn(subset, w, args.block_size, args.seed) for w in range(2, 7)
            ]
            rows += [
                [name, mode, s.width, f"{100 * s.saving:.1f}%", s.num_block_copies, "-"]
                for s in series[f"{name} {mode}"]
            ]
        sp = simulate_system_prompt(
            trace,
            args.system_prompt_len,
            block_size=args.block_size,
            capacity_slots=setup.capacity_slots,
            config=setup.scheduler,
            max_seq_len=setup.max_seq_len,
            seed=args.seed,
        )
        rows.append(
            [
                name,
                f"system prompt {sp.width} tokens",
                "-",
                f"{100 * sp.saving:.1f}%",
                "-",
                f"{100 * sp.prefix_hit_rate:.1f}%",
            ]
        )
        series.setdefault("_system_prompt", []).append(sp)
    print("## sharing: KV memory saved vs private copies (fork + copy-on-write)\n")
    print(
        report.markdown_table(
            ["workload", "mode", "n / width", "memory saved", "CoW copies", "prefix hit rate"], rows
        )
        + "\n"
    )
    plotted = {k: v for k, v in series.items() if not k.startswith("_")}
    report.plot_sharing(plotted, out / "sharing.png")
    return {k: [asdict(s) for s in v] for k, v in series.items()}


if __name__ == "__main__":
    sys.exit(main())
