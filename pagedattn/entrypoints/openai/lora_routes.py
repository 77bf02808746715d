"""LoRA on the OpenAI server: adapters by `model`, in `/v1/models`, loaded and unloaded live.

The load/unload endpoints (vLLM's) exist behind --enable-lora-runtime-updates and the API key.
Tenancy, with API keys set: an adapter loaded at runtime belongs to the key that loaded it (its
tenant): only that key, or an admin key, sees, uses and unloads it; `--lora-modules` adapters
are every key's (only an admin key unloads them). Each tenant names its adapters in a namespace
of its own beside the shared one: two keys may both load an adapter `a` (the engine holds them
as `a@<tenant digest>`), so no answer tells one key what another has loaded; a name the shared
adapters or the key itself already use is a 409. Runtime loads read only under `--lora-root`,
and every refused path gets one message (no answer tells which server paths exist);
`/v1/models` shows no path.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from pagedattn.entrypoints.openai.http import tenant_of
from pagedattn.entrypoints.openai.protocol import APIError, ModelCard
from pagedattn.lora.adapter import REFUSED_PATH_MESSAGE, folder_under_root
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
    """The 4xx a LoRA error maps to (every LoRAError has a code)."""
    status, code, param = _ERRORS.get(type(exc), (400, "invalid_lora_adapter", "lora_path"))
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
    """The server's view of the adapters, kept in step with the engine: (owner, name) -> the
    LoRARequest the engine runs. An owner is the tenant (key salt) that loaded the adapter;
    None: every tenant's (the start-up adapters, and every adapter when no keys are set)."""

    def __init__(
        self,
        engine,
        base_model: str,
        lora_root: str | None = None,
        is_admin: Callable[[str | None], bool] = lambda tenant: False,
    ) -> None:
        self.engine = engine  # AsyncLLMEngine
        self.base_model = base_model
        self.lora_root = lora_root
        self.is_admin = is_admin
        self.adapters: dict[tuple[str | None, str], LoRARequest] = {
            (None, r.lora_name): r for r in engine.engine.loras.list()
        }
        self._lock = asyncio.Lock()

    def _find(self, name: str, tenant: str | None) -> tuple[str | None, str] | None:
        """The key of the adapter ``name`` as ``tenant`` sees it: its own, then the shared one;
        an admin key also reaches other tenants' (the first held under that name)."""
        for key in ((tenant, name), (None, name)):
            if key in self.adapters:
                return key
        if self.is_admin(tenant):
            return next((key for key in self.adapters if key[1] == name), None)
        return None

    def _visible(self, key: tuple[str | None, str], tenant: str | None) -> bool:
        return key[0] is None or key[0] == tenant or self.is_admin(tenant)

    def resolve(self, model: str, tenant: str | None = None) -> LoRARequest | None:
        """None for the base model, the adapter for an adapter name the tenant may use; else a
        404 (another tenant's adapter is as unknown as a missing one)."""
        if model == self.base_model:
            return None
        key = self._find(model, tenant)
        if key is None:
            visible = dict.fromkeys(k[1] for k in self.adapters if self._visible(k, tenant))
            names = ", ".join([repr(self.base_model), *map(repr, visible)])
            raise APIError(
                f"the model {model!r} does not exist: this server serves {names}",
                status_code=404,
                param="model",
                code="model_not_found",
            )
        return self.adapters[key]

    def cards(self, max_model_len: int, tenant: str | None = None) -> list[ModelCard]:
        # NOTE: no `root` path: a server path tells a client nothing it may use.
        return [
            ModelCard(id=key[1], parent=self.base_model, max_model_len=max_model_len)
            for key in self.adapters
            if self._visible(key, tenant)
        ]

    def _folder(self, given: str) -> str:
        if self.lora_root is None:
            raise APIError(
                "runtime adapter loads need an adapter root: start the server with "
                "--lora-root DIR (the folder that holds the adapters)",
                param="lora_path",
                code="lora_root_not_set",
            )
        try:
            return folder_under_root(self.lora_root, given)
        except LoRAPathError as exc:
            raise api_error(exc) from None

    async def load(self, body: LoadLoRAAdapterRequest, tenant: str | None = None) -> str:
        if body.lora_name == self.base_model:
            raise APIError(
                f"{body.lora_name!r} is the base model's name: choose another adapter name",
                status_code=409,
                param="lora_name",
                code="lora_already_loaded",
            )
        folder = self._folder(body.lora_path)
        async with self._lock:
            key = (tenant, body.lora_name)
            if key in self.adapters or (None, body.lora_name) in self.adapters:
                raise api_error(
                    LoRAExistsError(f"a LoRA adapter named {body.lora_name!r} is already loaded")
                )
            int_id = max((r.lora_int_id for r in self.adapters.values()), default=0) + 1
            request = LoRARequest(engine_name(body.lora_name, tenant), int_id, folder)
            registry = self.engine.engine.loras
            try:
                # NOTE: files are read off the engine thread; the engine only registers them.
                adapter = await asyncio.to_thread(registry.read, request)
                await self.engine.call(lambda e: e.loras.add(adapter))
            except LoRAPathError:
                # NOTE: one message for every refused path (missing, not a folder, no config).
                raise api_error(LoRAPathError(REFUSED_PATH_MESSAGE)) from None
            except LoRAError as exc:
                # NOTE: the message names the folder and the adapter as the caller gave them.
                message = str(exc).replace(folder, body.lora_path)
                exc.args = (message.replace(request.lora_name, body.lora_name),)
                raise api_error(exc) from None
            self.adapters[key] = request
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest, tenant: str | None = None) -> str:
        async with self._lock:
            name = body.lora_name
            key = self._find(name, tenant)
            if key is None:
                raise api_error(LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded"))
            if key[0] != tenant and not self.is_admin(tenant):
                raise APIError(
                    f"the LoRA adapter {name!r} was given at server start: only an admin key "
                    "unloads it",
                    status_code=403,
                    err_type="permission_error",
                    param="lora_name",
                    code="lora_forbidden",
                )
            engine_name_ = self.adapters[key].lora_name
            try:
                await self.engine.call(lambda e: e.loras.remove(engine_name_))
            except LoRAError as exc:
                exc.args = (str(exc).replace(engine_name_, name),)
                raise api_error(exc) from None
            self.adapters.pop(key, None)
        return f"Success: LoRA adapter '{name}' removed successfully."


def engine_name(name: str, tenant: str | None) -> str:
    """The engine's name for a tenant's adapter ``name``: unique across tenants (a digest of
    the tenant, not the tenant), so two keys' adapters of one name never meet in the engine,
    its prefix cache or the KV store."""
    if tenant is None:
        return name
    return f"{name}@{hashlib.sha256(tenant.encode()).hexdigest()[:12]}"


def serving_lora(
    engine,
    base_model: str,
    lora_modules: Sequence[str],
    lora_root: str | None = None,
    is_admin: Callable[[str | None], bool] = lambda tenant: False,
) -> ServingLoRA | None:
    """Load the `--lora-modules` adapters into the engine (before it serves); the server's view
    of the adapters, or None when the engine has LoRA off. ``lora_root``: the folder runtime
    loads read under; ``is_admin``: whether a tenant (key salt) is an admin key's."""
    registry = engine.engine.loras
    if not registry.enabled:
        if lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    for int_id, (name, path) in enumerate(parse_lora_modules(lora_modules), start=1):
        if name == base_model:
            raise ValueError(f"--lora-modules name {name!r} is the base model's name")
        registry.add(LoRARequest(name, int_id, path))
    return ServingLoRA(engine, base_model, lora_root, is_admin)


def install_lora_routes(app: FastAPI, serving_lora: ServingLoRA) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the app's API key)."""

    # NOTE: JSON, not vLLM's plain text: every other answer of this server is JSON.
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> JSONResponse:
        message = await serving_lora.load(body, tenant_of(raw))
        return JSONResponse({"lora_name": body.lora_name, "status": "loaded", "message": message})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw: Request) -> JSONResponse:
        message = await serving_lora.unload(body, tenant_of(raw))
        return JSONResponse({"lora_name": body.lora_name, "status": "unloaded", "message": message})
