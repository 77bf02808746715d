"""Decode steps of a Llama-family model in one compiled call (csrc/decode_stack_cpu.cpp).

The compiled DecodeStack runs the kernels LlamaDecoderLayer.forward calls, in the same order and
on the same linear kernels, so its hidden states are bit-identical to the Python layers'; it
saves the interpreter between ~25 small calls per layer. It is built once, after the weights are
packed, and only where it can match the Python path exactly: a CPU model in float32/bfloat16 with
the compiled extension and step ops, no q/k norm, no attention soft-cap, the extension's decode
attention. It runs a step only when every row is a decode row, the KV cache has the model's
dtype and the rows are below the linear plan's prefill split. ``PAGEDATTN_DISABLE_DECODE_STACK=1``
turns it off (the decode-step benchmark measures what it saves).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from torch import nn

from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.cpu import extension as cpu_ext
from pagedattn.model.packed_linear import PackedLinear

DISABLE_ENV = "PAGEDATTN_DISABLE_DECODE_STACK"
# packed_linear kernel name -> the compiled DecodeLinear's kernel number.
KERNEL_NUMBERS = {
    "torch": 0,
    "panels": 1,
    "mkl": 2,
    "onednn": 3,
    "int8": 4,
    "amx": 5,
    "int8_amx": 6,
}


def _decode_linear(ext, module: nn.Linear):
    """(DecodeLinear for the module's decode kernel, rows from which its prefill kernel runs)."""
    packed: PackedLinear | None = getattr(module, "linear_decode", None)
    if packed is None:  # never packed: plain F.linear
        return ext.DecodeLinear(0, module.weight, None, module.bias, module.out_features), math.inf
    if packed.kernel == "mkl":
        a, b = packed.packed, packed.weight
    elif packed.kernel in ("int8", "int8_amx"):
        a, b = packed.packed, packed.scales
    elif packed.kernel == "torch":
        a, b = packed.weight, None
    else:
        a, b = packed.packed, None
    number = KERNEL_NUMBERS[packed.kernel]
    return ext.DecodeLinear(number, a, b, packed.bias, packed.out_features), module.prefill_rows


class DecodeStack:
    """The compiled stack of one model plus the conditions under which a step may use it."""

    def __init__(self, compiled, max_rows: float, dtype: torch.dtype) -> None:
        self.compiled = compiled
        self.max_rows = max_rows  # rows at or past this run the prefill linear kernel
        self.dtype = dtype

    def usable(
        self,
        num_tokens: int,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Sequence[AttentionMetadata],
    ) -> bool:
        """Whether this step can run on the stack (all rows decode, the cache in our dtype)."""
        first = attn_metadata[0]
        return (
            0 < num_tokens < self.max_rows
            and first.is_pure_decode
            and first.num_actual_tokens == num_tokens
            and kv_caches[0][0].dtype == self.dtype
            and kv_caches[0][0].dim() == 4
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Sequence[AttentionMetadata],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H], cos/sin [T, 1, D] -> (hidden, residual) after the last layer."""
        num_tokens = hidden.shape[0]
        return self.compiled.forward(
            hidden,
            cos.reshape(num_tokens, -1),
            sin.reshape(num_tokens, -1),
            kv_caches,
            [m.slot_mapping for m in attn_metadata],
            [m.block_tables for m in attn_metadata],
            [m.seq_lens for m in attn_metadata],
        )


def build_decode_stack(model: nn.Module) -> DecodeStack | None:
    """A DecodeStack for a packed Llama-family model, or None where it could not match exactly."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    ext = cpu_ext.step_ops()
    layers = model.model.layers
    dtype = model.dtype
    if ext is None or not hasattr(ext, "DecodeStack") or len(layers) == 0:
        return None
    if dtype not in cpu_ext.SUPPORTED_DTYPES or model.lm_head_weight().device.type != "cpu":
        return None
    first = layers[0].self_attn
    if first.head_size % cpu_ext.HEAD_SIZE_MULTIPLE != 0:
        return None
    eps = layers[0].input_layernorm.eps
    compiled_amx = getattr(first.attn.backend, "uses_amx_decode", False)
    compiled = ext.DecodeStack(
        first.num_heads,
        first.num_kv_heads,
        first.head_size,
        eps,
        first.attn.scale,
        cpu_ext.DEFAULT_PARTITION_SIZE,
        compiled_amx,
    )
    max_rows = math.inf
    for i, layer in enumerate(layers):
        attn, paged = layer.self_attn, layer.self_attn.attn
        backend = paged.backend
        if (
            attn.qk_norm
            or paged.logits_soft_cap is not None
            or not isinstance(backend, CpuBackend)
            or not backend.uses_compiled_decode
            or backend.uses_amx_decode != compiled_amx
            or layer.post_attention_layernorm.eps != eps
            or layer.input_layernorm.eps != eps
            or paged.scale != first.attn.scale
        ):
            return None
        linears = []
        for module in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear, rows = _decode_linear(ext, module)
            linears.append(linear)
            max_rows = min(max_rows, rows)
        compiled.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            *linears,
            model.layer_group[i],
            paged.sliding_window or cpu_ext.NO_SLIDING_WINDOW,
        )
    return DecodeStack(compiled, max_rows, dtype)
