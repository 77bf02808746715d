"""Issue 21: every CLI mistake is one clear line and exit status 2, before the model loads;
`generate` streams; the KV summary names each count once."""

from __future__ import annotations

import io
import socket
import sys

import pytest

from pagedattn import cli
from pagedattn.engine.stats import EngineStats, StepTimes

NO_MODEL = "/no/such/model"  # a mistake found before loading never gets to the model


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def _one_clear_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_missing_file_is_one_line(capsys, tmp_path):
    code, err = _run(capsys, "generate", "--file", str(tmp_path / "nope.txt"), "--model", NO_MODEL)
    assert code == 2
    assert "cannot read --file" in _one_clear_line(err)


def test_bad_kv_store_url_is_refused_before_the_model_loads(capsys):
    code, err = _run(capsys, "generate", "hi", "--model", NO_MODEL, "--kv-store", "ftp://x")
    assert code == 2
    line = _one_clear_line(err)
    assert "--kv-store" in line and NO_MODEL not in line


def test_cuda_without_a_gpu_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, err = _run(capsys, "generate", "hi", "--model", NO_MODEL, "--device", "cuda")
    assert code == 2 and "no CUDA GPU" in _one_clear_line(err)


def test_replicas_without_ray_name_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    code, err = _run(capsys, "serve", "--model", NO_MODEL, "--data-parallel-size", "2")
    assert code == 2 and "pagedattn[ray]" in _one_clear_line(err)


def test_a_port_in_use_is_found_before_the_model_loads(capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        code, err = _run(capsys, "serve", "--model", NO_MODEL, "--port", port)
    assert code == 2 and f"127.0.0.1:{port}" in _one_clear_line(err)


def test_usage_errors_are_one_line_with_the_apis_message(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "hi", "--kv-cache-memory", "10TiB"])
    assert info.value.code == 2
    line = _one_clear_line(capsys.readouterr().err)
    assert "cannot parse size '10TiB'" in line and "invalid parse_size value" not in line


def test_quantization_accepts_none_as_help_shows_it():
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "--quantization", "none"]).quantization is None
    assert parser.parse_args(["generate", "--quantization", "int8"]).quantization == "int8"


def test_kv_summary_counts_each_prompt_token_once():
    from pagedattn.kv_transfer.stats import KVConnectorStats

    stats = EngineStats(
        num_blocks=64, block_size=16, num_free_blocks=60, num_cached_blocks=28,
        kv_cache_usage=0.0, prefix_cache_queries=71, prefix_cache_hits=16, num_preemptions=0,
        num_recomputed_tokens=0, internal_fragmentation=0, num_running=0, num_waiting=0,
        num_prompt_tokens=7, num_generation_tokens=5, step_times=StepTimes(),
        kv_store=KVConnectorStats(num_hit_tokens=48, num_miss_tokens=7, num_loaded_blocks=3),
    )  # fmt: skip
    text = "\n".join(cli.kv_summary_lines(stats))
    assert (
        "prompt tokens: 71 = 16 from the prefix cache + 48 from the KV store + 7 computed" in text
    )
    assert "cached 28" not in text and "KV cache:" not in text
    assert "48 prompt tokens loaded" in text


def test_generate_streams_text_as_it_is_produced(tmp_path):
    from pagedattn import LLM
    from pagedattn.sampling_params import SamplingParams
    from tests.model.tiny import make_tiny_llama

    llm = LLM(make_tiny_llama(tmp_path), dtype="float32", num_blocks=32)

    class Recorder(io.StringIO):
        writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return super().write(text)

    out = Recorder()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = cli.stream_outputs(llm, ["the a", "a the"], params, ["p0", "p1"], out=out)
    text = out.getvalue()
    assert text.index("### p0") < text.index("### p1")
    assert all(o.finished for o in outs)
    # NOTE: the first prompt's text came out in pieces, step by step, not once at the end.
    first = outs[0].outputs[0].text
    pieces = [w for w in out.writes if w and w in first]
    assert len(pieces) >= 2, out.writes
