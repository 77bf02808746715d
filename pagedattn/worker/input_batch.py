"""The flattened, unpadded tensors of one engine step: ids, positions, slots, block tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pagedattn.attention.metadata import AttentionMetadata


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step: its new tokens, where they start, its block ids per group."""

    req_id: str
    token_ids: Sequence[int]  # the tokens computed this step (prompt chunk or last sampled token)
    start_pos: int  # absolute position of token_ids[0] (= tokens already in the cache)
    block_ids: Sequence[Sequence[int]]  # one block table per KV cache group
    needs_sample: bool  # True when this step reaches the end of the sequence's known tokens


class InputBatch(NamedTuple):
    """Everything the model and the sampler need for one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: list[AttentionMetadata]  # one per KV cache group
    logits_indices: torch.Tensor  # [num_sampled] int64: rows of the hidden states to sample
    sampled_req_ids: list[str]


def build_input_batch(
    seqs: Sequence[ScheduledSeq], block_size: int, num_groups: int, device: torch.device | str
) -> InputBatch:
    """Flatten the step's sequences with no padding and compute slot_mapping per group."""
    query_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # NOTE: positions are built vectorised: each token's offset inside its span plus its start.
    row_of_token = np.repeat(np.arange(len(seqs)), query_lens)  # [T]
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1], query_lens)
    positions += np.repeat(starts, query_lens)
    input_ids = np.fromiter(
        (t for s in seqs for t in s.token_ids), dtype=np.int64, count=num_tokens
    )

    qsl_cpu = query_start_loc.tolist()
    seq_lens_cpu = seq_lens.tolist()
    qsl_t = torch.from_numpy(query_start_loc.astype(np.int32)).to(device)
    seq_lens_t = torch.from_numpy(seq_lens.astype(np.int32)).to(device)
    metadata = []
    for g in range(num_groups):
        tables = [s.block_ids[g] for s in seqs]
        max_blocks = max((len(t) for t in tables), default=0)
        # NOTE: unused table entries point at block 0; kernels never read past seq_len.
        block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        slot_mapping = (
            block_tables[row_of_token, positions // block_size] * block_size
            + positions % block_size
        )
        metadata.append(
            AttentionMetadata(
                num_actual_tokens=num_tokens,
                query_start_loc=qsl_t,
                seq_lens=seq_lens_t,
                block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(device),
                slot_mapping=torch.from_numpy(slot_mapping).to(device),
                max_query_len=int(query_lens.max(initial=0)),
                max_seq_len=int(seq_lens.max(initial=0)),
                query_start_loc_cpu=qsl_cpu,
                seq_lens_cpu=seq_lens_cpu,
            )
        )
    sampled = [i for i, s in enumerate(seqs) if s.needs_sample]
    logits_indices = torch.tensor([qsl_cpu[i + 1] - 1 for i in sampled], dtype=torch.int64)
    return InputBatch(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        attn_metadata=metadata,
        logits_indices=logits_indices.to(device),
        sampled_req_ids=[seqs[i].req_id for i in sampled],
    )
