"""bench throughput --lora end to end on a tiny random model: rows, ratio and the load line."""

from __future__ import annotations

import re

from pagedattn.benchmarks import bench_throughput
from tests.model.tiny import make_tiny_llama


def test_lora_bench_prints_rows_ratio_and_load_steps(tmp_path, capsys) -> None:
    model = make_tiny_llama(tmp_path / "model")
    argv = ["--lora", "2", "--size", "tiny", "--model", str(model), "--block-size", "4"]
    assert bench_throughput.main(argv) == 0
    out = capsys.readouterr().out
    tiny_tokens = 4 * 8  # 4 requests x 8 output tokens (SIZE_PRESETS["tiny"])
    rows = re.findall(r"^\| (no LoRA|2 adapters[^|]*) \| (\d+) \|", out, re.M)
    assert [int(n) for _, n in rows] == [tiny_tokens] * 2
    assert re.search(r"\| [\d.]+ \| [\d.]+x \|$", out, re.M)
    load = re.search(r"copied into its slot ([\d.]+) ms; .* worst ([\d.]+)x the median", out)
    assert load is not None and float(load.group(2)) > 0
    assert "command: pagedattn bench throughput --lora 2" in out and "load average" in out
