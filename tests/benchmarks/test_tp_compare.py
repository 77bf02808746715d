"""`bench throughput --tensor-parallel-size 2`: 1 rank and 2 ranks (shm, gloo) side by side."""

from __future__ import annotations

from pagedattn.benchmarks.bench_throughput import main
from tests.model.tiny import make_tiny_llama


def test_tp_comparison_prints_collective_time_and_token_identity(tmp_path, capsys):
    model = make_tiny_llama(tmp_path)
    out = tmp_path / "bench" / "throughput.md"
    argv = ["--model", str(model), "--tensor-parallel-size", "2", "--threads", "2",
            "--tp-batch", "3", "--tp-prompt-len", "9", "--tp-max-tokens", "4",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = (tmp_path / "bench" / "throughput_tp2.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|") for line in table.splitlines()[4:]}
    assert set(rows) == {"TP=1", "TP=2 (shm)", "TP=2 (gloo)"}
    # 2 layers: 4 all-reduces, the embedding's, the logits gather.
    assert rows["TP=2 (shm)"][5].strip() == rows["TP=2 (gloo)"][5].strip() == "6"
    assert float(rows["TP=2 (gloo)"][6]) > 0 and float(rows["TP=1"][6]) == 0
    assert rows["TP=2 (shm)"][-2].strip() == rows["TP=2 (gloo)"][-2].strip() == "yes"
    assert "load average" in capsys.readouterr().out
