"""Per-step attention metadata: where each sequence's queries and cached keys live."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# NOTE: a slot_mapping entry equal to PAD_SLOT_ID marks a padding token whose K/V is not written.
PAD_SLOT_ID = -1


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
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from host lists; slot_mapping addresses each new token's cache slot.

        The new tokens of sequence s are its last ``query_lens[s]`` positions, so query j sits at
        absolute position ``seq_lens[s] - query_lens[s] + j``.
        """
        if len(query_lens) != len(seq_lens) or len(seq_lens) != len(block_tables):
            raise ValueError(
                f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
                f"({len(block_tables)}) must have one entry per sequence"
            )
        loc = [0]
        slots: list[int] = []
        for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 0 <= q_len <= seq_len or len(table) * block_size < seq_len:
                raise ValueError(
                    f"sequence with query_len={q_len}, seq_len={seq_len} and {len(table)} blocks "
                    f"of {block_size} is inconsistent: need 0 <= query_len <= seq_len <= "
                    "num_blocks * block_size"
                )
            loc.append(loc[-1] + q_len)
            for pos in range(seq_len - q_len, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        # NOTE: unused table entries point at block 0; kernels never read past seq_len.
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            num_actual_tokens=loc[-1],
            query_start_loc=torch.tensor(loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                len(block_tables), max_blocks
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=loc,
            seq_lens_cpu=list(seq_lens),
        )
