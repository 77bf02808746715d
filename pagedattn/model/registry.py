"""Which model class serves which HF ``architectures`` entry."""

from __future__ import annotations

from typing import Any

from pagedattn.model.base import PagedCausalLM
from pagedattn.model.gemma3 import Gemma3ForCausalLM
from pagedattn.model.llama import LlamaForCausalLM
from pagedattn.model.mixtral import MixtralForCausalLM
from pagedattn.model.moe import MoETextConfig
from pagedattn.model.qwen3_moe import Qwen3MoeForCausalLM
from pagedattn.model.text_config import TextConfig

MODEL_REGISTRY: dict[str, type[PagedCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # Text-only use of the multimodal checkpoint: its vision tower is skipped at load.
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
# Architectures whose config carries more than TextConfig's keys -> the config class to read.
CONFIG_CLASSES: dict[str, type[TextConfig]] = {
    "Qwen3MoeForCausalLM": MoETextConfig,
    "MixtralForCausalLM": MoETextConfig,
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no model class here."""


def resolve_architecture(config: dict[str, Any]) -> tuple[str, type[PagedCausalLM]]:
    """The first supported entry of a config dict's ``architectures`` and its model class."""
    architectures = list(config.get("architectures") or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise UnsupportedArchitectureError(
        f"model architecture {architectures or '(none given)'} is not supported; "
        f"supported architectures: {', '.join(sorted(MODEL_REGISTRY))}"
    )


def text_config(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """The config dict the text model is built from (the nested text config of a multimodal one)."""
    if architecture == "Gemma3ForConditionalGeneration":
        return config["text_config"]
    return config


def config_class(architecture: str) -> type[TextConfig]:
    """The TextConfig class an architecture's config dict is read into."""
    return CONFIG_CLASSES.get(architecture, TextConfig)
