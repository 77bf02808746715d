"""Numbers and tables of the throughput benchmark: per-result summaries, ceilings, markdown."""

from __future__ import annotations

import statistics

from pagedattn.benchmarks.workloads import Workload

STEP_PARTS = ("schedule", "prepare", "forward", "sample", "process")
# Column order of one step record from peers.run_pagedattn.
_WALL, _NUM_PROMPT, _NUM_GEN = 0, 6, 7
PREFIX_TTFT_TARGET = 5.0
# More threads being this much slower than one means they wait for each other, not for work.
OVERSUBSCRIBED_FACTOR = 2.0
THREAD_WARNING = (
    " -- WARNING: threads are oversubscribed (the machine is busy); every timing of this run is "
    "inflated, try --omp-wait-policy passive or --threads 1"
)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0-100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _breakdown(steps: list[list[float]]) -> dict[str, float]:
    """Each part's share of the summed step wall time, in percent; overhead = not forward/sample."""
    wall = sum(s[_WALL] for s in steps)
    if wall <= 0:
        return {}
    pct = {p: 100 * sum(s[i + 1] for s in steps) / wall for i, p in enumerate(STEP_PARTS)}
    pct["other"] = 100 - sum(pct.values())
    pct["overhead"] = 100 - pct["forward"] - pct["sample"]
    return pct


def step_analysis(steps: list[list[float]], num_requests: int) -> dict:
    """Breakdown of all steps and of pure decode steps, and the mean decode step at full batch."""
    decode = [s for s in steps if s[_NUM_PROMPT] == 0 and s[_NUM_GEN] > 0]
    out = {
        "num_steps": len(steps),
        "num_decode_steps": len(decode),
        "breakdown_all": _breakdown(steps),
        "breakdown_decode": _breakdown(decode),
    }
    if decode:
        batch = max(s[_NUM_GEN] for s in decode)
        full = [s[_WALL] for s in decode if s[_NUM_GEN] == batch]
        out |= {
            "decode_batch": int(batch),
            "decode_step_s": statistics.fmean(full),
            "decode_steps_at_batch": len(full),
            "full_batch": batch == num_requests,
        }
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _engine_label(data: dict) -> str:
    """The engine's name, with llama.cpp's buffer types (llama_cpp_peer.run_isolated)."""
    bufts = data.get("extra", {}).get("extra_bufts")
    return data["engine"] if bufts is None else f"{data['engine']} (extra bufts {bufts})"


def summarise(data: dict) -> dict:
    """One result row (raw per-request lists reduced to percentiles) plus its printed line."""
    head = f"{data['workload']:14s} {_engine_label(data):18s}"
    if "skipped" in data or "error" in data:
        status = "skipped" if "skipped" in data else "error"
        reason = data.get("skipped") or data.get("error")
        return {
            "engine": data["engine"],
            "workload": data["workload"],
            "status": status,
            "reason": reason,
            "line": f"{head} {status.upper()}: {reason}",
        }
    elapsed = data["elapsed_s"]
    row = {
        "engine": data["engine"],
        "label": _engine_label(data),
        "workload": data["workload"],
        "status": "ok",
        "elapsed_s": elapsed,
        "num_requests": data["num_requests"],
        "num_prompt_tokens": data["num_prompt_tokens"],
        "num_output_tokens": data["num_output_tokens"],
        "gen_tps": data["num_output_tokens"] / elapsed,
        "prompt_tps": data["num_prompt_tokens"] / elapsed,
        "ttft_p50_s": percentile(data["ttft_s"], 50),
        "ttft_p99_s": percentile(data["ttft_s"], 99),
        "tpot_p50_s": percentile(data["tpot_s"], 50),
        "tpot_p99_s": percentile(data["tpot_s"], 99),
        "peak_rss_mib": data.get("peak_rss_mib", 0.0),
        "weight_mib": data.get("extra", {}).get("weight_bytes", 0) / 2**20 or None,
        "kv_cache_dtype": data.get("extra", {}).get("kv_cache_dtype", "-"),
        "extra": {k: v for k, v in data.get("extra", {}).items() if k != "steps"},
    }
    if "steps" in data.get("extra", {}):
        row["steps"] = step_analysis(data["extra"]["steps"], data["num_requests"])
    row["line"] = (
        f"{head} gen {row['gen_tps']:8.1f} tok/s  prompt {row['prompt_tps']:8.1f} tok/s  "
        f"TTFT p50/p99 {_ms(row['ttft_p50_s'])}/{_ms(row['ttft_p99_s'])} ms  "
        f"TPOT p50/p99 {_ms(row['tpot_p50_s'])}/{_ms(row['tpot_p99_s'])} ms  "
        f"RSS {row['peak_rss_mib']:.0f} MiB (weights {_mib(row['weight_mib'])} MiB)  "
        f"KV {row['kv_cache_dtype']}  ({elapsed:.1f} s)"
    )
    if "num_preemptions" in row["extra"]:
        row["line"] += (
            f"  preemptions {row['extra']['num_preemptions']}, "
            f"{row['extra'].get('num_blocks', '-')} blocks"
        )
    return row


def add_ratios(results: list[dict]) -> None:
    """pagedattn's generated tok/s over each peer's, on the same workload."""
    paged = {
        r["workload"]: r for r in results if r["engine"] == "pagedattn" and r["status"] == "ok"
    }
    for r in results:
        ref = paged.get(r["workload"])
        if r["status"] == "ok" and ref is not None and r["engine"] != "pagedattn":
            r["paged_over_peer_gen_tps"] = ref["gen_tps"] / r["gen_tps"]


def ceiling_rows(
    ceiling: dict | None, points: list[tuple[Workload, str]], results: list[dict]
) -> dict:
    """Matmul ceiling and bandwidth floor per batch, against pagedattn's mean decode step."""
    if not ceiling or "matmul_s" not in ceiling:
        reason = (ceiling or {}).get("error") or (ceiling or {}).get("skipped") or "not run"
        return {"rows": [], "lines": [f"ceiling probe: {reason}"]}
    bw = ceiling["bandwidth_Bps"]
    paged = {
        r["workload"]: r for r in results if r["engine"] == "pagedattn" and r["status"] == "ok"
    }
    rows = []
    lines = [
        f"copy bandwidth {bw / 1e9:.2f} GB/s, weights {ceiling['weight_bytes'] / 2**20:.0f} MiB "
        f"(linear kernel: {ceiling.get('linear_kernel', '?')})"
    ]
    probe, probe_1 = ceiling.get("probe_linear_s"), ceiling.get("probe_linear_1thread_s")
    if probe and probe_1:
        lines.append(
            f"thread probe: [8, 576] x [576, 3072] linear {_ms(probe)} ms with the benchmark's "
            f"threads, {_ms(probe_1)} ms with 1 thread"
            + (THREAD_WARNING if probe > OVERSUBSCRIBED_FACTOR * probe_1 else "")
        )
    for workload, name in points:
        batch = len(workload.requests)
        context = workload.mean_decode_context()
        kv_bytes = batch * context * ceiling["kv_bytes_per_token"]
        row = {
            "workload": name,
            "batch": batch,
            "mean_context": context,
            "matmul_s": ceiling["matmul_s"].get(str(batch)),
            "bandwidth_floor_s": (ceiling["weight_bytes"] + kv_bytes) / bw,
        }
        per_kernel = ceiling.get("kernel_matmul_s", {}).get(str(batch))
        if per_kernel:
            fastest = min(per_kernel, key=per_kernel.get)
            row |= {"fastest_kernel": fastest, "fastest_matmul_s": per_kernel[fastest]}
        steps = paged.get(name, {}).get("steps", {})
        if steps.get("decode_step_s"):
            row |= {
                "decode_step_s": steps["decode_step_s"],
                "decode_batch": steps["decode_batch"],
                "step_over_matmul": steps["decode_step_s"] / row["matmul_s"],
                "step_over_bandwidth": steps["decode_step_s"] / row["bandwidth_floor_s"],
            }
            if "fastest_matmul_s" in row:
                row["step_over_fastest"] = steps["decode_step_s"] / row["fastest_matmul_s"]
        rows.append(row)
        line = (
            f"ceiling batch {batch:3d} (context {context:.0f}): matmuls {_ms(row['matmul_s'])} ms, "
            f"bandwidth floor {_ms(row['bandwidth_floor_s'])} ms"
        )
        if "fastest_kernel" in row:
            line += f", fastest kernel {row['fastest_kernel']} {_ms(row['fastest_matmul_s'])} ms"
        if "decode_step_s" in row:
            line += (
                f"; pagedattn decode step {_ms(row['decode_step_s'])} ms (batch "
                f"{row['decode_batch']}) = {row['step_over_matmul']:.1f}x matmuls, "
                f"{row['step_over_bandwidth']:.1f}x bandwidth floor"
            )
            if "step_over_fastest" in row:
                line += f", {row['step_over_fastest']:.1f}x the fastest kernel's matmuls"
        lines.append(line)
    return {
        "rows": rows,
        "lines": lines,
        "bandwidth_Bps": bw,
        **{k: ceiling[k] for k in ("weight_bytes", "kv_bytes_per_token")},
        "kernel_matmul_s": ceiling.get("kernel_matmul_s", {}),
    }


def prefix_comparison(results: list[dict]) -> dict | None:
    """Shared prefix: TTFT with a warm prefix cache vs caching off, and the throughput gain."""
    by = {
        r["engine"]: r for r in results if r["workload"] == "shared_prefix" and r["status"] == "ok"
    }
    on, off = by.get("pagedattn"), by.get("pagedattn_nocache")
    if not on or not off or not on["ttft_p50_s"]:
        return None
    ratio = off["ttft_p50_s"] / on["ttft_p50_s"]
    return {
        "ttft_p50_cached_s": on["ttft_p50_s"],
        "ttft_p50_nocache_s": off["ttft_p50_s"],
        "ttft_ratio": ratio,
        "meets_target": ratio >= PREFIX_TTFT_TARGET,
        "throughput_gain": on["gen_tps"] / off["gen_tps"],
        "hit_rate": on["extra"].get("prefix_cache_hits", 0)
        / max(1, on["extra"].get("prefix_cache_queries", 0)),
    }


def render_markdown(
    meta: dict, results: list[dict], ceiling: dict | None, points: list[tuple[Workload, str]]
) -> tuple[str, dict]:
    """The report as markdown, and the same numbers as a JSON-able dict."""
    add_ratios(results)
    ceil = ceiling_rows(ceiling, points, results)
    prefix = prefix_comparison(results)
    verdict = "met" if prefix and prefix["meets_target"] else "NOT met"
    md = [
        f"# Throughput benchmark ({meta['size']})",
        "",
        f"Machine: {meta.get('machine', 'not recorded')}.",
        "",
        f"model {meta['model']}, {meta['dtype']}, {meta['threads']} threads, seed {meta['seed']}, "
        f"HF static batch {meta['hf_batch_size']}; load average {meta['load_average_start']:.2f} "
        f"at start, {meta['load_average_end']:.2f} at end.",
        "",
        "| workload | engine | gen tok/s | prompt tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| peak RSS MiB | weights MiB | KV cache | pagedattn / peer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["status"] != "ok":
            md.append(
                f"| {r['workload']} | {r['engine']} | {r['status']}: {r['reason']} | | | | | | | |"
            )
            continue
        ratio = r.get("paged_over_peer_gen_tps")
        md.append(
            f"| {r['workload']} | {r['label']} | {r['gen_tps']:.1f} | {r['prompt_tps']:.1f} "
            f"| {_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])} "
            f"| {_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p99_s'])} | {r['peak_rss_mib']:.0f} "
            f"| {_mib(r.get('weight_mib'))} | {r['kv_cache_dtype']} "
            f"| {'-' if ratio is None else f'{ratio:.2f}x'} |"
        )
    if prefix:
        md += [
            "",
            "## Prefix caching (shared prefix, warm cache vs caching off)",
            "",
            f"TTFT p50 {_ms(prefix['ttft_p50_cached_s'])} ms cached vs "
            f"{_ms(prefix['ttft_p50_nocache_s'])} ms off: {prefix['ttft_ratio']:.1f}x lower "
            f"(target >= {PREFIX_TTFT_TARGET:.0f}x: {verdict}); "
            f"throughput gain {prefix['throughput_gain']:.2f}x; block hit rate "
            f"{100 * prefix['hit_rate']:.0f}%.",
        ]
    md += ["", "## Decode step vs matmul ceiling and bandwidth floor", "", *ceil["lines"]]
    md += [
        "",
        "## pagedattn step breakdown (% of step wall time)",
        "",
        "| workload | engine | steps | " + " | ".join(STEP_PARTS) + " | other | overhead |",
        "|---|---|---|" + "---|" * (len(STEP_PARTS) + 2),
    ]
    for r in results:
        for kind in ("all", "decode"):
            pct = r.get("steps", {}).get(f"breakdown_{kind}")
            if pct:
                cells = " | ".join(f"{pct[p]:.1f}" for p in (*STEP_PARTS, "other", "overhead"))
                md.append(f"| {r['workload']} | {r['engine']} | {kind} | {cells} |")
    md += [
        "",
        "Notes: TTFT counts from the moment all requests are submitted together. "
        "HF static: TTFT = time to its batch's first token (waiting for earlier batches "
        "included), TPOT = its batch's mean decode step; only each request's own tokens count "
        "as output. Overhead = everything but forward and sampling. pagedattn runs a GGUF "
        "file's Q2_K ... IQ4_XS tensors as stored (the chosen dtype for activations and the rest); "
        "llama.cpp runs --synthetic's file as stored, and otherwise the GGUF retyped to the "
        "chosen dtype unless --llama-cpp-weights says otherwise (its row and its note in the "
        "JSON name the weights); HF static, OpenVINO and vLLM CPU run the same weights saved "
        "as an HF folder (OpenVINO: exported "
        "by optimum-intel, fp32 IR, the dtype as its inference precision). KV cache: the element "
        "type each engine keeps its cache in (OpenVINO's CPU default is u8); pagedattn writes "
        "its cache's pages at startup (--kv-cache-prefault), as vLLM allocates its cache up "
        "front, so no timed step waits for the OS to map them. Weights: the bytes of the "
        "checkpoint each engine was given (a GGUF file's tensors as stored; an HF folder's in "
        "the run's dtype; transformers: its parameters as loaded), next to the peak RSS.",
        "",
    ]
    report = {
        "meta": meta,
        "results": [{k: v for k, v in r.items() if k != "line"} for r in results],
        "prefix_caching": prefix,
        "ceiling": ceil,
    }
    return "\n".join(md), report
