"""Defect 8 of issue #15: leaving out max_tokens must not reserve the whole context.

On a pool smaller than one full context, a short chat without max_tokens is served (capped by
what the pool holds), not rejected as needing max_model_len tokens of blocks.
"""

from __future__ import annotations

import httpx
import pytest

from pagedattn import LLM
from pagedattn.entrypoints.openai.server import build_app
from tests.entrypoints.server_process import InProcessServer, make_model_dir

MODEL = "tiny"


def test_chat_without_max_tokens_on_a_small_pool(tmp_path):
    path = make_model_dir(tmp_path / "tiny")
    # 6 blocks x 16 tokens = 96 tokens of KV, while max_model_len is 256.
    llm = LLM(str(path), dtype="float32", num_blocks=6, block_size=16, max_model_len=256)
    server = InProcessServer(build_app(llm.engine, served_model_name=MODEL))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert data["choices"][0]["finish_reason"] == "length"
        total = data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]
        assert 1 <= data["usage"]["completion_tokens"] and total <= 96
        assert "cached_tokens" in data["usage"]["prompt_tokens_details"]
    finally:
        server.stop()
    assert llm.engine.get_stats().kv_cache_usage == 0


def test_max_model_len_past_the_model_is_an_error(tmp_path):
    """The Python API refuses a context the model cannot serve (it used to clamp it silently),
    naming the model's own length; its own length and less load."""
    path = make_model_dir(tmp_path / "tiny")
    with pytest.raises(ValueError, match=r"max_model_len=257 is more than .* 256 tokens"):
        LLM(str(path), dtype="float32", num_blocks=6, block_size=16, max_model_len=257)
    llm = LLM(str(path), dtype="float32", num_blocks=6, block_size=16, max_model_len=128)
    assert llm.engine.max_model_len == 128
