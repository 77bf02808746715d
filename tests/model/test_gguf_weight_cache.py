"""The converted GGUF weights are cached per file and dtype; a cached load equals a fresh one."""

from __future__ import annotations

import pytest
import torch

from pagedattn.model import gguf_loader
from pagedattn.model.gguf_loader import GGUFCheckpoint, _weights_cache_path
from tests.model.gguf_writer import write_gguf
from tests.model.tiny import make_tiny_llama


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "WEIGHT_CACHE_MIN_BYTES", 0)  # cache even a tiny file


def test_weight_cache_round_trip(tmp_path):
    gguf = write_gguf(make_tiny_llama(tmp_path / "hf"), tmp_path / "tiny.gguf", "llama")
    ckpt = GGUFCheckpoint(gguf)
    config = ckpt.hf_config()
    reference = dict(ckpt.weights(config))  # float32, no cache
    assert not (tmp_path / "cache").exists()
    for dtype in (torch.float32, torch.bfloat16):
        first = dict(ckpt.weights(config, dtype))
        path = _weights_cache_path(gguf, dtype)
        assert path.is_file()
        path_mtime = path.stat().st_mtime_ns
        second = dict(GGUFCheckpoint(gguf).weights(config, dtype))
        assert path.stat().st_mtime_ns == path_mtime  # read, not rewritten
        assert first.keys() == second.keys() == reference.keys()
        for name, w in reference.items():
            assert second[name].dtype == dtype
            assert torch.equal(second[name], w.to(dtype)) and torch.equal(first[name], second[name])


def test_damaged_cache_is_rewritten(tmp_path):
    gguf = write_gguf(make_tiny_llama(tmp_path / "hf"), tmp_path / "tiny.gguf", "llama")
    ckpt = GGUFCheckpoint(gguf)
    config = ckpt.hf_config()
    path = _weights_cache_path(gguf, torch.float32)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a safetensors file")
    got = dict(ckpt.weights(config, torch.float32))
    assert got.keys() == dict(ckpt.weights(config)).keys()
    assert path.stat().st_size > 100


def test_small_files_are_not_cached(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_loader, "WEIGHT_CACHE_MIN_BYTES", 1 << 30)
    gguf = write_gguf(make_tiny_llama(tmp_path / "hf"), tmp_path / "tiny.gguf", "llama")
    ckpt = GGUFCheckpoint(gguf)
    assert dict(ckpt.weights(ckpt.hf_config(), torch.bfloat16))
    assert not _weights_cache_path(gguf, torch.bfloat16).exists()
