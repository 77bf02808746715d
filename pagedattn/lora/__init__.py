"""LoRA adapters: many adapters in one batch over one base model (punica-style shrink/expand)."""

from pagedattn.lora.request import LoRARequest

__all__ = ["LoRARequest"]
