"""Issue 52: a LoRA adapter load or unload answers JSON (vLLM answers plain text)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from pagedattn.entrypoints.openai.http import TenantAuth, make_app
from pagedattn.entrypoints.openai.lora_routes import install_lora_routes


class FakeServingLoRA:
    """ServingLoRA's load/unload answers, without an engine (the routes wrap them)."""

    async def load(self, body, tenant) -> str:
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body, tenant) -> str:
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def test_a_lora_adapter_load_answers_json():
    app = make_app("lora", TenantAuth(None), max_request_bytes=1 << 16)
    install_lora_routes(app, FakeServingLoRA())
    with TestClient(app) as c:
        loaded = c.post("/v1/load_lora_adapter", json={"lora_name": "a8", "lora_path": "/x"})
        assert loaded.status_code == 200
        assert loaded.headers["content-type"] == "application/json"
        assert loaded.json()["lora_name"] == "a8" and loaded.json()["status"] == "loaded"
        unloaded = c.post("/v1/unload_lora_adapter", json={"lora_name": "a8"})
        assert unloaded.json()["status"] == "unloaded"
