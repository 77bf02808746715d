"""bench_memory end to end on a small trace; model geometry from names and config.json."""

from __future__ import annotations

import json

import pytest

from pagedattn.benchmarks.bench_memory import main
from pagedattn.sim.compare import MemorySetup
from pagedattn.sim.model_configs import ModelConfigError, load_geometry
from pagedattn.sim.stepper import SimSchedulerConfig
from pagedattn.sim.traces import generate_trace, save_jsonl


def test_geometry_of_known_models_and_config_files(tmp_path) -> None:
    # llama-2-7b: 2 (K, V) * 32 layers * 32 heads * 128 * 2 bytes = 512 KiB per token.
    assert load_geometry("llama-2-7b").bytes_per_token == 512 * 1024
    cfg = {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 8192,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    geometry = load_geometry(str(path))
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_size) == (30, 3, 64)
    assert (geometry.dtype_bytes, geometry.max_seq_len) == (2, 8192)
    assert geometry.bytes_per_token == load_geometry("smollm2-135m").bytes_per_token
    setup = MemorySetup(load_geometry("llama-2-7b"), 8 * 1024**3, 4096, SimSchedulerConfig())
    assert setup.capacity_slots == 16384  # 8 GiB / 512 KiB
    assert setup.vmm_page_tokens == 256  # 2 MiB / (32 heads * 128 * 2 bytes)
    with pytest.raises(ModelConfigError, match="neither a known name"):
        load_geometry("gpt-5")


def test_main_prints_tables_and_writes_plots(tmp_path, capsys) -> None:
    trace_path = tmp_path / "trace.jsonl"
    save_jsonl(generate_trace("alpaca", 30, max_seq_len=64, arrival_rate=1.0, seed=0), trace_path)
    out = tmp_path / "out"
    argv = [
        "--trace",
        str(trace_path),
        "--memory",
        "256MiB",
        "--model-config",
        "llama-2-7b",
        "--max-seq-len",
        "64",
        "--block-sizes",
        "8,16",
        "--sharing-requests",
        "3",
        "--system-prompt-len",
        "16",
        "--no-gif",  # tests/viz/test_block_pool_plot.py films the pool
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "512 token slots" in text  # 256 MiB / 512 KiB
    for policy in (
        "contiguous-max",
        "contiguous-max_tokens",
        "contiguous-exact",
        "vattention-2MB",
        "paged-B16",
    ):
        assert f"| {policy} |" in text
    assert "capacity at B=16" in text and "| beam | 6 |" in text
    for name in (
        "utilisation_trace.png",
        "concurrency_trace.png",
        "block_sizes_trace.png",
        "sharing.png",
        "results.json",
    ):
        assert (out / name).stat().st_size > 0
    results = json.loads((out / "results.json").read_text())
    paged = results["trace"]["policies"][-1]
    assert paged["policy"] == "paged-B16" and paged["utilization"] > 0.5


def test_main_on_a_generated_workload(tmp_path, capsys) -> None:
    argv = [
        "--workload",
        "sharegpt",
        "--num-requests",
        "40",
        "--no-sweep",
        "--no-sharing",
        "--no-gif",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "## sharegpt: 40 requests" in text and "| paged-B16 |" in text
    assert (tmp_path / "utilisation_sharegpt.png").stat().st_size > 0
