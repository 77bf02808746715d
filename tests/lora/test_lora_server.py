"""LoRA on the OpenAI server (`--enable-lora --lora-modules`, runtime load/unload) on a
loopback port: the `model` field selects an adapter, with the errors vLLM gives."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.server_process import ServerProcess, make_model_dir
from tests.lora.adapters import hf_peft_greedy, make_peft_adapter

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = list(range(5, 16))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = make_model_dir(root / "base")
    files = {
        "base": base,
        "a8": make_peft_adapter(base, root / "a8", rank=8, seed=1),
        "a16": make_peft_adapter(base, root / "a16", rank=16, seed=2),
        "r32": make_peft_adapter(base, root / "r32", rank=32, seed=4),
    }
    server = ServerProcess(
        base,
        root / "server.log",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"a8={files['a8']}",
        "--enable-lora-runtime-updates", "--api-key", KEY,
        "--served-model-name", "tiny",
    )  # fmt: skip
    yield server, files
    server.stop()


def post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def complete(server, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    return post(server, "/v1/completions", body | {"ignore_eos": True})


def test_the_model_field_selects_the_adapter(setup):
    server, files = setup
    tokenizer = AutoTokenizer.from_pretrained(files["base"])
    for model, adapter in (("tiny", None), ("a8", files["a8"])):
        response = complete(server, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        expected = hf_peft_greedy(files["base"], adapter, PROMPT, 6)
        # NOTE: the completion's text joins the prompt with a space (word-level tokenizer).
        assert response.json()["choices"][0]["text"].strip() == tokenizer.decode(expected)
    unknown = complete(server, "nope")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_models_lists_adapters_with_their_parent(setup):
    server, files = setup
    data = httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert by_id["tiny"]["parent"] is None
    assert by_id["a8"]["parent"] == "tiny" and by_id["a8"]["root"] == str(files["a8"])


def test_load_and_unload_at_runtime_with_specific_errors(setup, tmp_path):
    server, files = setup
    load = {"lora_name": "a16", "lora_path": str(files["a16"])}
    assert post(server, "/v1/load_lora_adapter", load, headers={}).status_code == 401
    assert complete(server, "a16").status_code == 404
    ok = post(server, "/v1/load_lora_adapter", load)
    assert ok.status_code == 200, ok.text
    assert complete(server, "a16").status_code == 200

    def error(path: str, body: dict) -> tuple[int, str]:
        response = post(server, path, body)
        return response.status_code, response.json()["error"]["code"]

    assert error("/v1/load_lora_adapter", load) == (409, "lora_already_loaded")
    bad = {"lora_name": "x", "lora_path": str(tmp_path / "missing")}
    assert error("/v1/load_lora_adapter", bad) == (400, "invalid_lora_path")
    big = {"lora_name": "big", "lora_path": str(files["r32"])}
    assert error("/v1/load_lora_adapter", big) == (400, "lora_rank_too_large")
    assert error("/v1/unload_lora_adapter", {"lora_name": "nope"}) == (404, "lora_not_found")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "a16"}).status_code == 200
    assert complete(server, "a16").status_code == 404
    assert complete(server, "a8").status_code == 200
