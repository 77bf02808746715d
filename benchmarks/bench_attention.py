"""Paged decode attention on CPU: paged vs contiguous SDPA, block-size sweep, memory bandwidth.

Run: python -m benchmarks.bench_attention --seed 0 [--threads 2] [--out bench_out/] [--quick]
"""

from __future__ import annotations

import argparse
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

# (num_heads, num_kv_heads, head_size): SmolLM2-135M-like and Llama-3-8B-like.
HEAD_CONFIGS = {"9/3x64": (9, 3, 64), "32/8x128": (32, 8, 128)}
SWEEP_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
DTYPE = torch.bfloat16


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
    """Decode, all sequences at one context length: cpu backend vs SDPA on contiguous K/V."""
    rows, backend = [], CpuBackend()
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

            def paged(query=query, kc=key_cache, vc=value_cache, meta=meta, scale=scale):
                return backend.forward(query, kc, vc, meta, scale=scale)

            def contiguous(q=q, key=key, value=value, scale=scale):
                return F.scaled_dot_product_attention(q, key, value, scale=scale)

            diff = (paged().float() - contiguous().reshape(query.shape).float()).abs().max()
            paged_ms = median_ms(paged, args.warmup, args.repeats)
            contiguous_ms = median_ms(contiguous, args.warmup, args.repeats)
            kv_bytes = 2 * key.numel() * key.element_size()
            achieved = kv_bytes / paged_ms / 1e6
            row = dict(heads=name, context=context, paged_ms=paged_ms,
                       contiguous_ms=contiguous_ms, ratio=paged_ms / contiguous_ms,
                       gbs=achieved, frac=achieved / bandwidth, diff=float(diff))  # fmt: skip
            print(f"decode {name} ctx={context}: paged {paged_ms:.2f} ms, contiguous SDPA "
                  f"{contiguous_ms:.2f} ms, ratio {row['ratio']:.2f}, {achieved:.1f} GB/s "
                  f"({row['frac']:.0%} of machine), max|diff| {row['diff']:.2e}")  # fmt: skip
            rows.append(row)
            del key_cache, value_cache, key, value
    return rows


def lognormal_seq_lens(num_seqs: int, mean: float, gen: torch.Generator) -> list[int]:
    """Sequence lengths drawn from a log-normal distribution with the given mean (sigma 0.8)."""
    sigma = 0.8
    mu = math.log(mean) - sigma**2 / 2
    draws = torch.exp(mu + sigma * torch.randn(num_seqs, generator=gen, dtype=torch.float64))
    return [max(1, round(x)) for x in draws.tolist()]


def bench_block_sizes(args, gen: torch.Generator) -> list[dict]:
    """Decode kernel time and internal fragmentation per block size, same sequence lengths."""
    num_heads, num_kv_heads, head_size = HEAD_CONFIGS["9/3x64"]
    seq_lens = lognormal_seq_lens(args.num_seqs, args.mean_len, gen)
    query = torch.randn(args.num_seqs, num_heads, head_size, generator=gen).to(DTYPE)
    rows, backend = [], CpuBackend()
    for block_size in args.block_sizes:
        key_cache, value_cache, meta, _, _ = build_decode_batch(
            seq_lens, block_size, num_kv_heads, head_size, gen
        )
        allocated = key_cache.shape[0] * block_size
        waste = (allocated - sum(seq_lens)) / allocated

        def run(kc=key_cache, vc=value_cache, meta=meta):
            return backend.forward(query, kc, vc, meta, scale=head_size**-0.5)

        ms = median_ms(run, args.warmup, args.repeats)
        print(f"block_size={block_size}: decode {ms:.2f} ms, internal fragmentation {waste:.1%}")
        rows.append(dict(block_size=block_size, ms=ms, fragmentation=waste))
    return rows


def write_report(out: Path, bandwidth: float, decode: list[dict], sweep: list[dict], args) -> None:
    """Markdown tables and a PNG (time and fragmentation vs block size)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Paged attention on CPU (bf16, {args.num_seqs} seqs, threads={args.threads}, "
        f"B={args.block_size}, seed={args.seed})",
        "",
        f"Machine bandwidth (copy/sum, max): {bandwidth:.1f} GB/s",
        "",
        "| heads | context | paged ms | contiguous SDPA ms | ratio | K/V GB/s | of machine |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in decode:
        lines.append(f"| {r['heads']} | {r['context']} | {r['paged_ms']:.2f} | "
                     f"{r['contiguous_ms']:.2f} | {r['ratio']:.2f} | {r['gbs']:.1f} | "
                     f"{r['frac']:.0%} |")  # fmt: skip
    lines += ["", f"Block-size sweep (log-normal lengths, mean {args.mean_len})", "",
              "| block size | decode ms | internal fragmentation |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {r['block_size']} | {r['ms']:.2f} | {r['fragmentation']:.1%} |" for r in sweep]
    text = "\n".join(lines) + "\n"
    (out / "bench_attention.md").write_text(text)
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [r["block_size"] for r in sweep]
    ax.plot(sizes, [r["ms"] for r in sweep], "o-", color="tab:blue", label="decode time")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size B (tokens)")
    ax.set_ylabel("decode time (ms)", color="tab:blue")
    twin = ax.twinx()
    twin.plot(sizes, [100 * r["fragmentation"] for r in sweep], "s--", color="tab:red")
    twin.set_ylabel("internal fragmentation (%)", color="tab:red")
    ax.set_title("Paged decode (cpu backend, bf16): time vs fragmentation")
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
    args = parser.parse_args()
    if args.quick:
        args.num_seqs, args.contexts, args.repeats, args.warmup = 4, [64, 256], 3, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    bandwidth = machine_bandwidth_gbs(args.warmup, args.repeats)
    print(f"machine bandwidth: {bandwidth:.1f} GB/s (threads={args.threads})")
    decode = bench_paged_vs_contiguous(args, gen, bandwidth)
    sweep = bench_block_sizes(args, gen)
    write_report(args.out, bandwidth, decode, sweep, args)


if __name__ == "__main__":
    main()
