"""KV cache events (vLLM's schema): what the block pool stored, removed or cleared in one step.

Pure dataclasses; `pagedattn.distributed.kv_events` turns them into vLLM's msgspec structs and
publishes them. Block hashes are the 16-byte content hashes, without the KV cache group id.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedattn.core.kv_cache_utils import BlockHash

# The storage tier named in every event (vLLM's `medium`; it says "GPU" for its device cache).
MEDIUM_CPU = "CPU"


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache: consecutive blocks of one sequence, chained.

    `parent_block_hash` is the hash of the block before block_hashes[0] (None for a sequence's
    first block); `token_ids` holds len(block_hashes) * block_size tokens; `extra_keys` has one
    entry per block (the LoRA, multimodal and tenant-salt keys its hash covered, or None).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    extra_keys: tuple[tuple | None, ...] | None = None
    group_id: int = 0
    medium: str = MEDIUM_CPU


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted (their hashes no longer find a block)."""

    block_hashes: tuple[BlockHash, ...]
    group_id: int = 0
    medium: str = MEDIUM_CPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset_prefix_cache)."""

    medium: str = MEDIUM_CPU


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
