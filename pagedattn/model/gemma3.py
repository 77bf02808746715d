"""Gemma 3 text: sliding-window and global layers, (1 + w) norms, GeGLU, soft-capping."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedattn.attention.backends.base import AttentionBackend
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.cpu.plan import KernelPlan
from pagedattn.model.base import PagedCausalLM, group_layers, head_kernels, linear_kernels
from pagedattn.model.layers import (
    Embedding,
    GemmaRMSNorm,
    Linear,
    PagedAttention,
    RotaryEmbedding,
    apply_rotary_,
    gelu_tanh_and_mul,
)
from pagedattn.model.text_config import TextConfig

SLIDING = "sliding_attention"
FULL = "full_attention"

# Prefixes of the multimodal checkpoint (Gemma3ForConditionalGeneration) -> text-only names.
_MULTIMODAL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.")
_VISION_PREFIXES += ("model.multi_modal_projector.",)


class Gemma3Attention(nn.Module):
    """Fused QKV, per-head q/k norms, rope of the layer's type, paged (sliding) attention."""

    def __init__(
        self, config: TextConfig, backend: AttentionBackend, is_sliding: bool, plan: KernelPlan
    ):
        super().__init__()
        self.step_ops = plan.step_ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = config.head_dim
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        bias = bool(config.attention_bias)
        kernels = linear_kernels(plan)
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(config.hidden_size, qkv_size, bias, kernels)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias, kernels)
        self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps, plan.step_ops)
        self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps, plan.step_ops)
        self.is_sliding = is_sliding
        self.attn = PagedAttention(
            backend,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=config.sliding_window if is_sliding else None,
            logits_soft_cap=config.attn_logit_softcapping,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; ``rope`` maps is_sliding to that layer type's (cos, sin)."""
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_size))  # [T, Hq, D]
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_size))  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        cos, sin = rope[self.is_sliding]
        # fresh tensors: rotated in place
        q, k = apply_rotary_(q, cos, sin, self.step_ops), apply_rotary_(k, cos, sin, self.step_ops)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class Gemma3MLP(nn.Module):
    """GeGLU (gelu-tanh) MLP with a fused gate/up projection."""

    def __init__(self, config: TextConfig, plan: KernelPlan) -> None:
        super().__init__()
        kernels, inter = linear_kernels(plan), config.intermediate_size
        self.step_ops = plan.step_ops
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, False, kernels)
        self.down_proj = Linear(inter, config.hidden_size, False, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x), self.step_ops))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: norm -> attention -> norm -> residual, norm -> MLP -> norm -> residual."""

    def __init__(
        self, config: TextConfig, backend: AttentionBackend, is_sliding: bool, plan: KernelPlan
    ):
        super().__init__()
        eps, hidden, ops = config.rms_norm_eps, config.hidden_size, plan.step_ops
        self.self_attn = Gemma3Attention(config, backend, is_sliding, plan)
        self.mlp = Gemma3MLP(config, plan)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, ops)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ops)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [T, H] -> [T, H]."""
        attn = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    """Embedding, decoder layers and final norm (HF parameter names)."""

    def __init__(
        self,
        config: TextConfig,
        backend: AttentionBackend,
        sliding: list[bool],
        plan: KernelPlan,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, backend, s, plan) for s in sliding)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, plan.step_ops)


class Gemma3ForCausalLM(PagedCausalLM):
    """Gemma 3 text causal LM over a paged KV cache with a sliding and a global cache group."""

    def __init__(
        self,
        config: TextConfig,
        backend: AttentionBackend,
        architecture: str,
        plan: KernelPlan = KernelPlan(),
    ) -> None:
        super().__init__()
        self.plan = plan
        sliding = [t == SLIDING for t in config.layer_types]
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = config.head_dim
        self.embed_scale = config.hidden_size**0.5
        self.layer_group, self.group_windows = group_layers(
            [config.sliding_window if s else None for s in sliding]
        )
        q_size = config.num_attention_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        self.shard_sizes = {
            "qkv_proj": [q_size, kv_size, kv_size],
            "gate_up_proj": [config.intermediate_size] * 2,
        }
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        self.final_logit_softcapping = config.final_logit_softcapping
        self.model = Gemma3Model(config, backend, sliding, plan)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, head_kernels(plan))
        self.rope = {
            True: RotaryEmbedding(config, self.head_size, layer_type=SLIDING),
            False: RotaryEmbedding(config, self.head_size, layer_type=FULL),
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: list[AttentionMetadata],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H]."""
        hidden = self.model.embed_tokens(input_ids)  # [T, H]
        # NOTE: HF rounds the scale to the weight dtype before multiplying (matters in bf16).
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        rope = {s: r.cos_sin(positions, hidden.dtype) for s, r in self.rope.items()}
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, rope, kv_caches[i], attn_metadata[self.layer_group[i]])
        return self.model.norm(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load text weights, also from a multimodal (ConditionalGeneration) checkpoint."""
        super().load_weights(_text_only(weights))


def _text_only(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, replacement in _MULTIMODAL_PREFIXES.items():
            if name.startswith(prefix):
                name = replacement + name[len(prefix) :]
                break
        yield name, tensor
