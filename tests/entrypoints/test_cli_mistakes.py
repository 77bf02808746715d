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


# Issue 52: the newcomer's mistakes, each one line and exit 2 before the model loads. The
# checkpoints are small files made here: a mistake found before loading never reads weights.


def _hf_folder(path, architecture="LlamaForCausalLM", *, weights="model.safetensors", **config):
    import json

    path.mkdir(parents=True, exist_ok=True)
    body = {"architectures": [architecture], "model_type": "llama"} | config
    (path / "config.json").write_text(json.dumps(body))
    if weights:
        (path / weights).write_bytes(b"\0" * 8)
    return path


def _with_tokenizer(path):
    (path / "tokenizer.json").write_text("{}")
    return path


def _gguf(path, arch="llama", num_floats=4096):
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_tensor("token_embd.weight", np.zeros(num_floats, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _refused(capsys, *argv: str) -> str:
    code, err = _run(capsys, *argv)
    assert code == 2, err
    line = _one_clear_line(err)
    assert line.startswith("pagedattn: error: "), line
    return line


def test_hf_folder_of_an_unsupported_architecture(capsys, tmp_path):
    model = _with_tokenizer(_hf_folder(tmp_path / "mamba", "MambaForCausalLM"))
    line = _refused(capsys, "generate", "hi", "--model", str(model))
    assert "MambaForCausalLM" in line and "LlamaForCausalLM" in line and "--model" in line


def test_gguf_of_an_unsupported_architecture(capsys, tmp_path):
    line = _refused(capsys, "generate", "hi", "--model", str(_gguf(tmp_path / "m.gguf", "mamba")))
    assert "'mamba'" in line and "llama" in line and "--model" in line


def test_truncated_gguf(capsys, tmp_path):
    path = _gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 4096])
    line = _refused(capsys, "generate", "hi", "--model", str(path))
    assert "truncated" in line and "download or convert it again" in line


def test_text_file_named_gguf(capsys, tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are my notes, not a model\n")
    line = _refused(capsys, "generate", "hi", "--model", str(path))
    assert "not a readable GGUF file" in line and "convert_hf_to_gguf" in line


def test_hf_folder_without_tokenizer_files(capsys, tmp_path):
    model = _hf_folder(tmp_path / "llama")
    line = _refused(capsys, "generate", "hi", "--model", str(model))
    assert "no tokenizer files" in line and "sentencepiece" not in line


def test_hf_folder_with_only_pytorch_model_bin(capsys, tmp_path):
    model = _with_tokenizer(_hf_folder(tmp_path / "old", weights="pytorch_model.bin"))
    line = _refused(capsys, "generate", "hi", "--model", str(model))
    assert "pytorch_model.bin" in line and "safetensors" in line


def test_float16_on_cpu_names_dtype(capsys):
    line = _refused(capsys, "generate", "hi", "--model", NO_MODEL, "--dtype", "float16")
    assert "--dtype" in line and "bfloat16" in line and "KV" not in line


def test_zero_threads(capsys):
    line = _refused(capsys, "generate", "hi", "--model", NO_MODEL, "--threads", "0")
    assert "--threads" in line and ">= 1" in line


def test_serve_port_out_of_range(capsys):
    line = _refused(capsys, "serve", "--model", NO_MODEL, "--port", "99999")
    assert "--port 99999" in line and "1..65535" in line


def test_lora_module_that_is_not_a_peft_folder(capsys, tmp_path):
    model = _with_tokenizer(_hf_folder(tmp_path / "llama"))
    line = _refused(
        capsys, "serve", "--model", str(model), "--port", "0", "--enable-lora",
        "--lora-modules", f"x={tmp_path}",
    )  # fmt: skip
    assert f"--lora-modules x={tmp_path}" in line and "adapter_config.json" in line


def test_lora_modules_without_enable_lora(capsys, tmp_path):
    line = _refused(capsys, "serve", "--model", NO_MODEL, "--lora-modules", f"x={tmp_path}")
    assert "--enable-lora" in line


def test_max_model_len_past_the_models_context(capsys, tmp_path):
    model = _with_tokenizer(_hf_folder(tmp_path / "llama", max_position_embeddings=8192))
    line = _refused(capsys, "generate", "hi", "--model", str(model), "--max-model-len", "100000")
    assert "--max-model-len 100000" in line and "8192" in line


def test_ray_address_without_a_head_fails_fast(capsys):
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    line = _refused(
        capsys, "serve", "--model", NO_MODEL, "--data-parallel-size", "2",
        "--ray-address", f"127.0.0.1:{port}",
    )  # fmt: skip
    assert time.monotonic() - t0 < 10
    assert f"--ray-address 127.0.0.1:{port}" in line and "ray start --head" in line


def test_generate_on_a_model_without_chat_template_says_it_runs_raw(capsys, tmp_path):
    from tests.model.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    code = cli.main(
        ["generate", "the a", "--model", str(model), "--max-tokens", "2", "--dtype", "float32",
         "--num-blocks", "16", "--linear-kernel", "torch", "--attention-kernel", "torch"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0
    notes = [line for line in err.splitlines() if "chat template" in line]
    assert notes == ["pagedattn: note: tiny-llama has no chat template: the prompts are sent as "
                     "they are (as --raw)"], err  # fmt: skip
