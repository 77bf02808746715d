"""Triton paged decode: one query per sequence, context split into partitions, LSE-merged.

Grid (num_seqs, num_kv_heads, num_partitions): each program handles all G query heads of one KV
head over PARTITION_SIZE tokens, so a K/V row is read once per group. A second kernel merges the
partitions: with per-partition max m_p, sum l_p and normalised output o_p,
``out = sum_p o_p * l_p * exp(m_p - M) / sum_p l_p * exp(m_p - M)``, ``M = max_p m_p``.
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


@triton.jit
def _paged_decode_partition_kernel(
    query_ptr,  # [S, Hq, D]
    key_cache_ptr,  # [num_blocks, B, Hkv, D]
    value_cache_ptr,
    block_tables_ptr,  # [S, max_blocks]
    seq_lens_ptr,  # [S]
    part_out_ptr,  # [S, Hq, P, D] float32
    part_max_ptr,  # [S, Hq, P] float32
    part_sum_ptr,  # [S, Hq, P] float32
    query_stride,
    query_head_stride,
    block_table_stride,
    num_partitions,
    scale,
    v_scale,
    cap,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, seq_len)
    if USE_WINDOW:
        # The query at seq_len - 1 sees keys > seq_len - 1 - window.
        start = tl.maximum(start, seq_len - window)
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_PAD)
    heads = kv_head * GROUP + groups
    q_mask = (groups[:, None] < GROUP) & (dims[None, :] < HEAD_SIZE)
    q_offs = seq * query_stride + heads[:, None] * query_head_stride + dims[None, :]
    query = tl.load(query_ptr + q_offs, mask=q_mask, other=0.0)
    table_ptr = block_tables_ptr + seq * block_table_stride
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    # NOTE: every chunk holds at least one valid key, so m_i is finite after the first one.
    for chunk in range(start, end, BLOCK_N):
        pos = chunk + tl.arange(0, BLOCK_N)
        valid = pos < end
        key = load_paged_rows(
            key_cache_ptr, table_ptr, pos, valid, kv_head,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, FP8,
        )  # fmt: skip
        value = load_paged_rows(
            value_cache_ptr, table_ptr, pos, valid, kv_head,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD, FP8,
        )  # fmt: skip
        scores = tl.dot(query.to(key.dtype), tl.trans(key), input_precision=DOT_PRECISION)
        scores = scores * scale  # [GROUP_PAD, BLOCK_N]
        if USE_SOFT_CAP:
            scores = soft_cap(scores, cap)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        probs = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(probs, 1)
        pv = tl.dot(probs.to(value.dtype), value, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]  # v_scale: 1.0 unless fp8
    row = (seq * (NUM_KV_HEADS * GROUP) + heads) * num_partitions + part  # [GROUP_PAD]
    g_mask = groups < GROUP
    tl.store(part_out_ptr + row[:, None] * HEAD_SIZE + dims[None, :], out, mask=q_mask)
    tl.store(part_max_ptr + row, m_i, mask=g_mask)
    tl.store(part_sum_ptr + row, l_i, mask=g_mask)


@triton.jit
def _merge_partitions_kernel(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,  # [S, Hq, D]
    out_stride,
    out_head_stride,
    num_heads,
    num_partitions,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PART_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, PART_PAD)
    dims = tl.arange(0, HEAD_PAD)
    p_mask = parts < num_partitions
    base = (seq * num_heads + head) * num_partitions
    part_max = tl.load(part_max_ptr + base + parts, mask=p_mask, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + base + parts, mask=p_mask, other=0.0)
    global_max = tl.max(part_max, 0)
    # Empty partitions have sum 0 and max -inf: weight 0.
    weight = tl.where(part_sum > 0, part_sum * tl.exp(part_max - global_max), 0.0)
    o_mask = p_mask[:, None] & (dims[None, :] < HEAD_SIZE)
    o_offs = (base + parts)[:, None] * HEAD_SIZE + dims[None, :]
    part_out = tl.load(part_out_ptr + o_offs, mask=o_mask, other=0.0)
    out = tl.sum(part_out * weight[:, None], 0) / tl.sum(weight, 0)
    out_offs = seq * out_stride + head * out_head_stride + dims
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    partition_size: int,
    block_n: int,
) -> torch.Tensor:
    """Decode attention of query [S, Hq, D] over the paged flash-layout cache -> [S, Hq, D]."""
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    num_partitions = max(1, triton.cdiv(max_seq_len, partition_size))
    part_shape = (num_seqs, num_heads, num_partitions)
    part_out = torch.empty((*part_shape, head_size), dtype=torch.float32, device=query.device)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    head_pad = max(16, triton.next_power_of_2(head_size))
    _paged_decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query, kernel_cache(key_cache), kernel_cache(value_cache), block_tables, seq_lens,
        part_out, part_max, part_sum,
        query.stride(0), query.stride(1), block_tables.stride(0), num_partitions,
        scale * k_scale, v_scale, logits_soft_cap or 1.0, sliding_window or 0,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        USE_SOFT_CAP=logits_soft_cap is not None,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(key_cache.dtype == torch.float32 or fp8_kind(key_cache) > 0),
        FP8=fp8_kind(key_cache),
    )  # fmt: skip
    output = torch.empty_like(query)
    _merge_partitions_kernel[(num_seqs, num_heads)](
        part_out, part_max, part_sum, output,
        output.stride(0), output.stride(1), num_heads, num_partitions,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        PART_PAD=triton.next_power_of_2(num_partitions),
    )  # fmt: skip
    return output
