"""Paged decode attention per KV cache dtype: bf16 K/V against fp8 and u8 K/V (bench attention
rows).

The same random K/V is stored in bf16, in fp8 (computed scales) and in u8 (a scale and min per
token and kv head, attention.u8); the compiled decode kernel reads each with bf16 queries, timed
interleaved. Each runs on the vector kernel and, where the CPU has AMX, on the tiles too (bf16
and fp8 on AMX-BF16, u8 on AMX-INT8: rows bf16-amx, fp8_e4m3-amx, u8-amx, ...).
"""

from __future__ import annotations

import functools

import torch

from pagedattn.attention import u8
from pagedattn.attention.backends.base import lazy_zeros
from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.attention.fp8 import FP8_DTYPES, compute_scale, quantize
from pagedattn.cpu import extension as cpu_ext

DEFAULT_KV_CONTEXTS = (1024, 4096)
# --kv-cache-dtype choices of the rows.
KV_DTYPE_NAMES = (*sorted(FP8_DTYPES), *u8.U8_NAMES)


def kv_dtype_rows(args, gen: torch.Generator, build_decode_batch, interleaved_ms, head_configs):
    """Rows {heads, context, kernel, ms, speedup} for bf16 (vector, amx), each fp8 dtype and u8."""
    if cpu_ext.get_extension() is None:
        print("note: the compiled kernel is unavailable; no KV dtype rows")
        return []
    names = [n for n in args.kv_cache_dtype if n in FP8_DTYPES]
    with_u8 = any(n in u8.U8_NAMES for n in args.kv_cache_dtype)
    amx = cpu_ext.amx_available()
    rows = []
    for heads in args.heads:
        num_heads, num_kv_heads, head_size = head_configs[heads]
        for context in args.kv_contexts:
            key_cache, value_cache, meta, _, _ = build_decode_batch(
                [context] * args.num_seqs, args.block_size, num_kv_heads, head_size, gen
            )
            # NOTE: one pooled copy, shared by the vector and AMX bf16 kernels.
            key_cache, value_cache = _in_pool(key_cache), _in_pool(value_cache)
            query = torch.randn(args.num_seqs, num_heads, head_size, generator=gen)
            query = query.to(torch.bfloat16)
            scale = head_size**-0.5
            fns = {"bf16": _run(CpuBackend(decode_kernel="compiled"), query, key_cache,
                                value_cache, meta, scale)}  # fmt: skip
            if amx:
                fns["bf16-amx"] = _run(
                    CpuBackend(decode_kernel="amx"), query, key_cache, value_cache, meta, scale
                )
            for name in names:
                dtype = FP8_DTYPES[name]
                k_scale, v_scale = (
                    compute_scale(key_cache, dtype),
                    compute_scale(value_cache, dtype),
                )
                fp8_key = _in_pool(quantize(key_cache, dtype, k_scale))
                fp8_value = _in_pool(quantize(value_cache, dtype, v_scale))
                for kernel in ("compiled", "amx") if amx else ("compiled",):
                    fns[name if kernel == "compiled" else f"{name}-amx"] = _run(
                        CpuBackend(decode_kernel=kernel),
                        query,
                        fp8_key,
                        fp8_value,
                        meta,
                        scale,
                        k_scale=k_scale,
                        v_scale=v_scale,
                    )
            if with_u8:
                u8_key, u8_value = (
                    _in_pool(u8.quantize(key_cache)),
                    _in_pool(u8.quantize(value_cache)),
                )
                fns["u8"] = _run(
                    CpuBackend(decode_kernel="compiled"), query, u8_key, u8_value, meta, scale
                )
                if amx:
                    fns["u8-amx"] = _run(
                        CpuBackend(decode_kernel="amx"), query, u8_key, u8_value, meta, scale
                    )
            expected = fns["bf16"]().float()
            diffs = {n: float((fn().float() - expected).abs().max()) for n, fn in fns.items()}
            times = interleaved_ms(fns, args.warmup, args.repeats)
            best_bf16 = min(ms for n, ms in times.items() if n.startswith("bf16"))
            for kernel, ms in times.items():
                row = dict(heads=heads, context=context, kernel=kernel, ms=ms,
                           speedup=best_bf16 / ms, diff=diffs[kernel])  # fmt: skip
                rows.append(row)
                print(f"decode {heads} ctx={context} KV {kernel}: {ms:.2f} ms, "
                      f"{row['speedup']:.2f}x the best bf16, max|diff vs bf16| "
                      f"{row['diff']:.2e}")  # fmt: skip
            del key_cache, value_cache
    return rows


def _run(backend, query, key_cache, value_cache, meta, scale, **scales):
    return functools.partial(backend.forward, query, key_cache, value_cache, meta, scale=scale,
                             **scales)  # fmt: skip


def _in_pool(cache: torch.Tensor) -> torch.Tensor:
    """A copy of cache on memory allocated as the engine's KV pool is (lazy_zeros: huge pages
    where the OS gives them), so that the kernels pay the engine's TLB costs, not malloc's."""
    pool = lazy_zeros(tuple(cache.shape), cache.dtype)
    pool.copy_(cache)
    return pool


def kv_dtype_table(rows: list[dict]) -> list[str]:
    """Markdown lines of the KV dtype rows."""
    lines = ["", "Decode attention per KV cache dtype (bf16 queries; speedup vs the best bf16)", "",
             "| heads | context | KV | ms | speedup | max abs diff vs bf16 |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['heads']} | {r['context']} | {r['kernel']} | {r['ms']:.2f} | "
              f"{r['speedup']:.2f}x | {r['diff']:.1e} |" for r in rows]  # fmt: skip
    return lines
