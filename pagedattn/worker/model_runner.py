"""Owns the model and its paged KV cache tensors; runs one step: copies, forward, logits."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedattn.attention.backends.base import AttentionBackend
from pagedattn.attention.backends.cpu_ext import flush_denormals_all_threads, keep_freed_heap_memory
from pagedattn.attention.layout import bytes_per_block
from pagedattn.attention.ops import copy_blocks
from pagedattn.worker.input_batch import InputBatch, ScheduledSeq, build_input_batch


@dataclass
class StepTimings:
    """Wall time of the parts of one runner step, in seconds."""

    prepare: float = 0.0
    forward: float = 0.0


class ModelRunner:
    """Allocates one (key_cache, value_cache) pair per layer and executes scheduled steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        num_groups: int,
        device: torch.device | str,
        cache_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_groups = num_groups
        self.device = torch.device(device)
        if self.device.type == "cpu":
            flush_denormals_all_threads()
            keep_freed_heap_memory()
        self.kv_caches = [
            attn_backend.allocate_kv_cache(
                num_blocks, block_size, model.num_kv_heads, model.head_size, cache_dtype, device
            )
            for _ in range(model.num_layers)
        ]
        self.last_timings = StepTimings()

    @staticmethod
    def kv_cache_bytes_per_block(
        model: torch.nn.Module, block_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block id costs across all layers (K and V)."""
        return bytes_per_block(
            model.num_layers, block_size, model.num_kv_heads, model.head_size, dtype
        )

    def copy_blocks(self, src_to_dst: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks in every layer before the step writes into them."""
        if src_to_dst:
            copy_blocks(self.kv_caches, list(src_to_dst))

    @torch.inference_mode()
    def execute(
        self, seqs: Sequence[ScheduledSeq], block_copies: Sequence[tuple[int, int]] = ()
    ) -> tuple[torch.Tensor, list[str]]:
        """Run one step; return float32 logits [num_sampled, vocab] and their request ids."""
        self.copy_blocks(block_copies)
        t0 = time.perf_counter()
        batch: InputBatch = build_input_batch(seqs, self.block_size, self.num_groups, self.device)
        t1 = time.perf_counter()
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata)
        # NOTE: the LM head runs only on the rows that are sampled (the last token of each span).
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        self.last_timings = StepTimings(prepare=t1 - t0, forward=time.perf_counter() - t1)
        return logits, batch.sampled_req_ids
