"""Per-KV-cache-group block tables: full attention and sliding window managers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedattn.core.block_pool import BlockPool
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedattn.core.kv_cache_utils import BlockHash, KVCacheBlock, make_block_hash_with_group_id

if TYPE_CHECKING:
    from pagedattn.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group: request id -> ordered blocks (entry j = tokens jB..)."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.group_suffix = make_block_hash_with_group_id(b"", group_id)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Blocks of each request already offered to the prefix cache.
        self.num_cached_block: dict[str, int] = {}

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Cached blocks of the longest usable prefix of at most max_length tokens."""
        raise NotImplementedError

    def trim_computed_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Prefix-hit blocks with the ones this group will never read replaced by null."""
        return blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future token of the request can attend to (none for full attention)."""

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Free-queue blocks needed to hold num_tokens (hits that sit in the free queue count)."""
        blocks = self.req_to_blocks.get(request_id)
        num_existing = len(blocks) if blocks is not None else 0
        num_new = cdiv(num_tokens, self.block_size) - num_existing - len(new_computed_blocks)
        num_evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return max(num_new, 0) + num_evictable

    def get_num_shared_blocks_to_write(
        self, request_id: str, num_computed_tokens: int, num_tokens: int
    ) -> int:
        """Existing blocks that tokens [num_computed_tokens, num_tokens) write and others share."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        last = min(len(blocks), cdiv(num_tokens, self.block_size))
        num_shared = 0
        for i in range(num_computed_tokens // self.block_size, last):
            if blocks[i].ref_cnt > 1:
                num_shared += 1
        return num_shared

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: list[KVCacheBlock]
    ) -> None:
        """Start the table of a new request with its prefix-cache hits (touched)."""
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def copy_on_write(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        block_copies: list[tuple[int, int]],
    ) -> bool:
        """Give the request its own copy of each shared block it is about to write; True if any.

        A (src, dst) pair is recorded when src holds computed tokens that dst must inherit.
        """
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return False
        block_size = self.block_size
        replaced = False
        last = min(len(blocks), cdiv(num_tokens, block_size))
        for i in range(num_computed_tokens // block_size, last):
            old = blocks[i]
            if old.ref_cnt <= 1:
                continue
            new = self.block_pool.get_new_blocks(1)[0]
            self.block_pool.free_blocks((old,))
            blocks[i] = new
            replaced = True
            if i * block_size < num_computed_tokens:
                block_copies.append((old.block_id, new.block_id))
        return replaced

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Append blocks until the table covers num_tokens; returns the appended blocks."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the blocks that are full within num_tokens (and hashed) to the prefix cache."""
        request_id = request.request_id
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_block[request_id]
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                self.req_to_blocks[request_id],
                request.block_hashes,
                num_cached,
                num_full,
                self.group_suffix,
                request,
            )
            self.num_cached_block[request_id] = num_full

    def fork(self, parent_id: str, child_id: str) -> None:
        """Child's table = parent's, every block gaining one reference."""
        blocks = list(self.req_to_blocks[parent_id])
        self.block_pool.touch(blocks)
        self.req_to_blocks[child_id] = blocks
        self.num_cached_block[child_id] = self.num_cached_block[parent_id]

    def free_tail(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Release the blocks past the first num_tokens tokens (rejected draft slots), tail first.

        NOTE: such blocks hold no accepted token, so none of them is in the prefix cache.
        """
        blocks = self.req_to_blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return []
        tail = blocks[keep:]
        del blocks[keep:]
        self.num_cached_block[request_id] = min(self.num_cached_block[request_id], keep)
        tail.reverse()
        self.block_pool.free_blocks(tail)
        return tail

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so shared prefixes are evicted last."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            blocks.reverse()
            self.block_pool.free_blocks(blocks)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block stays; a hit is the cached prefix up to the first miss."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Hits from the first block on, stopping at the first miss."""
        cache = self.block_pool.cached_block_hash_to_block
        suffix = self.group_suffix
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = cache.get(block_hash + suffix)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: blocks wholly out of the window are freed and replaced by the null block."""

    def __init__(self, spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        assert block_pool.null_block is not None, "sliding window needs the null block"
        self.null_block = block_pool.null_block
        self.sliding_window = spec.sliding_window
        # A token at position n reads keys n-w+1 .. n-1: that many blocks before n must be cached.
        self.num_contiguous_blocks = cdiv(spec.sliding_window - 1, spec.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Longest n whose last ceil((w-1)/B) blocks are cached (vLLM's rule); null before them.

        Scans from the right; a run of hits that reaches block 0 is a hit even when shorter.
        """
        cache = self.block_pool.cached_block_hash_to_block
        suffix = self.group_suffix
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        hits = [self.null_block] * max_num_blocks
        num_contiguous = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = cache.get(block_hashes[i] + suffix)
            if block is None:
                num_contiguous = 0
                continue
            hits[i] = block
            num_contiguous += 1
            if num_contiguous >= self.num_contiguous_blocks:
                del hits[i + num_contiguous :]
                return hits
        del hits[num_contiguous:]
        return hits

    def _first_useful_block(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size

    def trim_computed_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Hits wholly before the window of token num_computed_tokens become null."""
        first = min(self._first_useful_block(num_computed_tokens), len(blocks))
        return [self.null_block] * first + blocks[first:]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks wholly before the window of the next token; they become the null block."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        removed = []
        null_block = self.null_block
        for i in range(min(self._first_useful_block(num_computed_tokens), len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = null_block
        if removed:
            self.block_pool.free_blocks(removed)


def make_single_type_manager(
    spec: KVCacheSpec, block_pool: BlockPool, group_id: int
) -> SingleTypeKVCacheManager:
    """The manager class for a spec."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_pool, group_id)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, block_pool, group_id)
    raise TypeError(f"no manager for KV cache spec {type(spec).__name__}")
