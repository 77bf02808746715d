"""Which model class serves which HF ``architectures`` entry."""

from __future__ import annotations

from transformers import PreTrainedConfig

from pagedattn.model.base import PagedCausalLM
from pagedattn.model.gemma3 import Gemma3ForCausalLM
from pagedattn.model.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[PagedCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # Text-only use of the multimodal checkpoint: its vision tower is skipped at load.
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no model class here."""


def resolve_architecture(config: PreTrainedConfig) -> tuple[str, type[PagedCausalLM]]:
    """The first supported entry of ``config.architectures`` and its model class."""
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise UnsupportedArchitectureError(
        f"model architecture {architectures or '(none given)'} is not supported; "
        f"supported architectures: {', '.join(sorted(MODEL_REGISTRY))}"
    )


def text_config(architecture: str, config: PreTrainedConfig) -> PreTrainedConfig:
    """The config the text model is built from (the nested text config of a multimodal one)."""
    if architecture == "Gemma3ForConditionalGeneration":
        return config.text_config
    return config
