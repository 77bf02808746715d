"""Loader behaviour: HF folders, GGUF files (tiny, converted like llama.cpp), errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedattn.model import (
    ModelNotFoundError,
    UnsupportedArchitectureError,
    WeightLoadError,
    load_model,
)
from pagedattn.model.gguf_loader import GGUFCheckpoint, unpermute_qk
from pagedattn.model.loader import build_model
from tests.model.gguf_writer import llama_cpp_permute, write_gguf
from tests.model.paged_driver import PagedDriver
from tests.model.tiny import make_tiny_gemma3, make_tiny_llama, tiny_vocab

PROMPT = [5, 9, 17, 33, 64, 100, 7, 8, 12, 90, 41]


def hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_hf_folder_metadata(tmp_path: Path) -> None:
    loaded = load_model(str(make_tiny_llama(tmp_path)), "float32", "cpu", "torch")
    vocab = tiny_vocab()
    assert loaded.model_name == "tiny-llama"
    assert loaded.max_model_len == 256
    assert loaded.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert {vocab["</s>"], vocab["<|im_end|>"]} <= set(loaded.eos_token_ids)
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "the a"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|> assistant ")
    assert loaded.tokenizer.encode("the a")[-2:] == [vocab["the"], vocab["a"]]


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = llama_cpp_permute(w, num_heads=3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads=3), w)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_gguf_matches_hf(tmp_path: Path, arch: str) -> None:
    """An F32 GGUF converted like llama.cpp (permuted Q/K, 1 + w norms) gives HF's logits."""
    if arch == "llama":
        hf_dir = make_tiny_llama(tmp_path)
    else:
        # llama.cpp's Gemma 3 conventions: every 6th layer global, local rope theta 10000,
        # query_pre_attn_scalar = head_dim, no rope scaling.
        hf_dir = make_tiny_gemma3(
            tmp_path,
            num_hidden_layers=6,
            layer_types=None,
            query_pre_attn_scalar=16,
            rope_local_base_freq=10000.0,
            rope_scaling=None,
            final_logit_softcapping=None,
        )
    gguf_path = write_gguf(hf_dir, tmp_path / f"{arch}.gguf", arch)
    model, config, _ = build_model(GGUFCheckpoint(gguf_path), "float32", "cpu", "torch")
    if arch == "gemma3":
        assert config.layer_types[5] == "full_attention"
        assert model.kv_cache_group_windows() == [4, None]
    logits = PagedDriver(model).step([(0, PROMPT)])[0]
    torch.testing.assert_close(logits, hf_logits(hf_dir, PROMPT), atol=1e-4, rtol=1e-4)


def test_unknown_path_raises_model_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model.*does not exist.*gguf"):
        load_model(str(missing))


def test_folder_without_checkpoint_raises_model_not_found(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        load_model(str(tmp_path))


def _write_config(path: Path, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as info:
        load_model(str(path), attn_backend="torch")
    assert "LlamaForCausalLM" in str(info.value) and "Gemma3ForCausalLM" in str(info.value)


def test_unknown_model_type_is_unsupported(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "foo", model_type="foo-lm", architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="foo-lm"):
        load_model(str(path), attn_backend="torch")


def test_incomplete_checkpoint_raises_weight_load_error(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match="layers.2"):
        load_model(str(path), attn_backend="torch")


def test_mismatched_shape_raises_weight_load_error(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"mlp\..*has shape"):
        load_model(str(path), attn_backend="torch")


def _mapped(path_part: str) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if path_part in line]


def test_safetensors_are_read_not_mapped(tmp_path: Path) -> None:
    """An HF model's tensors are read into memory of their own: no weight file stays mapped
    (a mapped file's pages count in RSS for as long as one adopted tensor of it lives)."""
    from safetensors import safe_open

    from pagedattn.model.hf_loader import read_safetensors

    path = make_tiny_llama(tmp_path)
    file = next(path.glob("*.safetensors"))
    ours = dict(read_safetensors(file))
    with safe_open(str(file), framework="pt") as f:
        assert sorted(ours) == sorted(f.keys())
        for name in f.keys():
            assert torch.equal(ours[name], f.get_tensor(name)), name
    loaded = load_model(str(path), "float32", "cpu")
    assert loaded.model is not None and not _mapped(str(path))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x05", "no valid header"),
        ((1 << 40).to_bytes(8, "little") + b"{}", "no valid header"),
        ((4).to_bytes(8, "little") + b"{x:1", "header is not JSON"),
        (
            (len(h := b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}')).to_bytes(
                8, "little"
            )
            + h
            + b"\0" * 8,
            "ends inside tensor 'w'",
        ),
        (
            (len(h := b'{"w":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}')).to_bytes(
                8, "little"
            )
            + h
            + b"\0" * 8,
            "dtype C64",
        ),
    ],
)
def test_a_damaged_safetensors_file_is_named(tmp_path: Path, data: bytes, match: str) -> None:
    from pagedattn.model.hf_loader import SafetensorsFormatError, read_safetensors

    file = tmp_path / "model.safetensors"
    file.write_bytes(data)
    with pytest.raises(SafetensorsFormatError, match=match):
        list(read_safetensors(file))
