"""LoRARequest: which adapter a request runs under (vLLM's shape), and the adapter errors."""

from __future__ import annotations

from dataclasses import dataclass


class LoRAError(ValueError):
    """An adapter cannot be used; the message says what to change."""


class LoRAPathError(LoRAError):
    """The adapter's folder or one of its files is missing or unreadable."""


class LoRAFormatError(LoRAError):
    """The adapter's config or weights are not a PEFT LoRA this engine can apply."""


class LoRARankError(LoRAError):
    """The adapter's rank is above --max-lora-rank."""


class LoRAExistsError(LoRAError):
    """An adapter of that name (or id) is already loaded."""


class LoRANotFoundError(LoRAError):
    """No adapter of that name is loaded."""


class LoRAInUseError(LoRAError):
    """The adapter still serves live requests."""


class LoRADisabledError(LoRAError):
    """The engine was started without --enable-lora."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, integer id (> 0) and path of a PEFT folder
    (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError("a LoRARequest needs a non-empty name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"LoRARequest {self.lora_name!r}: id must be an int >= 1")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
