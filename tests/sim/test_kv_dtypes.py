"""The same simulated KV memory per cache dtype: 2x the blocks of bf16 in fp8, 4x float32's."""

from __future__ import annotations

from pagedattn.sim.compare import MemorySetup
from pagedattn.sim.kv_dtypes import compare_kv_dtypes, kv_dtype_table
from pagedattn.sim.model_configs import load_geometry
from pagedattn.sim.stepper import SimSchedulerConfig
from pagedattn.sim.traces import generate_trace


def test_fp8_holds_twice_the_blocks_and_runs_more_sequences():
    setup = MemorySetup(load_geometry("smollm2-135m"), 32 << 20, 256, SimSchedulerConfig(512, 256))
    trace = generate_trace("alpaca", 60, max_seq_len=256, seed=0)
    rows = compare_kv_dtypes(trace, setup, 16, ["bfloat16", "fp8", "float32"])
    bf16, fp8, fp32 = rows
    # Twice and four times the token slots (block counts differ by floor rounding only).
    assert 0 <= fp8["num_blocks"] - 2 * bf16["num_blocks"] <= 1
    assert 0 <= fp8["num_blocks"] - 4 * fp32["num_blocks"] <= 3
    assert fp8["full_length_seqs"] >= 2 * bf16["full_length_seqs"]
    assert fp8["mean_concurrent"] > 1.5 * bf16["mean_concurrent"]
    assert fp8["tokens_per_step"] > bf16["tokens_per_step"]
    table = kv_dtype_table("alpaca", rows)
    assert "| fp8 |" in table and "x bfloat16 concurrent" in table


def test_u8_holds_2d_over_d_plus_8_times_the_bf16_blocks():
    setup = MemorySetup(load_geometry("smollm2-135m"), 32 << 20, 256, SimSchedulerConfig(512, 256))
    trace = generate_trace("alpaca", 20, max_seq_len=256, seed=0)
    bf16, u8 = compare_kv_dtypes(trace, setup, 16, ["bfloat16", "u8"])
    # SmolLM2: D = 64, so a row is 72 bytes against bf16's 128: 16/9 the blocks (floor rounding).
    assert 0 <= u8["num_blocks"] - 16 * bf16["num_blocks"] // 9 <= 1
