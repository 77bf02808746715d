"""Triton paged prefill / chunked prefill: variable-length query spans over a cached prefix.

Grid (num_seqs, num_heads, cdiv(max_query_len, BLOCK_M)). Query row j of sequence s sits at
position ``seq_len - q_len + j`` and attends causally (and within the window) to keys read
through the block table, with an online softmax over BLOCK_N-key chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedattn.attention.backends.kernels.common import (
    dot_precision,
    fp8_kind,
    kernel_cache,
    load_paged_rows,
    soft_cap,
)

# Running max before any key is seen: finite so a fully masked chunk gives exp(-inf) = 0, not NaN.
_NO_MAX = -1.0e30


@triton.jit
def _paged_prefill_kernel(
    query_ptr,  # [T, Hq, D]
    key_cache_ptr,  # [num_blocks, B, Hkv, D]
    value_cache_ptr,
    block_tables_ptr,  # [S, max_blocks]
    query_start_loc_ptr,  # [S + 1]
    seq_lens_ptr,  # [S]
    out_ptr,  # [T, Hq, D]
    query_stride,
    query_head_stride,
    out_stride,
    out_head_stride,
    block_table_stride,
    scale,
    v_scale,
    cap,
    window,
    no_max,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    q_pos = seq_len - q_len + rows  # absolute positions of this block's queries
    dims = tl.arange(0, HEAD_PAD)
    mask_qd = row_valid[:, None] & (dims[None, :] < HEAD_SIZE)
    q_offs = (q_start + rows)[:, None] * query_stride + head * query_head_stride + dims[None, :]
    query = tl.load(query_ptr + q_offs, mask=mask_qd, other=0.0)
    # Keys this block can see: [kv_start, kv_end); empty when the block is past the span.
    first_pos = seq_len - q_len + m_block * BLOCK_M
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    kv_end = tl.where(m_block * BLOCK_M < q_len, kv_end, 0)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(0, first_pos - window + 1)
    table_ptr = block_tables_ptr + seq * block_table_stride
    m_i = tl.zeros([BLOCK_M], tl.float32) + no_max
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for chunk in range(kv_start, kv_end, BLOCK_N):
        pos = chunk + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        key = load_paged_rows(
            key_cache_ptr, table_ptr, pos, valid, kv_head,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, FP8,
        )  # fmt: skip
        value = load_paged_rows(
            value_cache_ptr, table_ptr, pos, valid, kv_head,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, FP8,
        )  # fmt: skip
        scores = tl.dot(query.to(key.dtype), tl.trans(key), input_precision=DOT_PRECISION)
        scores = scores * scale  # [BLOCK_M, BLOCK_N]
        if USE_SOFT_CAP:
            scores = soft_cap(scores, cap)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        probs = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(probs, 1)
        pv = tl.dot(probs.to(value.dtype), value, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]  # v_scale: 1.0 unless fp8
    out_offs = (q_start + rows)[:, None] * out_stride + head * out_head_stride + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask_qd)


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    *,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_m: int,
    block_n: int,
) -> torch.Tensor:
    """Causal attention of query spans [T, Hq, D] over the paged flash-layout cache."""
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    output = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return output
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _paged_prefill_kernel[grid](
        query, kernel_cache(key_cache), kernel_cache(value_cache), block_tables,
        query_start_loc, seq_lens, output,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        block_tables.stride(0),
        scale * k_scale, v_scale, logits_soft_cap or 1.0, sliding_window or 0, _NO_MAX,
        GROUP=num_heads // num_kv_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_SOFT_CAP=logits_soft_cap is not None,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(key_cache.dtype == torch.float32 or fp8_kind(key_cache) > 0),
        FP8=fp8_kind(key_cache),
    )  # fmt: skip
    return output
