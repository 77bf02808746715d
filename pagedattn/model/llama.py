"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (qkv bias) and Qwen3 (q/k norm)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from pagedattn.attention.backends.base import AttentionBackend
from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.cpu.decode_stack import (
    DecodeStack,
    StackLayer,
    build_decode_stack,
    verify_layer,
)
from pagedattn.cpu.plan import KernelPlan
from pagedattn.model.base import PagedCausalLM, group_layers, head_kernels, linear_kernels
from pagedattn.model.layers import (
    Embedding,
    Linear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary_,
    silu_and_mul,
)
from pagedattn.model.moe import SparseMoEBlock
from pagedattn.model.text_config import TextConfig


@dataclass(frozen=True)
class LlamaVariant:
    """What differs between the Llama-family checkpoints that share this code."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @staticmethod
    def from_config(architecture: str, config: TextConfig) -> LlamaVariant:
        """The variant for an HF ``architectures`` entry and its config."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        if architecture == "Qwen2ForCausalLM":
            # NOTE: Qwen2 always has q/k/v biases and never an o_proj bias.
            return LlamaVariant(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
        if architecture == "Qwen3ForCausalLM":
            return LlamaVariant(attention_bias, attention_bias, mlp_bias=False, qk_norm=True)
        return LlamaVariant(attention_bias, attention_bias, mlp_bias, qk_norm=False)


def layer_windows(config: TextConfig) -> list[int | None]:
    """Sliding window of each layer: from ``layer_types`` when present, else ``sliding_window``."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * config.num_hidden_layers


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional q/k RMSNorm, rope, paged attention, output projection."""

    def __init__(
        self,
        config: TextConfig,
        variant: LlamaVariant,
        backend: AttentionBackend,
        sliding_window: int | None,
        plan: KernelPlan,
    ) -> None:
        super().__init__()
        self.step_ops = plan.step_ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = config.head_dim
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        hidden = config.hidden_size
        kernels = linear_kernels(plan)
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(hidden, qkv_size, variant.qkv_bias, kernels)
        self.o_proj = Linear(self.q_size, hidden, variant.o_bias, kernels)
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps, plan.step_ops)
            self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps, plan.step_ops)
        self.qk_norm = variant.qk_norm
        self.attn = PagedAttention(
            backend,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            scale=self.head_size**-0.5,
            sliding_window=sliding_window,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [T, H] -> [T, H]."""
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        if not self.qk_norm:
            # q and k side by side: one rotation over [T, num_heads + num_kv_heads, head_size].
            qk = qkv[:, : self.q_size + self.kv_size]
            apply_rotary_(qk.view(qkv.shape[0], -1, self.head_size), cos, sin, self.step_ops)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_size)  # [T, num_heads, head_size]
        k = k.view(-1, self.num_kv_heads, self.head_size)  # [T, num_kv_heads, head_size]
        v = v.view(-1, self.num_kv_heads, self.head_size)  # [T, num_kv_heads, head_size]
        if self.qk_norm:
            # NOTE: heads as rows [T * heads, head_size], so that the compiled RMSNorm and rotary
            # take them (a 3-D strided view ran ~30 PyTorch ops per layer).
            rows, size = qkv.shape[0], self.head_size
            q = self.q_norm(q.reshape(-1, size)).view(rows, self.num_heads, size)
            k = self.k_norm(k.reshape(-1, size)).view(rows, self.num_kv_heads, size)
            q, k = (
                apply_rotary_(q, cos, sin, self.step_ops),
                apply_rotary_(k, cos, sin, self.step_ops),
            )
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class LlamaMLP(nn.Module):
    """SwiGLU MLP with a fused gate/up projection."""

    def __init__(self, config: TextConfig, bias: bool, plan: KernelPlan) -> None:
        super().__init__()
        inter = config.intermediate_size
        kernels = linear_kernels(plan)
        self.step_ops = plan.step_ops
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias, kernels)
        self.down_proj = Linear(inter, config.hidden_size, bias, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.step_ops))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual connection."""

    def __init__(
        self,
        config: TextConfig,
        variant: LlamaVariant,
        backend: AttentionBackend,
        sliding_window: int | None,
        plan: KernelPlan,
    ) -> None:
        super().__init__()
        eps, ops = config.rms_norm_eps, plan.step_ops
        self.self_attn = LlamaAttention(config, variant, backend, sliding_window, plan)
        self.mlp = LlamaMLP(config, variant.mlp_bias, plan)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [T, H] each -> the same after this layer.

        The residual stream is carried separately (as in vLLM) so that each residual add is
        fused into the RMSNorm that follows it: the sum equals HF's ``residual + hidden``.
        """
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF parameter names)."""

    def __init__(
        self,
        config: TextConfig,
        variant: LlamaVariant,
        backend: AttentionBackend,
        windows: list[int | None],
        plan: KernelPlan,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, variant, backend, w, plan) for w in windows
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, plan.step_ops)


class LlamaForCausalLM(PagedCausalLM):
    """Llama-family causal LM over a paged KV cache."""

    def __init__(
        self,
        config: TextConfig,
        backend: AttentionBackend,
        architecture: str,
        plan: KernelPlan = KernelPlan(),
    ) -> None:
        super().__init__()
        self.plan = plan
        if getattr(config, "head_dim", None) is None:
            config.head_dim = config.hidden_size // config.num_attention_heads
        variant = LlamaVariant.from_config(architecture, config)
        windows = layer_windows(config)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = config.head_dim
        self.layer_group, self.group_windows = group_layers(windows)
        q_size = config.num_attention_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        self.shard_sizes = {
            "qkv_proj": [q_size, kv_size, kv_size],
            "gate_up_proj": [config.intermediate_size] * 2,
        }
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        self.model = LlamaModel(config, variant, backend, windows, plan)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, head_kernels(plan))
        self.rotary_emb = RotaryEmbedding(config, self.head_size)
        self.qk_norm = variant.qk_norm
        self.decode_stack: DecodeStack | None = None
        self.verify_stack: DecodeStack | None = None  # on plan.linear_verify's kernels

    def process_weights_after_loading(self) -> None:
        """Pack the weights (PagedCausalLM), then build the compiled decode stack over them where
        the plan asks for it and the model allows it (one epsilon)."""
        super().process_weights_after_loading()
        layers = self.model.layers
        # NOTE: the stack runs the compiled step ops: with them off (step_ops) it is off too.
        plan = self.plan
        if not (plan.decode_stack and plan.step_ops and len(layers)):
            return
        first = layers[0].self_attn
        # NOTE: the backend was built for the plan; the stack runs its decode kernel only.
        backend = first.attn.backend
        if not (isinstance(backend, CpuBackend) and backend.uses_compiled_decode):
            return
        if self.model.norm.weight.device.type != "cpu":
            return
        stack_layers = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            qk_norm = moe = None
            if self.qk_norm:
                if not attn.q_norm.eps == attn.k_norm.eps == layer.input_layernorm.eps:
                    return  # NOTE: the stack takes one epsilon
                qk_norm = (attn.q_norm.weight, attn.k_norm.weight)
            if isinstance(mlp, SparseMoEBlock):
                moe = mlp
            stack_layers.append(
                StackLayer(
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    layer.input_layernorm.eps,
                    attn.qkv_proj,
                    attn.o_proj,
                    None if moe is not None else mlp.gate_up_proj,
                    None if moe is not None else mlp.down_proj,
                    self.layer_group[i],
                    attn.attn.sliding_window,
                    attn.attn.scale,
                    qk_norm,
                    moe,
                )
            )
        build = functools.partial(
            build_decode_stack,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=self.dtype,
            amx_attention=backend.uses_amx_decode,
        )
        self.decode_stack = build(stack_layers)
        if self.decode_stack is not None and first.qkv_proj.verify is not None:
            # NOTE: the same stack over the layers' verify kernels (plan.linear_verify), for the
            # steps that verify draft tokens (AttentionMetadata.verifies_drafts).
            self.verify_stack = build([verify_layer(layer) for layer in stack_layers])

    def _attention_layers(self) -> list:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: list[AttentionMetadata],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H]."""
        hidden = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)  # [T, 1, head_size] each
        stack = self.decode_stack
        rows = hidden.shape[0]
        if stack is not None and self.verify_stack is not None and attn_metadata[0].verifies_drafts:
            stack = self.verify_stack if 2 <= rows < self.plan.verify_rows else stack
        # NOTE: a layer still waiting for its fp8 scales (--calculate-kv-scales) sets them in
        # PagedAttention.forward, which the stack bypasses: run the layers until it has.
        pending_scales = stack is not None and any(
            a.calculate_kv_scales for a in self._attention_layers()
        )
        if (
            stack is not None
            and not pending_scales
            and stack.usable(hidden.shape[0], kv_caches, attn_metadata)
        ):
            scales = ()
            if kv_caches[0][0].element_size() == 1:  # fp8: the layers' k/v scales
                scales = [(a.k_scale, a.v_scale) for a in self._attention_layers()]
            hidden, residual = stack.forward(hidden, cos, sin, kv_caches, attn_metadata, scales)
            return self.model.norm.add_and_norm(hidden, residual)[0]
        residual = None
        for i, layer in enumerate(self.model.layers):
            metadata = attn_metadata[self.layer_group[i]]
            hidden, residual = layer(hidden, residual, cos, sin, kv_caches[i], metadata)
        if residual is None:  # no layers
            return self.model.norm(hidden)
        return self.model.norm.add_and_norm(hidden, residual)[0]
