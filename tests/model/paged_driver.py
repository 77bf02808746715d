"""A minimal hand-built runner for model tests: block tables, slot mapping and steps by hand."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pagedattn.attention import AttentionMetadata, get_attn_backend
from pagedattn.model.base import PagedCausalLM


class PagedDriver:
    """Feeds token chunks of several sequences through a model over a paged KV cache.

    Block ids come from a shuffled pool shared by all KV cache groups, so every block table is
    non-contiguous and the groups' tables differ.
    """

    def __init__(
        self,
        model: PagedCausalLM,
        block_size: int = 4,
        num_blocks: int = 512,
        seed: int = 0,
        backend: str = "torch",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_groups = len(model.kv_cache_group_windows())
        backend = get_attn_backend(backend, "cpu")
        self.kv_caches = [
            backend.allocate_kv_cache(
                num_blocks, block_size, model.num_kv_heads, model.head_size, model.dtype, "cpu"
            )
            for _ in range(model.num_layers)
        ]
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables: dict[int, list[list[int]]] = {}
        self.num_computed: dict[int, int] = {}

    def _grow(self, seq_id: int, seq_len: int) -> None:
        tables = self.block_tables.setdefault(seq_id, [[] for _ in range(self.num_groups)])
        for table in tables:
            while len(table) < math.ceil(seq_len / self.block_size):
                table.append(self.free_blocks.pop())

    @torch.inference_mode()
    def step(
        self, chunks: Sequence[tuple[int, Sequence[int]]], verifies_drafts: bool = False
    ) -> list[torch.Tensor]:
        """Run one step over (seq_id, new token ids) chunks; return each chunk's logits [q, V].

        verifies_drafts: mark the step as one that verifies draft tokens (speculation)."""
        input_ids, positions, query_lens, seq_lens = [], [], [], []
        for seq_id, tokens in chunks:
            start = self.num_computed.get(seq_id, 0)
            self._grow(seq_id, start + len(tokens))
            input_ids += list(tokens)
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            self.num_computed[seq_id] = start + len(tokens)
        metadata = [
            AttentionMetadata.build(
                query_lens,
                seq_lens,
                [self.block_tables[s][g] for s, _ in chunks],
                self.block_size,
                verifies_drafts=verifies_drafts,
            )
            for g in range(self.num_groups)
        ]
        hidden = self.model(
            torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, metadata
        )
        logits = self.model.compute_logits(hidden, verifies_drafts)  # [T, V]
        return list(logits.split(query_lens))
