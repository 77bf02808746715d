"""Issue 52: tenants own their LoRA adapters (ServingLoRA over a stand-in engine: no model).

The live server runs the same rules in tests/lora/test_lora_server.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pagedattn.entrypoints.openai.lora_routes import (
    LoadLoRAAdapterRequest,
    ServingLoRA,
    UnloadLoRAAdapterRequest,
)
from pagedattn.entrypoints.openai.protocol import APIError
from pagedattn.lora.adapter import REFUSED_PATH_MESSAGE, folder_under_root
from pagedattn.lora.request import LoRANotFoundError, LoRAPathError, LoRARequest

ADMIN, ONE, TWO = "tenant-admin", "tenant-1", "tenant-2"


class _Registry:
    """The engine's LoRARegistry, as far as ServingLoRA uses it: reads need a folder."""

    def __init__(self) -> None:
        self.loaded: dict[str, LoRARequest] = {"shared": LoRARequest("shared", 1, "/srv/shared")}

    def list(self) -> list[LoRARequest]:
        return list(self.loaded.values())

    def read(self, request: LoRARequest) -> LoRARequest:
        if not (Path(request.lora_path) / "adapter_config.json").is_file():
            raise LoRAPathError(f"LoRA path {request.lora_path!r} has no adapter_config.json")
        return request

    def add(self, request: LoRARequest) -> None:
        self.loaded[request.lora_name] = request

    def remove(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise LoRANotFoundError(name)


class _Engine:
    def __init__(self) -> None:
        self.engine = type("E", (), {})()
        self.engine.loras = _Registry()

    async def call(self, fn):
        return fn(self.engine)


@pytest.fixture
def loras(tmp_path) -> ServingLoRA:
    for name in ("a", "b"):
        (tmp_path / "root" / name).mkdir(parents=True)
        (tmp_path / "root" / name / "adapter_config.json").write_text("{}")
    return ServingLoRA(_Engine(), "base", str(tmp_path / "root"), lambda t: t == ADMIN)


def _run(coro):
    return asyncio.run(coro)


def _error(coro) -> APIError:
    with pytest.raises(APIError) as info:
        _run(coro)
    return info.value


def test_a_runtime_adapter_is_its_loaders_and_the_admins(loras):
    _run(loras.load(LoadLoRAAdapterRequest(lora_name="mine", lora_path="a"), ONE))
    assert loras.resolve("mine", ONE).lora_name.startswith("mine@")
    assert loras.resolve("mine", ADMIN) is loras.resolve("mine", ONE)
    missing = _error_sync(lambda: loras.resolve("mine", TWO))
    assert missing.status_code == 404 and "mine" not in str(missing).partition("serves")[2]
    assert [c.id for c in loras.cards(512, TWO)] == ["shared"]
    assert [c.id for c in loras.cards(512, ONE)] == ["shared", "mine"]
    assert all(c.root is None for c in loras.cards(512, ONE))
    unload = UnloadLoRAAdapterRequest(lora_name="mine")
    assert _error(loras.unload(unload, TWO)).code == "lora_not_found"
    # Start-up adapters: every tenant's, unloaded by an admin only.
    assert loras.resolve("shared", TWO).lora_name == "shared"
    shared = UnloadLoRAAdapterRequest(lora_name="shared")
    assert _error(loras.unload(shared, TWO)).code == "lora_forbidden"
    _run(loras.unload(unload, ADMIN))
    _run(loras.unload(shared, ADMIN))
    assert loras.cards(512, ONE) == []


def test_two_keys_name_adapters_apart(loras):
    """A 409 for a name another key holds told a key what the other had loaded (issue 52): each
    key now names its adapters apart; only its own names and the shared ones are taken."""
    _run(loras.load(LoadLoRAAdapterRequest(lora_name="a", lora_path="a"), ONE))
    _run(loras.load(LoadLoRAAdapterRequest(lora_name="a", lora_path="b"), TWO))
    one, two = loras.resolve("a", ONE), loras.resolve("a", TWO)
    assert one.lora_path.endswith("/a") and two.lora_path.endswith("/b")
    engine = loras.engine.engine.loras.loaded
    assert {one.lora_name, two.lora_name, "shared"} == set(engine) and one.lora_name != "a"
    assert TWO not in two.lora_name  # a digest of the tenant, not the tenant
    for name, tenant in (("a", ONE), ("shared", TWO)):
        taken = _error(loras.load(LoadLoRAAdapterRequest(lora_name=name, lora_path="a"), tenant))
        assert taken.code == "lora_already_loaded"
    assert [c.id for c in loras.cards(512, TWO)] == ["shared", "a"]
    _run(loras.unload(UnloadLoRAAdapterRequest(lora_name="a"), TWO))
    assert loras.resolve("a", ONE) is one
    assert _error_sync(lambda: loras.resolve("a", TWO)).code == "model_not_found"


def test_every_refused_path_gets_one_message(loras, tmp_path):
    (tmp_path / "root" / "empty").mkdir()
    (tmp_path / "root" / "out").symlink_to(tmp_path)
    messages = set()
    for given in ("/etc", str(tmp_path), "../..", "out", "missing", "empty", "a/../../root/a/.."):
        error = _error(loras.load(LoadLoRAAdapterRequest(lora_name="x", lora_path=given), ONE))
        assert error.code == "invalid_lora_path"
        messages.add(str(error))
    assert messages == {REFUSED_PATH_MESSAGE}
    assert folder_under_root(str(tmp_path / "root"), "b") == str(tmp_path / "root" / "b")


def test_runtime_loads_need_a_root():
    loras = ServingLoRA(_Engine(), "base")
    load = LoadLoRAAdapterRequest(lora_name="x", lora_path="/anything")
    assert _error(loras.load(load, ONE)).code == "lora_root_not_set"


def _error_sync(fn) -> APIError:
    with pytest.raises(APIError) as info:
        fn()
    return info.value
