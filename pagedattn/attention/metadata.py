"""Per-step attention metadata: where each sequence's queries and cached keys live."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedattn.attention.layout import PAD_SLOT_ID, slot_mapping


@dataclass
class AttentionMetadata:
    """Batch description for one KV cache group in one step (flattened queries, paged keys)."""

    num_actual_tokens: int  # T: flattened query tokens of the step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, PAD_SLOT_ID (-1) = skip
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copy of query_start_loc
    seq_lens_cpu: list[int]  # host copy of seq_lens
    verifies_drafts: bool = False  # some rows score draft tokens (speculative decoding)

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return len(self.seq_lens_cpu)

    @property
    def query_lens_cpu(self) -> list[int]:
        """Query tokens per sequence this step (host list)."""
        loc = self.query_start_loc_cpu
        return [loc[i + 1] - loc[i] for i in range(len(loc) - 1)]

    @property
    def is_pure_decode(self) -> bool:
        """True when every sequence has exactly one query token."""
        return self.max_query_len == 1 and self.num_actual_tokens == self.num_seqs

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int] | np.ndarray,
        seq_lens: Sequence[int] | np.ndarray,
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        verifies_drafts: bool = False,
    ) -> AttentionMetadata:
        """Build metadata from host lists; slot_mapping addresses each new token's cache slot.

        The new tokens of sequence s are its last ``query_lens[s]`` positions, so query j sits at
        absolute position ``seq_lens[s] - query_lens[s] + j``.
        """
        query_lens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        seq_lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        num_seqs = len(block_tables)
        if len(query_lens) != len(seq_lens) or len(seq_lens) != num_seqs:
            raise ValueError(
                f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
                f"({num_seqs}) must have one entry per sequence"
            )
        table_lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=num_seqs)
        bad = (query_lens < 0) | (query_lens > seq_lens) | (table_lens * block_size < seq_lens)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"sequence with query_len={query_lens[i]}, seq_len={seq_lens[i]} and "
                f"{table_lens[i]} blocks of {block_size} is inconsistent: need 0 <= query_len "
                "<= seq_len <= num_blocks * block_size"
            )
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # NOTE: unused table entries point at block 0; kernels never read past seq_len.
        max_blocks = int(table_lens.max(initial=0))
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)  # [T]
        positions = (
            np.arange(num_tokens, dtype=np.int64)
            - np.repeat(query_start_loc[:-1], query_lens)
            + np.repeat(seq_lens - query_lens, query_lens)
        )
        slots = slot_mapping(tables, seq_of_token, positions, block_size)
        return cls(
            num_actual_tokens=num_tokens,
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            verifies_drafts=verifies_drafts,
        )


__all__ = ["AttentionMetadata", "PAD_SLOT_ID"]
