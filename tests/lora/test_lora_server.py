"""LoRA on the OpenAI server (`--enable-lora --lora-modules`, runtime load/unload) on a
loopback port: the `model` field selects an adapter, with the errors vLLM gives; with two keys,
each owns the adapters it loads (issue 52), loads read only under --lora-root, and no answer
shows a server path."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.server_process import ServerProcess, make_model_dir
from tests.lora.adapters import hf_peft_greedy, make_peft_adapter

KEY, KEY2 = "lora-key", "lora-key-2"
AUTH = {"Authorization": f"Bearer {KEY}"}
AUTH2 = {"Authorization": f"Bearer {KEY2}"}
PROMPT = list(range(5, 16))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = make_model_dir(root / "base")
    files = {
        "root": root,
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
        "--enable-lora-runtime-updates", "--api-key", KEY, "--api-key", KEY2,
        "--lora-root", str(root),
        "--served-model-name", "tiny",
    )  # fmt: skip
    yield server, files
    server.stop()


def post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def complete(server, model: str, headers=AUTH) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    return post(server, "/v1/completions", body | {"ignore_eos": True}, headers)


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
    response = httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10)
    by_id = {m["id"]: m for m in response.json()["data"]}
    assert by_id["tiny"]["parent"] is None
    assert by_id["a8"]["parent"] == "tiny" and by_id["a8"]["root"] is None
    assert str(files["root"]) not in response.text  # no server path


def test_load_and_unload_at_runtime_with_specific_errors(setup, tmp_path):
    server, files = setup
    load = {"lora_name": "a16", "lora_path": "a16"}  # relative to --lora-root
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
    big = {"lora_name": "big", "lora_path": "r32"}
    assert error("/v1/load_lora_adapter", big) == (400, "lora_rank_too_large")
    assert error("/v1/unload_lora_adapter", {"lora_name": "nope"}) == (404, "lora_not_found")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "a16"}).status_code == 200
    assert complete(server, "a16").status_code == 404
    assert complete(server, "a8").status_code == 200


def test_every_refused_path_gets_one_message(setup, tmp_path):
    server, files = setup
    root = files["root"]
    (root / "empty").mkdir(exist_ok=True)
    (root / "escape").symlink_to(tmp_path)
    messages = set()
    for given in (
        str(tmp_path / "missing"),  # missing, outside the root
        str(tmp_path),  # an existing folder outside the root
        "/etc",  # a system folder
        "../..",  # out of the root by `..`
        "escape",  # out of the root by a symlink
        "missing",  # missing, inside the root
        "empty",  # a folder without adapter_config.json
        str(files["a8"] / "adapter_config.json"),  # a file, not a folder
    ):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": given})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_lora_path", r.text
        messages.add(r.json()["error"]["message"])
    assert len(messages) == 1, messages
    assert str(root) not in messages.pop()


@pytest.mark.parametrize(
    "config",
    [
        {"peft_type": "LORA", "r": [8], "lora_alpha": 16},
        {"peft_type": "LORA", "r": float("inf"), "lora_alpha": 16},
        {"peft_type": "LORA", "r": "8", "lora_alpha": 16},
        {"peft_type": "LORA", "r": 8, "lora_alpha": float("nan")},
        ["not", "an", "object"],
    ],
)
def test_malformed_adapter_configs_are_400_with_a_code(setup, config):
    server, files = setup
    name = f"bad{abs(hash(json.dumps(config))) % 10**8}"
    folder = files["root"] / name
    if not folder.exists():
        shutil.copytree(files["a8"], folder)
        (folder / "adapter_config.json").write_text(json.dumps(config))
    r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": name})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_lora_adapter", r.text
    assert str(folder) not in r.text


def test_an_adapter_belongs_to_the_key_that_loaded_it(setup):
    server, files = setup
    load = {"lora_name": "mine", "lora_path": "a16"}
    assert post(server, "/v1/load_lora_adapter", load).status_code == 200
    try:
        models2 = httpx.get(f"{server.base_url}/v1/models", headers=AUTH2, timeout=10).json()
        assert {m["id"] for m in models2["data"]} == {"tiny", "a8"}  # start-up ones only
        r = complete(server, "mine", AUTH2)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "mine" not in r.json()["error"]["message"].partition("serves")[2]
        r = post(server, "/v1/unload_lora_adapter", {"lora_name": "mine"}, AUTH2)
        assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"
        # NOTE: each key names its adapters apart: key 2's "mine" (other weights) is its own,
        # and key 1's "mine" still answers as key 1's weights (no 409 tells key 2 it exists).
        before = complete(server, "mine").json()["choices"][0]["text"]
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "a8"}, AUTH2)
        assert r.status_code == 200, r.text
        assert complete(server, "mine").json()["choices"][0]["text"] == before
        theirs = complete(server, "mine", AUTH2).json()["choices"][0]["text"]
        assert theirs == complete(server, "a8", AUTH2).json()["choices"][0]["text"]
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "a8", "lora_path": "a8"}, AUTH2)
        assert r.status_code == 409  # a start-up adapter's name is every key's
        r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a8"}, AUTH2)
        assert r.status_code == 403 and r.json()["error"]["code"] == "lora_forbidden"
        assert complete(server, "a8", AUTH2).status_code == 200  # start-up: every key's
        r = post(server, "/v1/unload_lora_adapter", {"lora_name": "mine"}, AUTH2)
        assert r.status_code == 200
    finally:
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "mine"}).status_code == 200


def test_a_replaced_adapter_answers_as_its_new_weights(setup):
    server, files = setup

    def load(name: str, folder: str) -> None:
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})
        assert r.status_code == 200, r.text

    def unload(name: str) -> None:
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200

    load("swap", "a8")
    first = complete(server, "swap").json()
    unload("swap")
    load("swap", "a16")
    second = complete(server, "swap").json()
    unload("swap")
    load("fresh", "a16")
    fresh = complete(server, "fresh").json()
    unload("fresh")
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached == 0
    assert second["choices"][0]["text"] == fresh["choices"][0]["text"]
    assert second["choices"][0]["text"] != first["choices"][0]["text"]
