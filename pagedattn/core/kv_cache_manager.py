"""KVCacheManager: prefix-cache lookup, slot allocation, free, fork/copy-on-write, stats."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedattn.core.block_pool import BlockPool
from pagedattn.core.kv_cache_spec import KVCacheGroupSpec, KVCacheSpecError, SlidingWindowSpec
from pagedattn.core.kv_cache_utils import KVCacheBlock, KVCacheError, UnknownRequestError
from pagedattn.core.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    cdiv,
    make_single_type_manager,
)

if TYPE_CHECKING:
    from pagedattn.core.request import Request


class KVCacheBlocks:
    """Blocks per KV cache group (a prefix hit, or the blocks a call appended)."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[list[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group."""
        return tuple([block.block_id for block in group] for group in self.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


@dataclass
class KVCacheStats:
    """A snapshot of KV cache memory; queries, hits and evictions count since the last reset."""

    usage: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    # Allocated (non-null) slots minus the computed tokens they hold, over all requests.
    internal_fragmentation: int
    num_cow_copies: int = 0
    num_blocks_per_request: dict[str, int] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens (0 when nothing was queried)."""
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class KVCacheManager:
    """Block tables of every request over all KV cache groups, drawn from one BlockPool.

    Misuse: `free` of a request without blocks (unknown, or already freed) is a no-op, as in
    vLLM, so preempt-then-abort is safe; a block freed twice at the pool level raises
    BlockDoubleFreeError; `fork` from an unknown parent or into an existing child and
    `get_block_ids` of an unknown request raise UnknownRequestError / KVCacheError.
    """

    def __init__(
        self,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        num_blocks: int,
        enable_caching: bool = True,
        hash_seed: str = "pagedattn",
        enable_kv_cache_events: bool = False,
    ) -> None:
        if not kv_cache_groups:
            raise KVCacheSpecError("kv_cache_groups is empty: give at least one KVCacheGroupSpec")
        block_sizes = {group.spec.block_size for group in kv_cache_groups}
        if len(block_sizes) != 1:
            raise KVCacheSpecError(
                f"KV cache groups use block sizes {sorted(block_sizes)}: use one block size"
            )
        self.kv_cache_groups = list(kv_cache_groups)
        self.num_blocks = num_blocks
        self.block_size: int = block_sizes.pop()
        self.enable_caching = enable_caching
        self.hash_seed = hash_seed
        needs_null = any(isinstance(g.spec, SlidingWindowSpec) for g in kv_cache_groups)
        self.block_pool = BlockPool(
            num_blocks,
            enable_caching,
            reserve_null_block=needs_null,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.managers: list[SingleTypeKVCacheManager] = [
            make_single_type_manager(group.spec, self.block_pool, group_id)
            for group_id, group in enumerate(kv_cache_groups)
        ]
        self.num_groups = len(self.managers)
        # NOTE: one full-attention group takes a fast path in allocate_slots for decode steps.
        self._single_full = self.num_groups == 1 and isinstance(
            self.managers[0], FullAttentionManager
        )
        self._req_to_blocks0 = self.managers[0].req_to_blocks
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple([] for _ in self.managers))
        self.requests: dict[str, Request] = {}
        self._block_copies: list[tuple[int, int]] = []
        # Shared partial blocks copied before a write, since start-up.
        self.num_cow_copies = 0
        self._num_queries = 0
        self._num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that allocate_slots can hand out (evictable cached blocks included)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_usable_blocks(self) -> int:
        """All blocks requests can hold (the null block excluded)."""
        return self.block_pool.num_usable_blocks

    def num_blocks_needed(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of num_tokens holds at its peak, summed over the KV cache groups.

        A sliding-window group holds the window plus the largest chunk of one step, and a partial
        block at each end; a full-attention group holds every block.
        """
        block_size = self.block_size
        num_full = cdiv(num_tokens, block_size)
        num_needed = 0
        for group in self.kv_cache_groups:
            if isinstance(group.spec, SlidingWindowSpec):
                span = group.spec.sliding_window - 1 + max_num_batched_tokens
                num_needed += min(num_full, cdiv(span, block_size) + 1)
            else:
                num_needed += num_full
        return num_needed

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request and its length in tokens (block-aligned).

        At most num_tokens - 1 tokens hit: the last token is always computed for its logits.
        The hit blocks are not referenced until allocate_slots(new_computed_blocks=...).
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        if request.block_size != self.block_size or request.hash_seed != self.hash_seed:
            raise KVCacheError(
                f"request {request.request_id!r} hashes blocks of {request.block_size} tokens "
                f"with seed {request.hash_seed!r}; the cache uses {self.block_size} and "
                f"{self.hash_seed!r}: build it with Request(..., block_size, hash_seed) to match"
            )
        max_length = request.num_tokens - 1
        block_hashes = request.block_hashes
        while True:
            hits = [m.find_longest_cache_hit(block_hashes, max_length) for m in self.managers]
            num_hit_blocks = min(len(h) for h in hits)
            if all(len(h) == num_hit_blocks for h in hits):
                break
            max_length = num_hit_blocks * self.block_size
        num_hit_tokens = num_hit_blocks * self.block_size
        # NOTE: queries and hits are counted when the admission's allocate_slots succeeds, so a
        # request that waits at the head of the queue for k steps counts once, not k times.
        return KVCacheBlocks(tuple(hits)), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for num_new_tokens after the computed (and newly hit) tokens.

        Returns the blocks appended to each group's table (do not mutate it), or None when the
        free blocks do not suffice; then nothing was allocated. Shared blocks about to be
        written are replaced by copies first (see take_block_copies). Full blocks are offered
        to the prefix cache as soon as their tokens are known.
        """
        if self._single_full and new_computed_blocks is None and num_new_tokens > 0:
            blocks = self._req_to_blocks0.get(request.request_id)
            if blocks is not None:
                # NOTE: fast path: no shared block is written (the only block written before
                # the new ones is the unshared last block), so only appends are needed.
                block_size = self.block_size
                num_computed = request.num_computed_tokens
                num_tokens = num_computed + num_new_tokens
                index = num_computed // block_size
                num_blocks = len(blocks)
                if index == num_blocks or (index == num_blocks - 1 and blocks[index].ref_cnt == 1):
                    out = self.empty_kv_cache_blocks
                    num_new_blocks = (num_tokens - 1) // block_size + 1 - num_blocks
                    if num_new_blocks > 0:
                        pool = self.block_pool
                        if num_new_blocks > pool.free_block_queue.num_free_blocks:
                            return None
                        new_blocks = pool.get_new_blocks(num_new_blocks)
                        blocks.extend(new_blocks)
                        out = KVCacheBlocks((new_blocks,))
                    if self.enable_caching and num_tokens // block_size != index:
                        self.managers[0].cache_blocks(request, min(num_tokens, request.num_tokens))
                    return out
        return self._allocate_slots(
            request, num_new_tokens, new_computed_blocks, num_new_computed_tokens
        )

    def _allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_new_computed_tokens: int,
    ) -> KVCacheBlocks | None:
        request_id = request.request_id
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} must be > 0 ({request_id!r})")
        known = request_id in self.requests
        if new_computed_blocks is not None and known:
            raise KVCacheError(
                f"request {request_id!r} already has blocks: new_computed_blocks is only for "
                "a request's first allocation (free it first when resuming after preemption)"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        managers = self.managers
        computed: list[list[KVCacheBlock]] = [[] for _ in managers]
        if new_computed_blocks is not None:
            computed = [
                m.trim_computed_blocks(blocks, num_computed)
                for m, blocks in zip(managers, new_computed_blocks.blocks, strict=True)
            ]
        for m in managers:
            m.remove_skipped_blocks(request_id, request.num_computed_tokens)
        num_needed = 0
        for m, blocks in zip(managers, computed, strict=True):
            num_needed += m.get_num_blocks_to_allocate(request_id, num_tokens, blocks)
            num_needed += m.get_num_shared_blocks_to_write(request_id, num_computed, num_tokens)
        if num_needed > self.block_pool.get_num_free_blocks():
            return None
        if not known:
            for m, blocks in zip(managers, computed, strict=True):
                m.save_new_computed_blocks(request_id, blocks)
            self.requests[request_id] = request
            if new_computed_blocks is not None and self.enable_caching:
                self._num_queries += request.num_tokens
                self._num_hits += num_new_computed_tokens
        for m in managers:
            if m.copy_on_write(request_id, num_computed, num_tokens, self._block_copies):
                self.num_cow_copies += 1
        new_blocks = tuple(m.allocate_new_blocks(request_id, num_tokens) for m in managers)
        if self.enable_caching:
            num_known_tokens = min(num_tokens, request.num_tokens)
            for m in managers:
                m.cache_blocks(request, num_known_tokens)
        return KVCacheBlocks(new_blocks)

    def free(self, request: Request) -> None:
        """Release all blocks of the request (finished, aborted or preempted); no-op if none."""
        for m in self.managers:
            m.free(request.request_id)
        self.requests.pop(request.request_id, None)

    def free_rejected_slots(self, request: Request) -> int:
        """Roll back a speculative step: free every block past the request's computed tokens.

        The scheduler first sets ``num_computed_tokens`` to the accepted length; a block that
        held only rejected draft tokens goes straight back to the free queue. Full blocks of
        accepted tokens are offered to the prefix cache now. Returns the blocks freed.
        """
        if request.request_id not in self.requests:
            return 0
        num_computed = request.num_computed_tokens
        num_freed = sum(len(m.free_tail(request.request_id, num_computed)) for m in self.managers)
        if self.enable_caching:
            for m in self.managers:
                m.cache_blocks(request, num_computed)
        return num_freed

    def uncomputed_block_ids(self, request_id: str, num_computed_tokens: int) -> set[int]:
        """Ids of the request's blocks holding positions >= num_computed_tokens (all groups)."""
        first = num_computed_tokens // self.block_size
        return {
            b.block_id
            for m in self.managers
            for b in m.req_to_blocks.get(request_id, [])[first:]
            if not b.is_null
        }

    def uncache_block_ids(self, block_ids: set[int]) -> None:
        """Drop these blocks from the prefix cache: a failed step never computed them."""
        self.block_pool.uncache_blocks(self.block_pool.blocks[i] for i in block_ids)

    def fork(self, parent: Request, child: Request) -> None:
        """Give child the parent's block tables; every block gains a reference.

        The caller makes child's tokens and num_computed_tokens equal to the parent's (see
        Request.clone). The first of the two to write a shared partial block copies it.
        """
        if parent.request_id not in self.requests:
            raise UnknownRequestError(f"cannot fork {parent.request_id!r}: it holds no blocks")
        if child.request_id in self.requests:
            raise KVCacheError(f"cannot fork into {child.request_id!r}: it already holds blocks")
        for m in self.managers:
            m.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table per group (null placeholders included)."""
        if request_id not in self.requests:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks")
        return tuple([b.block_id for b in m.req_to_blocks[request_id]] for m in self.managers)

    def cached_block_keys(self) -> list[bytes]:
        """Every prefix-cache key now (block hash + 4-byte group id), in no particular order."""
        return list(self.block_pool.cached_block_hash_to_block)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs since the last call, to run before the forward."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def uncache_lora_blocks(self, lora_id: str) -> int:
        """Drop every cached block computed under one LoRA adapter; returns how many."""
        return self.block_pool.uncache_lora_blocks(lora_id)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes; False (nothing done) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def take_events(self):
        """KV cache events (core.kv_events) since the last call; empty unless events are on."""
        return self.block_pool.take_events()

    def make_stats(self, reset: bool = True) -> KVCacheStats:
        """Current usage plus counters since the last reset (reset them unless reset=False)."""
        pool = self.block_pool
        block_size = self.block_size
        per_request: dict[str, int] = {}
        fragmentation = 0
        for request_id, request in self.requests.items():
            num_blocks = 0
            for m in self.managers:
                blocks = m.req_to_blocks[request_id]
                num_real = sum(1 for b in blocks if not b.is_null)
                num_blocks += num_real
                num_held = request.num_computed_tokens - (len(blocks) - num_real) * block_size
                fragmentation += num_real * block_size - max(num_held, 0)
            per_request[request_id] = num_blocks
        stats = KVCacheStats(
            usage=pool.get_usage(),
            num_blocks=pool.num_usable_blocks,
            num_free_blocks=pool.get_num_free_blocks(),
            num_cached_blocks=len(pool.cached_block_hash_to_block),
            prefix_cache_queries=self._num_queries,
            prefix_cache_hits=self._num_hits,
            num_evictions=pool.num_evictions,
            internal_fragmentation=fragmentation,
            num_cow_copies=self.num_cow_copies,
            num_blocks_per_request=per_request,
        )
        if reset:
            self._num_queries = self._num_hits = 0
            pool.take_num_evictions()
        return stats

    @property
    def stats(self) -> KVCacheStats:
        """make_stats without resetting the counters."""
        return self.make_stats(reset=False)
