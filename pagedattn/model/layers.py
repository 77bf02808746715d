"""Shared building blocks: linear layers, norms, rotary embedding, activations, paged attention.

Layers that have a compiled CPU kernel take ``step_ops`` (KernelPlan.step_ops) at construction:
True runs it where the tensors allow, False always runs the PyTorch code.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.attention.backends.base import AttentionBackend
from pagedattn.attention.fp8 import compute_scale, is_fp8
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.cpu import extension as cpu_ext
from pagedattn.cpu.linear import (
    GGUF_PREFILL_ROWS,
    PackedLinear,
    QuantizedParts,
    pack_quantized,
    pack_weight,
)
from pagedattn.cpu.quant import QuantizedTensor
from pagedattn.model.rope import rope_frequencies
from pagedattn.model.text_config import TextConfig


def compiled_ops_for(x: torch.Tensor, enabled: bool = True):
    """The compiled CPU extension when enabled and it can take x (CPU, fp32/bf16), else None."""
    if not enabled or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_ext.step_ops()


class LinearKernels(NamedTuple):
    """The CPU kernels of one Linear layer: below ``prefill_rows`` rows ``decode``, else
    ``prefill``; ``verify``: a copy for the steps that verify draft tokens (the decode stack's
    verify stack; names from pagedattn.cpu.linear)."""

    decode: str
    prefill: str
    prefill_rows: float = math.inf
    verify: str | None = None
    # GGUF blocks (the gguf kernel): int8 dot kernels below this many rows, tiles from it;
    # interleaved parts on AMX-INT8 tiles from quant_amx_rows rows (0: never).
    quant_rows: int = GGUF_PREFILL_ROWS
    quant_amx_rows: int = 0


class Linear(nn.Module):
    """``y = x W^T + b``; with ``kernels``, the weight is packed once after loading for the decode
    and prefill kernels, and each call runs the one its row count selects."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        kernels: LinearKernels | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernels = kernels
        self.decode: PackedLinear | None = None
        self.prefill: PackedLinear | None = None
        self.prefill_rows = math.inf
        # NOTE: packed for the verify stack only: a call here never picks it, so a step without
        # drafts computes the same numbers whether or not the engine speculates.
        self.verify: PackedLinear | None = None
        # GGUF blocks loaded for the weight's rows from start (load_quantized), by start.
        self.quantized: dict[int, QuantizedTensor] = {}

    def load_quantized(self, start: int, tensor: QuantizedTensor) -> None:
        """Take ``tensor`` (ggml blocks) as the weight's rows from ``start``, as stored."""
        rows, cols = tensor.shape
        if cols != self.in_features or start + rows > self.out_features:
            raise ValueError(
                f"GGUF tensor [{rows}, {cols}] does not fit rows {start}.. of a "
                f"[{self.out_features}, {self.in_features}] linear layer"
            )
        self.quantized[start] = tensor

    def quantized_bytes(self) -> int:
        """Bytes of the GGUF blocks this layer computes on, as its compiled layer holds them
        (0: a float weight)."""
        packed = self.decode
        return packed.a.nbytes() if packed is not None and packed.name == "gguf" else 0

    def _pack_quantized(self) -> bool:
        """Pack the layer's GGUF blocks (all its rows stored so) for the gguf kernel; pieces
        beside float rows are widened into the weight instead. Returns whether it packed."""
        parts = sorted(self.quantized.items())
        self.quantized = {}
        rows = sum(t.shape[0] for _, t in parts)
        if rows == self.out_features:
            weight = QuantizedParts(
                tuple(t for _, t in parts),
                tuple(s for s, _ in parts),
                self.out_features,
                self.in_features,
            )
            b = None if self.bias is None else self.bias.detach()
            k = self.kernels or LinearKernels("torch", "torch")
            packed = pack_quantized(weight, b, k.quant_rows, amx_rows=k.quant_amx_rows)
            self.decode = self.prefill = packed
            self.prefill_rows = math.inf  # NOTE: the compiled layer splits decode from prefill
            self.weight = None
            return True
        for start, t in parts:  # NOTE: a fused layer mixing float and ggml pieces: all float
            self.weight.data[start : start + t.shape[0]].copy_(t.dequantize())
        return False

    def process_weights_after_loading(self) -> None:
        """Pack the loaded weight for the layer's kernels (a CPU weight that some kernel other
        than F.linear takes); the packed copies then hold the only reference to it. GGUF blocks
        are packed for the gguf kernel as they are."""
        if self.quantized and self._pack_quantized():
            return
        kernels, weight = self.kernels, self.weight
        if kernels is None or weight is None or weight.device.type != "cpu":
            return
        w, b = weight.detach(), None if self.bias is None else self.bias.detach()
        decode = pack_weight(kernels.decode, w, b)
        same = kernels.prefill == kernels.decode
        prefill = decode if same else pack_weight(kernels.prefill, w, b)
        verify = None
        if kernels.verify is not None and kernels.verify != decode.name:
            verify = pack_weight(kernels.verify, w, b)
            verify = None if verify.name == decode.name else verify
        if decode.name == prefill.name == "torch" and verify is None:
            return
        self.decode, self.prefill, self.prefill_rows = decode, prefill, kernels.prefill_rows
        self.verify = verify
        self.weight = None  # NOTE: freed unless a kernel keeps it (torch, MKL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features if self.in_features else 0
        return (self.prefill if rows >= self.prefill_rows else self.decode)(x)

    def extra_repr(self) -> str:
        kernels = ""
        if self.decode is not None:
            kernels = f", kernels={self.decode.name}/{self.prefill.name}"
        return f"in_features={self.in_features}, out_features={self.out_features}{kernels}"


class Embedding(nn.Module):
    """Token embedding: a float table, or GGUF blocks (``load_quantized``) whose rows are
    dequantised as they are looked up (a tied LM head computes on the same blocks)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # NOTE: torch.empty, not nn.Embedding's random init (seconds on the meta device); the
        # checkpoint overwrites it anyway.
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.quantized: QuantizedTensor | None = None
        # A tied LM head's compiled layer (QuantLinear), set once it is packed: lookups read
        # its rows (held once, maybe repacked), not the table as stored.
        self.lookup = None
        self.activation_dtype = torch.float32

    def load_quantized(self, start: int, tensor: QuantizedTensor) -> None:
        """Take ``tensor`` (ggml blocks, rows in order) as the table; the float one is dropped."""
        if start != 0 or tuple(tensor.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"GGUF embedding {tuple(tensor.shape)} does not match the model's "
                f"[{self.num_embeddings}, {self.embedding_dim}]"
            )
        if tensor.row_order is not None:
            raise ValueError("a GGUF embedding's rows must be stored in order")
        self.quantized = tensor
        self.activation_dtype = self.weight.dtype
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return F.embedding(input_ids, self.weight)
        table = self.quantized
        dtype = self.dtype
        if self.lookup is not None:
            return self.lookup.rows(input_ids, dtype)
        return cpu_ext.load_extension().quant_embedding(
            table.data, table.type_id, table.cols, input_ids, dtype
        )  # [..., H]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the vectors it returns (the model's: a GGUF table keeps the float
        table's dtype when it replaces it)."""
        return self.weight.dtype if self.weight is not None else self.activation_dtype

    def extra_repr(self) -> str:
        fmt = f", {self.quantized.name}" if self.quantized is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{fmt}"


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale by ``weight``."""

    def __init__(self, hidden_size: int, eps: float, step_ops: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.step_ops = step_ops
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _compiled(self, x: torch.Tensor):
        ext = compiled_ops_for(x, self.step_ops)
        ok = ext is not None and x.dim() == 2 and x.is_contiguous()
        return ext if ok and self.weight.dtype == x.dtype else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = self._compiled(x)
        if ext is not None:
            return ext.rms_norm(x, self.weight, self.eps, None)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); on CPU one pass that updates residual in place."""
        ext = self._compiled(x)
        if ext is not None and residual.is_contiguous() and residual.dtype == x.dtype:
            return ext.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: scale by ``1 + weight`` in fp32, then cast back (weights are zero-centred)."""

    def __init__(self, hidden_size: int, eps: float, step_ops: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.step_ops = step_ops
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = compiled_ops_for(x, self.step_ops)
        if ext is not None and self.weight.dtype == x.dtype:
            # NOTE: q/k norms get strided views of the fused qkv output; one copy is still far
            # cheaper than the five PyTorch ops below.
            return ext.gemma_rms_norm(x.contiguous(), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor, step_ops: bool = True) -> torch.Tensor:
    """SwiGLU on a fused [T, 2 * I] gate/up projection -> [T, I]."""
    ext = compiled_ops_for(gate_up, step_ops)
    if ext is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return ext.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor, step_ops: bool = True) -> torch.Tensor:
    """GeGLU (tanh approximation) on a fused [T, 2 * I] gate/up projection -> [T, I]."""
    ext = compiled_ops_for(gate_up, step_ops)
    if ext is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return ext.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class RotaryEmbedding:
    """Neox-style rotary embedding (HF ``rotate_half``) for one rope configuration.

    NOTE: a plain object, not a module: its frequencies are computed on the CPU at construction
    and so survive building the model on the meta device.
    """

    def __init__(self, config: TextConfig, head_size: int, layer_type: str | None = None) -> None:
        params = config.rope_parameters
        params = params[layer_type] if layer_type is not None else params
        inv_freq, self.attention_scaling = rope_frequencies(
            params, head_size, config.max_position_embeddings
        )
        if inv_freq.numel() * 2 != head_size:
            raise NotImplementedError(
                f"partial rotary embedding ({inv_freq.numel() * 2} of {head_size} dims) is not "
                "supported"
            )
        self.inv_freq = inv_freq.float()  # [head_size // 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin tables for ``positions`` [T] -> two [T, 1, head_size] tensors."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_size // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_size]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, num_heads, head_size] by the [T, 1, head_size] cos/sin tables."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step_ops: bool = True
) -> torch.Tensor:
    """``apply_rotary`` written into x itself; returns x.

    x [T, num_heads, head_size] may be a strided view (e.g. the q and k columns of a fused qkv
    output). On CPU the compiled kernel does it in one pass with the same rounding; elsewhere the
    PyTorch result is copied back.
    """
    ext = compiled_ops_for(x, step_ops)
    if ext is not None and x.stride(-1) == 1 and cos.dtype == x.dtype:
        num_tokens = x.shape[0]
        ext.rotary_inplace(
            x, cos.reshape(num_tokens, -1).contiguous(), sin.reshape(num_tokens, -1).contiguous()
        )
        return x
    return x.copy_(apply_rotary(x, cos, sin))


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's paged cache, then attends through the backend.

    k_scale / v_scale: the layer's FP8 KV scales (1.0; with calculate_kv_scales, set once from
    the K/V amax of the engine's calibration prefill, see engine.kv_scales).
    """

    def __init__(
        self,
        backend: AttentionBackend,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.k_scale = self.v_scale = 1.0
        self.calculate_kv_scales = False  # set by the runner (--calculate-kv-scales)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> attention output [T, Hq * D]."""
        key_cache, value_cache = kv_cache
        if self.calculate_kv_scales and is_fp8(key_cache.dtype):
            # NOTE: once, from the first step the engine runs: its calibration prefill.
            num_tokens = metadata.num_actual_tokens
            self.k_scale = compute_scale(key[:num_tokens], key_cache.dtype)
            self.v_scale = compute_scale(value[:num_tokens], key_cache.dtype)
            self.calculate_kv_scales = False
        self.backend.reshape_and_cache(
            key, value, key_cache, value_cache, metadata.slot_mapping, self.k_scale, self.v_scale
        )
        out = self.backend.forward(
            query,
            key_cache,
            value_cache,
            metadata,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )  # [T, Hq, D]
        return out.reshape(out.shape[0], self.num_heads * self.head_size)  # [T, Hq * D]
