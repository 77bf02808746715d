"""Decode steps of a Llama-family model in one compiled call (csrc/decode_stack_cpu.cpp).

Qwen3's per-head q/k norms and sparse MoE layers (router, softmax top-k, the fused experts of
csrc/moe_cpu.cpp) run in it too.

The compiled DecodeStack runs the kernels the Python decoder layers call, in the same order and
on the same packed linear kernels, so its hidden states are bit-identical to the Python layers';
it saves the interpreter between ~25 small calls per layer. The model builds it once, after its
weights are packed, where the plan asks for it (KernelPlan.decode_stack) and the layers allow
an exact match: float32/bfloat16, the extension's decode attention, one RMSNorm epsilon and one
attention scale. It runs a step only when every row is a decode row, the KV cache has the model's
dtype and the rows are below every layer's prefill split.

With LoRA on, the stack also adds each row's adapter delta after each projection (set_lora:
csrc/lora_cpu.cpp over LoRALinear's slot buffers, the step's slots from the shared LoRABatch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

from pagedattn.cpu import extension
from pagedattn.cpu.linear import PackedLinear, compiled_linear


class PackedLayer(Protocol):
    """A linear layer as the stack reads it (pagedattn.model.layers.Linear)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    out_features: int
    decode: PackedLinear | None
    prefill_rows: float


class MoEBlock(Protocol):
    """A sparse MoE block as the stack reads it (pagedattn.model.moe.SparseMoEBlock)."""

    fused: Any  # the extension's MoEExperts over the packed experts, or None
    router: PackedLinear | None  # None: F.linear on gate.weight
    gate: Any  # .weight [E, H]
    spec: Any  # .num_experts, .top_k, .renormalize


class StackLayer(NamedTuple):
    """One decoder layer's weights and settings, as the compiled stack takes them."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    eps: float
    qkv: PackedLayer
    o: PackedLayer
    gate_up: PackedLayer | None  # the dense MLP's (None where moe is set)
    down: PackedLayer | None
    group: int  # KV cache group of the layer
    sliding_window: int | None
    scale: float
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # per-head norm weights (Qwen3)
    moe: MoEBlock | None = None  # the sparse block that replaces the dense MLP


class LoRASlots(Protocol):
    """A projection's LoRA slot buffers, as the stack reads them (lora.layers.LoRALinear)."""

    lora_a: torch.Tensor  # [max_loras, in, S * max_rank]
    lora_b: list[torch.Tensor]  # per output slice [max_loras * max_rank, out_i]
    max_loras: int
    max_rank: int


class LoRARows(Protocol):
    """The step's LoRA rows (pagedattn.lora.layers.LoRABatch): slots None when no row adapts."""

    slots: torch.Tensor | None  # [T] int64, -1: no adapter


# The stack's projections in its set_lora numbering, by LoRAManager's module names.
LORA_PROJECTIONS = {"qkv_proj": 0, "o_proj": 1, "gate_up_proj": 2, "down_proj": 3}


class StepMetadata(Protocol):
    """What the stack reads of one KV cache group's attention metadata."""

    is_pure_decode: bool
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


class _VerifyLinear(NamedTuple):
    """A layer as the stack reads it, with its verify kernel in the decode kernel's place."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    out_features: int
    decode: PackedLinear | None
    prefill_rows: float


def verify_layer(layer: StackLayer) -> StackLayer:
    """``layer`` with each projection's verify kernel (Linear.verify) as its decode kernel."""

    def swap(linear) -> _VerifyLinear | None:
        if linear is None:  # an MoE layer's MLP: its experts have no verify kernel
            return None
        packed = linear.verify if linear.verify is not None else linear.decode
        return _VerifyLinear(
            linear.weight, linear.bias, linear.out_features, packed, linear.prefill_rows
        )

    return layer._replace(
        qkv=swap(layer.qkv), o=swap(layer.o), gate_up=swap(layer.gate_up), down=swap(layer.down)
    )


def _decode_linear(ext, layer: PackedLayer):
    """(the compiled DecodeLinear of the layer's decode kernel, rows from which it prefills)."""
    packed = layer.decode
    if packed is None:  # never packed: plain F.linear
        return ext.DecodeLinear(0, layer.weight, None, layer.bias, layer.out_features), math.inf
    linear = compiled_linear(ext, packed)
    if packed.name == "gguf":
        # NOTE: the QuantLinear picks dot kernels or tiles by rows itself, so a stack of GGUF
        # layers bounds no rows.
        return linear, math.inf
    return linear, layer.prefill_rows


class DecodeStack:
    """The compiled stack of one model plus the conditions under which a step may use it."""

    def __init__(self, compiled, max_rows: float, dtype: torch.dtype) -> None:
        self.compiled = compiled
        self.max_rows = max_rows  # rows at or past this run the prefill linear kernel
        self.dtype = dtype
        self.lora_rows: LoRARows | None = None

    def set_lora(self, rows: LoRARows, layers: dict[tuple[int, str], LoRASlots]) -> None:
        """Add each row's LoRA delta after the projections ``layers`` ((layer index, module
        name) -> slot buffers, shared: slot loads need nothing more), for the rows ``rows``
        names at each step."""
        for (index, name), slots in layers.items():
            self.compiled.set_lora(
                index,
                LORA_PROJECTIONS[name],
                slots.lora_a,
                slots.lora_b,
                slots.max_loras,
                slots.max_rank,
            )
        self.lora_rows = rows

    def usable(
        self,
        num_tokens: int,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Sequence[StepMetadata],
    ) -> bool:
        """Whether this step can run on the stack (all rows decode, the cache in our dtype, fp8
        or u8)."""
        first = attn_metadata[0]
        return (
            0 < num_tokens < self.max_rows
            and first.is_pure_decode
            and first.num_actual_tokens == num_tokens
            and (
                kv_caches[0][0].dtype == self.dtype
                or kv_caches[0][0].dtype in extension.QUANTIZED_CACHE_DTYPES
            )
            and kv_caches[0][0].dim() == 4
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Sequence[StepMetadata],
        kv_scales: Sequence[tuple[float, float]] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H], cos/sin [T, 1, D] -> (hidden, residual) after the last layer;
        kv_scales: each layer's (k_scale, v_scale) of an fp8 cache (empty: 1.0)."""
        num_tokens = hidden.shape[0]
        return self.compiled.forward(
            hidden,
            cos.reshape(num_tokens, -1),
            sin.reshape(num_tokens, -1),
            kv_caches,
            [m.slot_mapping for m in attn_metadata],
            [m.block_tables for m in attn_metadata],
            [m.seq_lens for m in attn_metadata],
            list(kv_scales),
            None if self.lora_rows is None else self.lora_rows.slots,
        )


def build_decode_stack(
    layers: Sequence[StackLayer],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    amx_attention: bool,
) -> DecodeStack | None:
    """A DecodeStack over ``layers``, or None where it could not match the Python layers exactly
    (no extension, another dtype or head size, mixed epsilons or scales)."""
    ext = extension.step_ops()
    if ext is None or not hasattr(ext, "DecodeStack") or not layers:
        return None
    if dtype not in extension.SUPPORTED_DTYPES or head_size % extension.HEAD_SIZE_MULTIPLE:
        return None
    first = layers[0]
    if any(layer.eps != first.eps or layer.scale != first.scale for layer in layers):
        return None
    compiled = ext.DecodeStack(
        num_heads,
        num_kv_heads,
        head_size,
        first.eps,
        first.scale,
        extension.DEFAULT_PARTITION_SIZE,
        amx_attention,
    )
    max_rows = math.inf
    for index, layer in enumerate(layers):
        linears = []
        for packed in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if packed is None:  # an MoE layer's MLP
                linears.append(None)
                continue
            linear, rows = _decode_linear(ext, packed)
            linears.append(linear)
            max_rows = min(max_rows, rows)
        compiled.add_layer(
            layer.input_norm,
            layer.post_attention_norm,
            *linears,
            layer.group,
            layer.sliding_window or extension.NO_SLIDING_WINDOW,
        )
        if layer.qk_norm is not None:
            compiled.set_qk_norm(index, *layer.qk_norm)
        moe = layer.moe
        if moe is not None:
            if moe.fused is None:  # NOTE: experts not packed for a compiled kernel
                return None
            router = moe.router
            if router is None:
                router = ext.DecodeLinear(0, moe.gate.weight, None, None, moe.spec.num_experts)
            else:
                router = compiled_linear(ext, router)
            compiled.set_moe(index, router, moe.fused, moe.spec.top_k, moe.spec.renormalize)
    return DecodeStack(compiled, max_rows, dtype)
