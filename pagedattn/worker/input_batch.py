"""The flattened, unpadded tensors of one engine step: ids, positions, slots, block tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.core.scheduler_output import ScheduledRequest

# Steps whose every span (prompt chunk, draft span or decode token) has at most this many tokens
# attend one query per position, as draft spans always do: a step where short prompts join
# running streams then stays a decode step, which the compiled decode stack takes, instead of
# running the per-layer Python path for all its rows.
SHORT_SPAN_TOKENS = 16


class InputBatch(NamedTuple):
    """Everything the model needs for one step, and which rows of its output are sampled."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: list[AttentionMetadata]  # one per KV cache group
    logits_indices: torch.Tensor  # [num_sampled] int64: rows of the hidden states to sample
    sampled: list[int]  # index into the scheduled list of each sampled row
    # Row of logits_indices of each sampled sequence's last position; a speculative sequence's
    # K draft positions take the K rows before it (None: row j, no speculation in the step).
    logits_rows: list[int] | None = None


def build_input_batch(
    scheduled: Sequence[ScheduledRequest],
    block_size: int,
    num_groups: int,
    device: torch.device | str,
) -> InputBatch:
    """Flatten the step's sequences with no padding; one AttentionMetadata per KV cache group."""
    num_seqs = len(scheduled)
    query_lens = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((s.start_pos for s in scheduled), dtype=np.int64, count=num_seqs)
    seq_lens = starts + query_lens
    query_ends = np.cumsum(query_lens)
    num_tokens = int(query_ends[-1]) if num_seqs else 0
    # NOTE: each token's position is its offset inside its span plus the span's start.
    positions = (
        np.arange(num_tokens, dtype=np.int64)
        - np.repeat(query_ends - query_lens, query_lens)
        + np.repeat(starts, query_lens)
    )
    input_ids = np.fromiter(
        (t for s in scheduled for t in s.token_ids), dtype=np.int64, count=num_tokens
    )
    rows = range(num_seqs)
    attn_query_lens, attn_seq_lens = query_lens, seq_lens
    verifies_drafts = any(s.spec_token_ids for s in scheduled)
    split_all = num_tokens > num_seqs and int(query_lens.max()) <= SHORT_SPAN_TOKENS
    if verifies_drafts or split_all:
        rows, attn_query_lens, attn_seq_lens = _split_spans(
            scheduled, starts, query_lens, split_all
        )
    metadata = [
        AttentionMetadata.build(
            attn_query_lens,
            attn_seq_lens,
            [scheduled[i].block_ids[g] for i in rows],
            block_size,
            device,
            verifies_drafts,
        )
        for g in range(num_groups)
    ]
    sampled = [i for i, s in enumerate(scheduled) if s.needs_sample]
    logits_rows = None
    if any(s.spec_token_ids for s in scheduled):
        indices: list[int] = []
        logits_rows = []
        for i in sampled:
            end = int(query_ends[i])
            indices += range(end - 1 - len(scheduled[i].spec_token_ids), end)
            logits_rows.append(len(indices) - 1)
        logits_indices = torch.tensor(indices, dtype=torch.int64)
    else:
        logits_indices = torch.tensor([int(query_ends[i]) - 1 for i in sampled], dtype=torch.int64)
    return InputBatch(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        attn_metadata=metadata,
        logits_indices=logits_indices.to(device),
        sampled=sampled,
        logits_rows=logits_rows,
    )


def _split_spans(
    scheduled: Sequence[ScheduledRequest],
    starts: np.ndarray,
    query_lens: np.ndarray,
    split_all: bool,
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Attention rows with each draft span (every span, with ``split_all``) cut into one query
    per position.

    NOTE: position start + j of a span sees the cache up to itself (seq_len start + j + 1) on
    the same block table: causal masking inside the span, through the decode kernels. Every
    token's K/V is written before any query of the layer attends, so later positions read the
    drafts before them. Returns (scheduled index per row, query_lens, seq_lens).
    """
    rows: list[int] = []
    attn_query_lens: list[int] = []
    attn_seq_lens: list[int] = []
    for i, s in enumerate(scheduled):
        start, num = int(starts[i]), int(query_lens[i])
        if s.spec_token_ids or split_all:
            rows += [i] * num
            attn_query_lens += [1] * num
            attn_seq_lens += range(start + 1, start + num + 1)
        else:
            rows.append(i)
            attn_query_lens.append(num)
            attn_seq_lens.append(start + num)
    return rows, np.array(attn_query_lens, dtype=np.int64), np.array(attn_seq_lens, dtype=np.int64)
