"""LoRA on the OpenAI server: adapters by `model`, in `/v1/models`, loaded and unloaded live.

The load/unload endpoints (vLLM's) exist behind --enable-lora-runtime-updates and the API key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagedattn.entrypoints.openai.protocol import APIError, ModelCard
from pagedattn.lora.request import (
    LoRADisabledError,
    LoRAError,
    LoRAExistsError,
    LoRAFormatError,
    LoRAInUseError,
    LoRANotFoundError,
    LoRAPathError,
    LoRARankError,
    LoRARequest,
)

# LoRA error class -> (HTTP status, error code, param).
_ERRORS: dict[type, tuple[int, str, str | None]] = {
    LoRAPathError: (400, "invalid_lora_path", "lora_path"),
    LoRAFormatError: (400, "invalid_lora_adapter", "lora_path"),
    LoRARankError: (400, "lora_rank_too_large", "lora_path"),
    LoRAExistsError: (409, "lora_already_loaded", "lora_name"),
    LoRAInUseError: (409, "lora_in_use", "lora_name"),
    LoRANotFoundError: (404, "lora_not_found", "lora_name"),
    LoRADisabledError: (400, "lora_disabled", None),
}


class LoadLoRAAdapterRequest(BaseModel):
    """Body of POST /v1/load_lora_adapter (vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """Body of POST /v1/unload_lora_adapter (vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def api_error(exc: LoRAError) -> APIError:
    """The 4xx a LoRA error maps to."""
    status, code, param = _ERRORS.get(type(exc), (400, "invalid_lora_adapter", None))
    return APIError(str(exc), status_code=status, param=param, code=code)


def parse_lora_modules(specs: Sequence[str]) -> list[tuple[str, str]]:
    """`name=path` strings -> (name, path) pairs; ValueError names a malformed one."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {spec!r} is not name=path")
        pairs.append((name, path))
    return pairs


class ServingLoRA:
    """The server's view of the adapters: name -> LoRARequest, kept in step with the engine."""

    def __init__(self, engine, base_model: str) -> None:
        self.engine = engine  # AsyncLLMEngine
        self.base_model = base_model
        self.adapters: dict[str, LoRARequest] = {r.lora_name: r for r in engine.engine.loras.list()}
        self._lock = asyncio.Lock()

    def resolve(self, model: str) -> LoRARequest | None:
        """None for the base model, the adapter for an adapter name; else a 404."""
        if model == self.base_model:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            names = ", ".join([repr(self.base_model), *map(repr, self.adapters)])
            raise APIError(
                f"the model {model!r} does not exist: this server serves {names}",
                status_code=404,
                param="model",
                code="model_not_found",
            )
        return adapter

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [
            ModelCard(
                id=r.lora_name,
                root=r.lora_path,
                parent=self.base_model,
                max_model_len=max_model_len,
            )
            for r in self.adapters.values()
        ]

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        if body.lora_name == self.base_model:
            raise APIError(
                f"{body.lora_name!r} is the base model's name: choose another adapter name",
                status_code=409,
                param="lora_name",
                code="lora_already_loaded",
            )
        async with self._lock:
            if body.lora_name in self.adapters:
                raise api_error(
                    LoRAExistsError(f"a LoRA adapter named {body.lora_name!r} is already loaded")
                )
            int_id = max((r.lora_int_id for r in self.adapters.values()), default=0) + 1
            request = LoRARequest(body.lora_name, int_id, body.lora_path)
            registry = self.engine.engine.loras
            try:
                # NOTE: files are read off the engine thread; the engine only registers them.
                adapter = await asyncio.to_thread(registry.read, request)
                await self.engine.call(lambda e: e.loras.add(adapter))
            except LoRAError as exc:
                raise api_error(exc) from None
            self.adapters[request.lora_name] = request
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        async with self._lock:
            try:
                await self.engine.call(lambda e: e.loras.remove(body.lora_name))
            except LoRAError as exc:
                raise api_error(exc) from None
            self.adapters.pop(body.lora_name, None)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def serving_lora(engine, base_model: str, lora_modules: Sequence[str]) -> ServingLoRA | None:
    """Load the `--lora-modules` adapters into the engine (before it serves); the server's view
    of the adapters, or None when the engine has LoRA off."""
    registry = engine.engine.loras
    if not registry.enabled:
        if lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    for int_id, (name, path) in enumerate(parse_lora_modules(lora_modules), start=1):
        if name == base_model:
            raise ValueError(f"--lora-modules name {name!r} is the base model's name")
        registry.add(LoRARequest(name, int_id, path))
    return ServingLoRA(engine, base_model)


def install_lora_routes(app: FastAPI, serving_lora: ServingLoRA) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the app's API key)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await serving_lora.load(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await serving_lora.unload(body))
