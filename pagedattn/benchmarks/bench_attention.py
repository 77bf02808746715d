"""Paged attention on CPU: decode and prefill against SDPA, block-size sweep, memory bandwidth.

Decode: paged against contiguous SDPA. Prefill: the compiled kernel against gather + SDPA and
SDPA on contiguous K/V.

Paged rows: "cpu-torch" (the cpu backend's gather + SDPA path) and "cpu-ext" (the compiled kernels
reading K/V through the block tables, when they build). Peers are timed interleaved, call by
call, so that load from other processes hits them alike.

Run: pagedattn bench attention --seed 0 [--threads 2] [--out bench_out/] [--quick]
     [--kv-cache-dtype fp8_e4m3 fp8_e5m2 u8 [--kv-only]]: fp8 / u8 K/V rows beside bf16
     [--prefill-only]: only the prefill rows (--prefill-lens, --prefill-heads)
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.ops import reshape_and_cache
from pagedattn.benchmarks.attention_kv import (
    DEFAULT_KV_CONTEXTS,
    KV_DTYPE_NAMES,
    kv_dtype_rows,
    kv_dtype_table,
)
from pagedattn.cpu import extension as cpu_ext
from pagedattn.cpu.features import describe_cpu

# (num_heads, num_kv_heads, head_size): SmolLM2-135M-like and Llama-3-8B-like.
HEAD_CONFIGS = {"9/3x64": (9, 3, 64), "32/8x64": (32, 8, 64), "32/8x128": (32, 8, 128)}
SWEEP_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
DTYPE = torch.bfloat16
# kernel_time_by_block_size: a fixed representative decode batch.
KERNEL_TIME_NUM_SEQS = 32
KERNEL_TIME_MEAN_LEN = 500.0
KERNEL_TIME_WARMUP, KERNEL_TIME_REPEATS = 2, 10


def median_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median wall time of fn in milliseconds after warm-up calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def interleaved_ms(fns: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict:
    """Median wall time (ms) of each fn, calling them in turn so that they share any noise."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def paged_backends() -> dict[str, CpuBackend]:
    """The cpu backend without and (if it builds) with the compiled decode kernel."""
    backends = {"cpu-torch": CpuBackend(use_extension=False)}
    if cpu_ext.get_extension() is not None:
        backends["cpu-ext"] = CpuBackend(use_extension=True)
    else:
        print("note: the compiled kernel is unavailable (see the warning above); no cpu-ext rows")
    return backends


def machine_bandwidth_gbs(warmup: int, repeats: int, num_bytes: int = 1 << 29) -> float:
    """Memory bandwidth in GB/s: a large copy (bytes read + written) and a large sum; the max."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), warmup, repeats)
    sum_ms = median_ms(lambda: src.sum(), warmup, repeats)
    return max(2 * num_bytes / copy_ms / 1e6, num_bytes / sum_ms / 1e6)


def build_decode_batch(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_size: int, gen: torch.Generator
):
    """A paged cache holding random K/V for each sequence in shuffled blocks, plus metadata."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(perm[start : start + n])
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.zeros(shape, dtype=DTYPE)
    value_cache = torch.zeros(shape, dtype=DTYPE)
    keys = [torch.randn(n, num_kv_heads, head_size, generator=gen).to(DTYPE) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_size, generator=gen).to(DTYPE) for n in seq_lens]
    prefill = AttentionMetadata.build(seq_lens, seq_lens, tables, block_size)
    reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache,
                      prefill.slot_mapping)  # fmt: skip
    decode = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size)
    return key_cache, value_cache, decode, keys, values


def bench_paged_vs_contiguous(args, gen: torch.Generator, bandwidth: float) -> list[dict]:
    """Decode, all sequences at one context length: cpu backends vs SDPA on contiguous K/V."""
    rows, backends = [], paged_backends()
    for name in args.heads:
        num_heads, num_kv_heads, head_size = HEAD_CONFIGS[name]
        group = num_heads // num_kv_heads
        for context in args.contexts:
            seq_lens = [context] * args.num_seqs
            key_cache, value_cache, meta, keys, values = build_decode_batch(
                seq_lens, args.block_size, num_kv_heads, head_size, gen
            )
            # [S, L, Hkv, D] -> [S, Hkv, L, D], contiguous: the unpaged baseline.
            key = torch.stack(keys).transpose(1, 2).contiguous()
            value = torch.stack(values).transpose(1, 2).contiguous()
            del keys, values
            query = torch.randn(args.num_seqs, num_heads, head_size, generator=gen).to(DTYPE)
            q = query.view(args.num_seqs, num_kv_heads, group, head_size)  # [S, Hkv, G, D]
            scale = head_size**-0.5

            def contiguous(q=q, key=key, value=value, scale=scale):
                return F.scaled_dot_product_attention(q, key, value, scale=scale)

            fns = {"contiguous": contiguous}
            for backend_name, backend in backends.items():
                fns[backend_name] = functools.partial(
                    backend.forward, query, key_cache, value_cache, meta, scale=scale
                )
            expected = contiguous().reshape(query.shape).float()
            diffs = {b: float((fns[b]().float() - expected).abs().max()) for b in backends}
            times = interleaved_ms(fns, args.warmup, args.repeats)
            kv_bytes = 2 * key.numel() * key.element_size()
            for backend_name in backends:
                paged_ms, contiguous_ms = times[backend_name], times["contiguous"]
                achieved = kv_bytes / paged_ms / 1e6
                row = dict(heads=name, context=context, backend=backend_name, paged_ms=paged_ms,
                           contiguous_ms=contiguous_ms, ratio=paged_ms / contiguous_ms,
                           gbs=achieved, contiguous_gbs=kv_bytes / contiguous_ms / 1e6,
                           frac=achieved / bandwidth, diff=diffs[backend_name])  # fmt: skip
                print(f"decode {name} ctx={context} {backend_name}: paged {paged_ms:.2f} ms, "
                      f"contiguous SDPA {contiguous_ms:.2f} ms, ratio {row['ratio']:.2f}, "
                      f"{achieved:.1f} GB/s ({row['frac']:.0%} of machine), "
                      f"max|diff| {row['diff']:.2e}")  # fmt: skip
                rows.append(row)
            del key_cache, value_cache, key, value
    return rows


def bench_prefill(args, gen: torch.Generator) -> list[dict]:
    """One prompt's causal attention, whole (q_len = seq_len): the cpu backend's paths against
    SDPA on contiguous K/V (its flash kernel, causal), bf16; GFLOP/s count the causal half."""
    rows, backends = [], paged_backends()
    for name in args.prefill_heads:
        num_heads, num_kv_heads, head_size = HEAD_CONFIGS[name]
        for length in args.prefill_lens:
            key_cache, value_cache, decode, keys, values = build_decode_batch(
                [length], args.block_size, num_kv_heads, head_size, gen
            )
            tables = [decode.block_tables[0].tolist()]
            meta = AttentionMetadata.build([length], [length], tables, args.block_size)
            query = torch.randn(length, num_heads, head_size, generator=gen).to(DTYPE)
            key, value = keys[0].transpose(0, 1)[None], values[0].transpose(0, 1)[None]
            q, scale = query.transpose(0, 1)[None], head_size**-0.5

            def contiguous(q=q, key=key, value=value, scale=scale):
                out = F.scaled_dot_product_attention(
                    q, key, value, is_causal=True, scale=scale, enable_gqa=True
                )
                return out[0].transpose(0, 1)

            fns = {"contiguous": contiguous}
            for backend_name, backend in backends.items():
                fns[backend_name] = functools.partial(
                    backend.forward, query, key_cache, value_cache, meta, scale=scale
                )
            expected = contiguous().float()
            diffs = {b: float((fns[b]().float() - expected).abs().max()) for b in backends}
            times = interleaved_ms(fns, args.warmup, args.repeats)
            flop = 4 * num_heads * head_size * length * (length + 1) / 2
            for backend_name in backends:
                ms = times[backend_name]
                row = dict(heads=name, length=length, backend=backend_name, ms=ms,
                           torch_ms=times["cpu-torch"], contiguous_ms=times["contiguous"],
                           gflops=flop / ms / 1e6, diff=diffs[backend_name])  # fmt: skip
                print(f"prefill {name} len={length} {backend_name}: {ms:.2f} ms "
                      f"({row['gflops']:.0f} GFLOP/s), gather + SDPA {times['cpu-torch']:.2f} ms "
                      f"(x{times['cpu-torch'] / ms:.2f}), contiguous SDPA "
                      f"{times['contiguous']:.2f} ms (x{times['contiguous'] / ms:.2f}), "
                      f"max|diff| {row['diff']:.2e}")  # fmt: skip
                rows.append(row)
    return rows


def lognormal_seq_lens(num_seqs: int, mean: float, gen: torch.Generator) -> list[int]:
    """Sequence lengths drawn from a log-normal distribution with the given mean (sigma 0.8)."""
    sigma = 0.8
    mu = math.log(mean) - sigma**2 / 2
    draws = torch.exp(mu + sigma * torch.randn(num_seqs, generator=gen, dtype=torch.float64))
    return [max(1, round(x)) for x in draws.tolist()]


def bench_block_sizes(args, gen: torch.Generator) -> list[dict]:
    """Decode time per backend and internal fragmentation per block size, same sequence lengths."""
    num_heads, num_kv_heads, head_size = HEAD_CONFIGS["9/3x64"]
    seq_lens = lognormal_seq_lens(args.num_seqs, args.mean_len, gen)
    query = torch.randn(args.num_seqs, num_heads, head_size, generator=gen).to(DTYPE)
    rows, backends = [], paged_backends()
    for block_size in args.block_sizes:
        key_cache, value_cache, meta, _, _ = build_decode_batch(
            seq_lens, block_size, num_kv_heads, head_size, gen
        )
        allocated = key_cache.shape[0] * block_size
        waste = (allocated - sum(seq_lens)) / allocated
        fns = {
            name: functools.partial(
                backend.forward, query, key_cache, value_cache, meta, scale=head_size**-0.5
            )
            for name, backend in backends.items()
        }
        times = interleaved_ms(fns, args.warmup, args.repeats)
        print(f"block_size={block_size}: decode "
              + ", ".join(f"{name} {ms:.2f} ms" for name, ms in times.items())
              + f"; internal fragmentation {waste:.1%}")  # fmt: skip
        rows.append(dict(block_size=block_size, ms=times, fragmentation=waste))
    return rows


def kernel_time_by_block_size(
    block_sizes: list[int], *, seed: int, num_threads: int = 1
) -> dict[int, float]:
    """Microseconds per decode call of the cpu backend (compiled kernel if it builds) per block
    size: 32 sequences, log-normal lengths (mean 500), 9 q / 3 kv heads x 64, bf16.

    NOTE: one thread by default: on a shared, oversubscribed machine a 2-thread parallel region
    waits for a descheduled thread (a whole time slice), which swamps the block-size differences.
    """
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_size = HEAD_CONFIGS["9/3x64"]
    seq_lens = lognormal_seq_lens(KERNEL_TIME_NUM_SEQS, KERNEL_TIME_MEAN_LEN, gen)
    query = torch.randn(KERNEL_TIME_NUM_SEQS, num_heads, head_size, generator=gen).to(DTYPE)
    backend, times = CpuBackend(), {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for block_size in block_sizes:
            key_cache, value_cache, meta, _, _ = build_decode_batch(
                seq_lens, block_size, num_kv_heads, head_size, gen
            )
            run = functools.partial(
                backend.forward, query, key_cache, value_cache, meta, scale=head_size**-0.5
            )
            times[block_size] = 1e3 * median_ms(run, KERNEL_TIME_WARMUP, KERNEL_TIME_REPEATS)
    finally:
        torch.set_num_threads(threads_before)
    return times


def write_report(
    out: Path,
    bandwidth: float,
    decode: list[dict],
    sweep: list[dict],
    args,
    kv_rows=(),
    prefill=(),
) -> None:
    """Markdown tables and a PNG (time and fragmentation vs block size)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Paged attention on CPU (bf16, {args.num_seqs} seqs, threads={args.threads}, "
        f"B={args.block_size}, seed={args.seed})",
        "",
        f"Machine: {describe_cpu(args.threads)}; bandwidth (copy/sum, max): {bandwidth:.1f} GB/s",
        "",
        "| heads | context | backend | paged ms | contiguous SDPA ms | ratio | K/V GB/s "
        "| SDPA GB/s | of machine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in decode:
        lines.append(f"| {r['heads']} | {r['context']} | {r['backend']} | {r['paged_ms']:.2f} | "
                     f"{r['contiguous_ms']:.2f} | {r['ratio']:.2f} | {r['gbs']:.1f} | "
                     f"{r['contiguous_gbs']:.1f} | {r['frac']:.0%} |")  # fmt: skip
    names = list(sweep[0]["ms"]) if sweep else []
    lines += ["", f"Block-size sweep (log-normal lengths, mean {args.mean_len})", "",
              "| block size | " + " | ".join(f"{n} ms" for n in names)
              + " | internal fragmentation |", "|---" * (len(names) + 2) + "|"]  # fmt: skip
    lines += [f"| {r['block_size']} | " + " | ".join(f"{r['ms'][n]:.2f}" for n in names)
              + f" | {r['fragmentation']:.1%} |" for r in sweep]  # fmt: skip
    if kv_rows:
        lines += kv_dtype_table(kv_rows)
    if prefill:
        lines += ["", "Prefill, one whole prompt (causal; GFLOP/s of the causal half)", "",
                  "| heads | prompt | backend | ms | GFLOP/s | gather + SDPA ms "
                  "| contiguous SDPA ms | speed-up over gather + SDPA |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['heads']} | {r['length']} | {r['backend']} | {r['ms']:.2f} | "
                  f"{r['gflops']:.0f} | {r['torch_ms']:.2f} | {r['contiguous_ms']:.2f} | "
                  f"{r['torch_ms'] / r['ms']:.2f}x |" for r in prefill]  # fmt: skip
    text = "\n".join(lines) + "\n"
    (out / "bench_attention.md").write_text(text)
    print(text)
    if not sweep:
        print(f"wrote {out / 'bench_attention.md'}")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [r["block_size"] for r in sweep]
    for name, marker in zip(names, "o^", strict=False):
        ax.plot(sizes, [r["ms"][name] for r in sweep], marker + "-", label=name)
    ax.legend(loc="upper center")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size B (tokens)")
    ax.set_ylabel("decode time (ms)")
    twin = ax.twinx()
    twin.plot(sizes, [100 * r["fragmentation"] for r in sweep], "s--", color="tab:red")
    twin.set_ylabel("internal fragmentation (%)", color="tab:red")
    ax.set_title("Paged decode (cpu backends, bf16): time vs fragmentation")
    fig.tight_layout()
    fig.savefig(out / "bench_attention.png", dpi=120)
    print(f"wrote {out / 'bench_attention.md'} and {out / 'bench_attention.png'}")


def main() -> None:
    """Parse flags, run every section, write the report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--heads", nargs="+", choices=sorted(HEAD_CONFIGS), default=["9/3x64"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(SWEEP_BLOCK_SIZES))
    parser.add_argument("--mean-len", type=float, default=500.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=[],
        choices=KV_DTYPE_NAMES,
        help="also time decode over fp8 / u8 K/V beside bf16 (--kv-contexts)",
    )
    parser.add_argument("--kv-contexts", type=int, nargs="+", default=list(DEFAULT_KV_CONTEXTS))
    parser.add_argument("--kv-only", action="store_true",
                        help="with --kv-cache-dtype: only the KV dtype rows")  # fmt: skip
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--prefill-heads", nargs="+", choices=sorted(HEAD_CONFIGS),
                        default=["9/3x64", "32/8x64"])  # fmt: skip
    parser.add_argument("--prefill-only", action="store_true", help="only the prefill rows")
    args = parser.parse_args()
    if args.quick:
        args.num_seqs, args.contexts, args.repeats, args.warmup = 4, [64, 256], 3, 1
        args.prefill_lens = [100]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    bandwidth = machine_bandwidth_gbs(args.warmup, args.repeats)
    print(f"machine bandwidth: {bandwidth:.1f} GB/s (threads={args.threads})")
    kv_rows = []
    if args.kv_cache_dtype:
        kv_rows = kv_dtype_rows(args, gen, build_decode_batch, interleaved_ms, HEAD_CONFIGS)
    decode_runs = not (args.kv_only or args.prefill_only)
    decode = bench_paged_vs_contiguous(args, gen, bandwidth) if decode_runs else []
    sweep = bench_block_sizes(args, gen) if decode_runs else []
    prefill = [] if args.kv_only else bench_prefill(args, gen)
    write_report(args.out, bandwidth, decode, sweep, args, kv_rows, prefill)


if __name__ == "__main__":
    main()
