"""LoRARegistry: the engine's adapter operations (resolve, load, unload, list)."""

from __future__ import annotations

from pagedattn.engine.errors import InvalidRequestError
from pagedattn.lora.adapter import LoRAAdapter
from pagedattn.lora.request import (
    LoRADisabledError,
    LoRAError,
    LoRAInUseError,
    LoRANotFoundError,
    LoRARequest,
)


class LoRARegistry:
    """Adapters of one engine; their weights live in the runner's LoRAManager.

    Takes the three parts it works on (the runner's adapters, the scheduler's live requests, the
    KV cache manager's cached blocks), not the engine.
    NOTE: engine-thread only, except ``read`` (files only), which a server runs off the loop.
    """

    def __init__(self, runner, scheduler, kv_cache_manager, base_model: str) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.base_model = base_model

    @property
    def manager(self):
        manager = self.runner.lora_manager
        if manager is None:
            raise LoRADisabledError(
                "LoRA adapters are off: start the engine with enable_lora=True (--enable-lora)"
            )
        return manager

    @property
    def enabled(self) -> bool:
        return self.runner.lora_manager is not None

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter's files; registers nothing."""
        return self.manager.read(request)

    def add(self, request_or_adapter: LoRARequest | LoRAAdapter) -> None:
        """Register an adapter (read now if given as a LoRARequest); LoRAExistsError if taken."""
        adapter = request_or_adapter
        if isinstance(adapter, LoRARequest):
            adapter = self.read(adapter)
        self.manager.add(adapter)

    def resolve(self, request: LoRARequest) -> str:
        """The adapter key (name and content) a request runs under; loads it on first use.

        NOTE: the key is the request's lora_id, so it enters every block hash: other weights
        loaded later under the same name never hit this adapter's cached or stored blocks.

        Raises InvalidRequestError if it cannot be loaded."""
        try:
            known = self.manager.adapters.get(request.lora_name)
            if known is None:
                self.add(request)
                known = self.manager.adapters[request.lora_name]
            elif known.int_id != request.lora_int_id:
                raise LoRAError(
                    f"LoRA {request.lora_name!r} is loaded with id {known.int_id}, not "
                    f"{request.lora_int_id}"
                )
        except LoRAError as exc:
            raise InvalidRequestError(str(exc), param="lora_request") from exc
        return known.key

    def remove(self, name: str) -> int:
        """Unload an adapter and drop its cached KV blocks; returns the blocks dropped.

        LoRAInUseError while a live request runs under it; LoRANotFoundError if not loaded."""
        manager = self.manager
        adapter = manager.adapters.get(name)
        if adapter is None:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded")
        users = [r for r in self.scheduler.requests.values() if r.lora_id == adapter.key]
        if users:
            raise LoRAInUseError(
                f"LoRA {name!r} serves {len(users)} live request(s): unload it once they end"
            )
        manager.remove(name)
        return self.kv_cache_manager.uncache_lora_blocks(adapter.key)

    def list(self) -> list[LoRARequest]:
        """The loaded adapters, in load order."""
        if not self.enabled:
            return []
        return [LoRARequest(a.name, a.int_id, a.path) for a in self.manager.adapters.values()]
