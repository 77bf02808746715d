"""The same KV memory in other cache dtypes: blocks, sequences that fit, and the paged run."""

from __future__ import annotations

from dataclasses import replace

from pagedattn.sim import report
from pagedattn.sim.compare import MemorySetup
from pagedattn.sim.paged import run_paged
from pagedattn.sim.traces import TraceRequest

# --kv-cache-dtype name -> bytes per element.
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "u8": 1}
# Bytes after each (token, kv head) row: the u8 cache's float32 scale and min (attention.u8).
# NOTE: attention.u8.U8_SCALE_BYTES, written out: the simulator does not import torch.
KV_ROW_EXTRA_BYTES = {"u8": 8}


def compare_kv_dtypes(
    trace: list[TraceRequest], setup: MemorySetup, block_size: int, dtypes: list[str]
) -> list[dict]:
    """One row per dtype: the paged run of ``trace`` with setup's memory in that dtype."""
    rows = []
    for name in dtypes:
        geometry = replace(
            setup.geometry,
            dtype_bytes=KV_DTYPE_BYTES[name],
            row_extra_bytes=KV_ROW_EXTRA_BYTES.get(name, 0),
        )
        dtype_setup = replace(setup, geometry=geometry)
        slots = dtype_setup.capacity_slots
        result = run_paged(
            trace,
            block_size=block_size,
            capacity_slots=slots,
            config=setup.scheduler,
            max_seq_len=setup.max_seq_len,
        ).result
        rows.append(
            dict(
                kv_cache_dtype=name,
                num_blocks=slots // block_size,
                full_length_seqs=(slots // block_size) // -(-setup.max_seq_len // block_size),
                mean_concurrent=result.mean_concurrent,
                max_concurrent=result.max_concurrent,
                num_preemptions=result.num_preemptions,
                tokens_per_step=result.tokens_per_step,
            )
        )
    return rows


def kv_dtype_table(name: str, rows: list[dict]) -> str:
    """Markdown table of compare_kv_dtypes rows, with ratios against the first row."""
    base = rows[0]
    headers = ["KV dtype", "blocks", "full-length seqs", "mean concurrent", "max concurrent",
               "preemptions", "tokens/step", f"x {base['kv_cache_dtype']} concurrent"]  # fmt: skip
    table = [
        [
            r["kv_cache_dtype"],
            r["num_blocks"],
            r["full_length_seqs"],
            f"{r['mean_concurrent']:.1f}",
            r["max_concurrent"],
            r["num_preemptions"],
            f"{r['tokens_per_step']:.1f}",
            f"{r['mean_concurrent'] / max(base['mean_concurrent'], 1e-9):.2f}x",
        ]
        for r in rows
    ]
    return f"### {name}: the same KV memory per cache dtype\n\n" + report.markdown_table(
        headers, table
    )
