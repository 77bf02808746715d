"""Mixtral: Mistral's attention with a softmax top-2 router over SwiGLU experts (w1/w3/w2)."""

from __future__ import annotations

from typing import ClassVar

from pagedattn.model.moe import MoESpec
from pagedattn.model.qwen3_moe import MoECausalLM
from pagedattn.model.text_config import TextConfig


class MixtralForCausalLM(MoECausalLM):
    """Mixtral: every layer sparse, top-k probabilities always renormalised; the expert FFN
    size is intermediate_size."""

    attention_architecture = "MistralForCausalLM"
    # NOTE: w1 is the gate, w3 the up projection, w2 the down projection.
    expert_projections: ClassVar[dict[str, tuple[str, int | None]]] = {
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", None),
    }

    def moe_spec(self, config: TextConfig) -> MoESpec:
        return MoESpec.from_config(config, config.intermediate_size, renormalize=True)

    def checkpoint_name(self, hf_name: str) -> str:
        return hf_name.replace(".block_sparse_moe.", ".mlp.")
