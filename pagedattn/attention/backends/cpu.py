"""CPU fast path: vectorised PyTorch over the flash layout; decode sequences batched together.

Default layout: flash ``[num_blocks, B, num_kv_heads, head_size]``. A block is one contiguous
``B * Hkv * D`` row, so the whole batch's keys are read through the block tables with a single
``index_select`` over block rows (B times fewer indices than per-token slots), into a reused
buffer, and the gathered ``[seqs, L, Hkv, D]`` tensor is a strided view SDPA takes without a second
copy. The classic layout would need a permute (a copy) before any matmul.

Decode batches every decode sequence into one SDPA call ([S, Hkv, G, D] queries, GQA grouped,
length mask only when lengths differ); prefill spans run one SDPA per sequence. Long decode
contexts are not partitioned here: SDPA's CPU kernel already tiles over keys.

When the compiled kernel (cpu_ext, csrc/paged_attention_cpu.cpp) builds, decode rows (pure-decode
batches and the decode rows of mixed batches) skip the gather: it reads K/V through the block
tables directly; so do prefill spans (its flash-style prefill kernel,
csrc/attention_prefill_cpu.h). The PyTorch path above stays as the fallback. An fp8 cache's
gathered blocks are dequantized in the same pass by the extension's gather_dequant_fp8
(torch's float8 -> float conversion costs ~3 ns an element: +45% on a 1,024-token prefill span).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagedattn.attention import fp8, u8
from pagedattn.attention.backends.base import AttentionBackend
from pagedattn.attention.fp8 import from_cache, is_fp8
from pagedattn.attention.layout import KVCacheLayout, layout_of
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.u8 import head_size_of, is_u8
from pagedattn.cpu import extension as cpu_ext


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of dtype is read dequantized beside the query's dtype (fp8 or u8)."""
    return is_fp8(dtype) or is_u8(dtype)


class GatherBuffers:
    """Reusable gather destinations: fresh multi-MB tensors each step cost page faults."""

    def __init__(self) -> None:
        self._storage: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of the given shape (contents undefined), reusing storage."""
        numel = math.prod(shape)
        key = (name, like.dtype)
        flat = self._storage.get(key)
        if flat is None or flat.numel() < numel or flat.device != like.device:
            flat = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._storage[key] = flat
        return flat[:numel].view(shape)


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Whole blocks [n, B, Hkv, D] of a flash-layout cache, one index_select over block rows."""
    return torch.index_select(cache, 0, block_ids, out=out)


def gather_dequantized(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    dtype: torch.dtype,
    scale: float,
    buffers: GatherBuffers,
    name: str,
    compiled: bool,
) -> torch.Tensor:
    """Whole blocks [n, B, Hkv, D] of a flash-layout cache in ``dtype``: an fp8 cache's blocks
    dequantized (times scale) as they are gathered, in one compiled pass where ``compiled``; a u8
    cache's rows [.., D + 8] come back as [.., D] (scale unused: each row carries its own)."""
    shape = (block_ids.numel(), *cache.shape[1:])
    if is_u8(cache.dtype):
        if compiled and dtype in cpu_ext.SUPPORTED_DTYPES and cache.is_contiguous():
            out_shape = (*shape[:-1], head_size_of(shape[-1], cache.dtype))
            out = buffers.get(name, out_shape, torch.empty(0, dtype=dtype))
            return cpu_ext.gather_dequant_u8(cache, block_ids, out)
        return from_cache(gather_blocks(cache, block_ids, buffers.get(name, shape, cache)), dtype)
    if not is_fp8(cache.dtype):
        return from_cache(gather_blocks(cache, block_ids, buffers.get(name, shape, cache)), dtype)
    if compiled and dtype in cpu_ext.SUPPORTED_DTYPES and cache.is_contiguous():
        out = buffers.get(name, shape, torch.empty(0, dtype=dtype))
        return cpu_ext.gather_dequant_fp8(cache, block_ids, scale, out)
    # NOTE: torch's float8 -> float conversion runs one element at a time (~3 ns each).
    return from_cache(
        gather_blocks(cache, block_ids, buffers.get(name, shape, cache)), dtype, scale
    )


def key_visibility(
    q_pos: torch.Tensor, seq_len: torch.Tensor, num_keys: int, sliding_window: int | None
) -> torch.Tensor:
    """Boolean mask [..., num_keys]: key k visible to a query at q_pos (same leading dims)."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    visible = (k_pos <= q_pos[..., None]) & (k_pos < seq_len[..., None])
    if sliding_window is not None:
        visible &= k_pos > q_pos[..., None] - sliding_window
    return visible


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    *,
    scale: float,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """SDPA over [batch, Hkv, Mq, D] queries and [batch, Hkv, L, D] keys with a boolean mask.

    Soft-capping is not expressible in SDPA, so that case computes the scores explicitly.
    """
    if logits_soft_cap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale  # [b, Hkv, Mq, L]
    scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value)


class CpuBackend(AttentionBackend):
    """Paged attention for CPU (flash layout): compiled decode kernel, vectorised PyTorch else."""

    name = "cpu"
    layout = KVCacheLayout.FLASH

    def __init__(
        self,
        use_extension: bool | None = None,
        decode_kernel: str = "compiled",
        step_ops: bool = True,
    ) -> None:
        """use_extension: None = the compiled kernels if the extension builds, False = PyTorch
        only, True = require it (raises ExtensionBuildError if it cannot be built).
        decode_kernel: the KernelPlan's decode attention: "compiled" (the extension's vector
        kernel), "amx" (its AMX tile path for bf16) or "torch" (gather + SDPA).
        step_ops: write the cache with the compiled kernel (KernelPlan.step_ops)."""
        if decode_kernel not in ("compiled", "amx", "torch"):
            raise ValueError(
                f"decode_kernel={decode_kernel!r} is invalid: use compiled, amx or torch"
            )
        self._buffers = GatherBuffers()
        if use_extension is None:
            self._use_extension = cpu_ext.get_extension() is not None
        else:
            self._use_extension = use_extension and cpu_ext.load_extension() is not None
        self._compiled_decode = self._use_extension and decode_kernel != "torch"
        self._amx_decode = self._compiled_decode and decode_kernel == "amx"
        self._step_ops = step_ops

    @property
    def uses_extension(self) -> bool:
        """Whether the compiled extension is in use (cache writes; decode unless switched off)."""
        return self._use_extension

    @property
    def uses_compiled_decode(self) -> bool:
        """Whether decode rows run on the compiled kernel (when their dtypes allow it)."""
        return self._compiled_decode

    @property
    def uses_amx_decode(self) -> bool:
        """Whether the compiled kernel runs bf16 decode rows on AMX tiles (where shapes fit)."""
        return self._amx_decode

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write key/value [T, num_kv_heads, head_size] into their slots (PAD_SLOT_ID skipped).

        One compiled call (row copies by slot; an fp8 cache quantizes there) when the dtypes
        match, else the PyTorch op.
        """
        ext = cpu_ext.step_ops(self._step_ops) if self._use_extension else None
        if ext is not None and key_cache.dim() == 4:
            if not is_quantized(key_cache.dtype):
                # kv_cache_dtype: cast first (.to is a no-op when the dtypes already match).
                key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
            if (
                key.stride(-1) == 1
                and value.stride(-1) == 1
                and key.dtype
                in (
                    torch.float32,
                    torch.bfloat16,
                )
            ):
                ext.cache_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
                return
        super().reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
        )

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Attention of query [T, Hq, D] over the paged cache -> [T, Hq, D].

        A cache in another dtype than the query (kv_cache_dtype) runs the attention in the
        cache's dtype: the query is cast to it and the output back. An fp8 cache runs in the
        query's dtype, its K/V dequantized as read (k_scale, v_scale); so does a u8 cache (each
        row with its own scale and min).
        """
        if layout_of(key_cache) is not KVCacheLayout.FLASH:
            raise ValueError("the cpu backend needs the flash KV cache layout; use 'torch'")
        if query.dtype != key_cache.dtype and not is_quantized(key_cache.dtype):
            out = self.forward(
                query.to(key_cache.dtype),
                key_cache,
                value_cache,
                metadata,
                scale=scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
            return out.to(query.dtype)
        kwargs = dict(
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        query = query[: metadata.num_actual_tokens]
        query_lens = metadata.query_lens_cpu
        if metadata.is_pure_decode:
            return self._decode(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.max_seq_len,
                min(metadata.seq_lens_cpu),
                **kwargs,
            )
        output = torch.empty_like(query)
        loc = metadata.query_start_loc_cpu
        decode_seqs = [s for s, n in enumerate(query_lens) if n == 1]
        if decode_seqs:
            idx = torch.tensor(decode_seqs, device=query.device)
            rows = torch.tensor([loc[s] for s in decode_seqs], device=query.device)
            seq_lens = metadata.seq_lens.index_select(0, idx)
            output[rows] = self._decode(
                query.index_select(0, rows),
                key_cache,
                value_cache,
                metadata.block_tables.index_select(0, idx),
                seq_lens,
                max(metadata.seq_lens_cpu[s] for s in decode_seqs),
                min(metadata.seq_lens_cpu[s] for s in decode_seqs),
                **kwargs,
            )
        for s, n in enumerate(query_lens):
            if n > 1:
                output[loc[s] : loc[s + 1]] = self._prefill(
                    query[loc[s] : loc[s + 1]],
                    key_cache,
                    value_cache,
                    metadata.block_tables[s],
                    metadata.seq_lens_cpu[s],
                    **kwargs,
                )
        return output

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        min_seq_len: int,
        *,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """One query per sequence: the compiled kernel, else one padded, batched SDPA."""
        if self._compiled_decode and cpu_ext.supports(query, key_cache):
            return cpu_ext.paged_decode(
                query,
                key_cache,
                value_cache,
                block_tables,
                seq_lens,
                scale=scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                amx=self._amx_decode,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        num_seqs, num_heads, head_size = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        group = num_heads // num_kv_heads
        num_blocks = -(-max_seq_len // block_size)
        # NOTE: unused table entries may be padding; clamp to a valid block, the mask hides it.
        block_ids = block_tables[:, :num_blocks].reshape(-1).long().clamp_(min=0)
        gather = dict(buffers=self._buffers, compiled=self._use_extension)
        key = gather_dequantized(key_cache, block_ids, query.dtype, k_scale, name="key", **gather)
        value = gather_dequantized(
            value_cache, block_ids, query.dtype, v_scale, name="value", **gather
        )
        # [S*n, B, Hkv, D] -> [S, n*B, Hkv, D] -> [S, Hkv, n*B, D] (strided view, no copy)
        padded_len = num_blocks * block_size
        key = key.view(num_seqs, padded_len, num_kv_heads, head_size).transpose(1, 2)
        value = value.view(num_seqs, padded_len, num_kv_heads, head_size).transpose(1, 2)
        key, value = key[:, :, :max_seq_len], value[:, :, :max_seq_len]
        q = query.reshape(num_seqs, num_kv_heads, group, head_size)  # [S, Hkv, G, D]
        visible = None
        if sliding_window is not None or min_seq_len < max_seq_len:
            seq_lens = seq_lens.long()
            visible = key_visibility(seq_lens - 1, seq_lens, max_seq_len, sliding_window)
            visible = visible[:, None, None, :]  # [S, 1, 1, L]
        out = masked_attention(q, key, value, visible, scale=scale, logits_soft_cap=logits_soft_cap)
        return out.reshape(num_seqs, num_heads, head_size)

    def _prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        *,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """A span of q_len queries (the last q_len positions), causal over the cached prefix:
        the compiled kernel reads K/V through the block table; without it the blocks are
        gathered for SDPA."""
        if self._use_extension and cpu_ext.supports(query, key_cache):
            return cpu_ext.paged_prefill(
                query,
                key_cache,
                value_cache,
                block_table,
                seq_len,
                scale=scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        q_len, num_heads, head_size = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        group = num_heads // num_kv_heads
        num_blocks = -(-seq_len // block_size)
        block_ids = block_table[:num_blocks].long()
        gather = dict(buffers=self._buffers, compiled=self._use_extension)
        key = gather_dequantized(key_cache, block_ids, query.dtype, k_scale, name="key", **gather)
        value = gather_dequantized(
            value_cache, block_ids, query.dtype, v_scale, name="value", **gather
        )
        # [n, B, Hkv, D] -> [n*B, Hkv, D] -> first seq_len tokens
        key = key.view(-1, num_kv_heads, head_size)[:seq_len]
        value = value.view(-1, num_kv_heads, head_size)[:seq_len]
        key = key.transpose(0, 1)  # [Hkv, L, D]
        value = value.transpose(0, 1)
        visible = None  # [q_len, L]; None: plain causal (no cached prefix, no window)
        if q_len != seq_len or sliding_window is not None or logits_soft_cap is not None:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            visible = key_visibility(q_pos, torch.tensor(seq_len), seq_len, sliding_window)
        if logits_soft_cap is None:
            # 4-D inputs with GQA take SDPA's flash kernel for CPU (the 3-D grouped form below
            # falls back to the unfused math path: 3x slower on a 128-token SmolLM2 prompt).
            q = query.transpose(0, 1)[None]  # [1, Hq, q_len, D]
            out = F.scaled_dot_product_attention(
                q,
                key[None],
                value[None],
                attn_mask=visible,
                is_causal=visible is None,
                scale=scale,
                enable_gqa=True,
            )
            return out[0].transpose(0, 1)  # [q_len, Hq, D]
        # [q_len, Hkv, G, D] -> [Hkv, G, q_len, D] -> [Hkv, G*q_len, D]: one row per (g, query).
        q = query.reshape(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * q_len, head_size)
        visible = visible.repeat(group, 1)  # [G*q_len, L]
        out = masked_attention(q, key, value, visible, scale=scale, logits_soft_cap=logits_soft_cap)
        # [Hkv, G*q_len, D] -> [Hkv, G, q_len, D] -> [q_len, Hkv, G, D]
        out = out.view(num_kv_heads, group, q_len, head_size).permute(2, 0, 1, 3)
        return out.reshape(q_len, num_heads, head_size)


# Timing the decode attention kernels for the kernel plan (pagedattn.cpu.plan.choose_plan).
ATTENTION_CONTEXT = 256  # tokens per sequence in the timed decode attention
ATTENTION_BLOCK_SIZE = 16


def time_decode_attention(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    kernels: Sequence[str],
    dtype: torch.dtype,
    num_seqs: int = 32,
    kv_cache_dtype: str = "auto",
) -> dict[str, float]:
    """Seconds of one decode attention call per kernel of ``kernels`` (compiled, amx, torch):
    ``num_seqs`` sequences of ``ATTENTION_CONTEXT`` tokens in shuffled blocks of a flash cache,
    ``dtype`` queries against a cache of ``dtype`` or of the one-byte ``kv_cache_dtype`` (fp8
    with computed scales, u8)."""
    from pagedattn.cpu.tuner import fastest_passes

    block = ATTENTION_BLOCK_SIZE
    per_seq = ATTENTION_CONTEXT // block
    gen = torch.Generator().manual_seed(0)
    cache_shape = (num_seqs * per_seq, block, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    tables = torch.randperm(cache_shape[0], generator=gen).view(num_seqs, per_seq).tolist()
    metadata = AttentionMetadata.build(
        [1] * num_seqs, [ATTENTION_CONTEXT] * num_seqs, tables, block
    )
    query = torch.randn(num_seqs, num_heads, head_size, generator=gen).to(dtype)
    scale = head_size**-0.5
    scales = {}
    if kv_cache_dtype in u8.U8_NAMES:
        key_cache, value_cache = u8.quantize(key_cache), u8.quantize(value_cache)
    elif kv_cache_dtype in fp8.FP8_DTYPES:
        cache_dtype = fp8.FP8_DTYPES[kv_cache_dtype]
        k_scale = fp8.compute_scale(key_cache, cache_dtype)
        v_scale = fp8.compute_scale(value_cache, cache_dtype)
        key_cache = fp8.quantize(key_cache, cache_dtype, k_scale)
        value_cache = fp8.quantize(value_cache, cache_dtype, v_scale)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    backends = {k: CpuBackend(decode_kernel=k) for k in kernels}
    return fastest_passes(
        {
            name: lambda b=backend: b.forward(
                query, key_cache, value_cache, metadata, scale=scale, **scales
            )
            for name, backend in backends.items()
        }
    )
