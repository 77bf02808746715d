"""Qwen3-MoE (Qwen3's attention with q/k norm, softmax top-k experts) and the MoE model base."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from torch import nn

from pagedattn.attention.backends.base import AttentionBackend
from pagedattn.cpu.plan import KernelPlan
from pagedattn.model.llama import LlamaForCausalLM
from pagedattn.model.moe import (
    ExpertLoader,
    MoESpec,
    MoETextConfig,
    SparseMoEBlock,
)
from pagedattn.model.text_config import TextConfig


class MoECausalLM(LlamaForCausalLM):
    """A Llama-family model whose sparse layers run a SparseMoEBlock instead of the dense MLP.

    Subclasses name the dense architecture whose attention theirs is, the block of a config,
    which layers are sparse and the checkpoint's names of an expert's projections.
    """

    attention_architecture: ClassVar[str]
    # Checkpoint name of an expert projection -> (stacked parameter, gate/up shard or None).
    expert_projections: ClassVar[dict[str, tuple[str, int | None]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", None),
    }

    def __init__(
        self,
        config: TextConfig,
        backend: AttentionBackend,
        architecture: str,
        plan: KernelPlan = KernelPlan(),
    ) -> None:
        spec = self.moe_spec(config)
        super().__init__(config, backend, self.attention_architecture, plan)
        self.architecture = architecture
        self.moe = spec
        for i, layer in enumerate(self.model.layers):
            if self.is_sparse(config, i):
                kernel = plan.linear_decode
                layer.mlp = SparseMoEBlock(
                    config.hidden_size,
                    spec,
                    plan.step_ops,
                    kernel,
                    plan.quant_prefill_rows,
                    plan.quant_amx_rows,
                )
        self._experts: ExpertLoader | None = None

    def moe_spec(self, config: TextConfig) -> MoESpec:
        """The sparse block of ``config``; UnsupportedMoEError for a variant not run here."""
        raise NotImplementedError

    def is_sparse(self, config: TextConfig, index: int) -> bool:
        """Whether layer ``index`` runs the sparse block (else the dense MLP)."""
        return True

    def checkpoint_name(self, hf_name: str) -> str:
        """A checkpoint tensor's name in this model's module tree."""
        return hf_name

    def process_weights_after_loading(self) -> None:
        """Pack the experts (the fused blocks), then the dense projections and the compiled
        decode stack over both (LlamaForCausalLM)."""
        for module in self.modules():
            if isinstance(module, SparseMoEBlock):
                module.process_weights_after_loading()
        super().process_weights_after_loading()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Experts' tensors into the stacked [E, ...] parameters, the rest as the dense model."""
        self._experts = ExpertLoader(self, self.expert_projections)
        renamed = ((self.checkpoint_name(name), tensor) for name, tensor in weights)
        try:
            super().load_weights(self._experts.filter(renamed))
        finally:
            self._experts = None

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set) -> None:
        assert self._experts is not None
        self._experts.check_complete()
        stacked = self._experts.stacked_names()
        super()._check_all_loaded({n: p for n, p in params.items() if n not in stacked}, loaded)


class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3-MoE: top-k of num_experts, renormalised when norm_topk_prob; dense layers where
    mlp_only_layers or decoder_sparse_step say."""

    attention_architecture = "Qwen3ForCausalLM"

    def moe_spec(self, config: TextConfig) -> MoESpec:
        size = config.moe_intermediate_size if isinstance(config, MoETextConfig) else None
        norm = config.norm_topk_prob if isinstance(config, MoETextConfig) else None
        return MoESpec.from_config(config, size, norm)

    def is_sparse(self, config: TextConfig, index: int) -> bool:
        assert isinstance(config, MoETextConfig)
        step = config.decoder_sparse_step
        return index not in config.mlp_only_layers and step > 0 and (index + 1) % step == 0
