"""BlockPool: every KV cache block, the free queue, ref counts and the prefix-cache index."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedattn.core.kv_cache_utils import (
    NULL_BLOCK_ID,
    BlockDoubleFreeError,
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    NoFreeBlocksError,
    block_extra_keys,
)
from pagedattn.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from pagedattn.core.request import Request

# Bytes of the KV cache group id at the end of a prefix-cache key (make_block_hash_with_group_id).
_GROUP_ID_BYTES = 4


class BlockPool:
    """Owns all blocks (created once), hands them out from the free queue and indexes full ones.

    Prefix cache: `cached_block_hash_to_block` maps a block's hash (with its group id) to the
    block. A cached block whose ref_cnt drops to 0 stays in the free queue and stays findable;
    it is evicted lazily, when the free queue hands it out again (least recently freed first).

    With `reserve_null_block`, block 0 is the null block: never free, never hashed, never
    ref-counted; sliding-window tables put it where a block fell out of the window (vLLM does the
    same). It is then not counted in `num_usable_blocks`.

    With `enable_kv_cache_events`, every change to the prefix-cache index is queued as a
    BlockStored / BlockRemoved / AllBlocksCleared event (vLLM's schema), drained by take_events().
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        reserve_null_block: bool = False,
        enable_kv_cache_events: bool = False,
    ):
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(
                f"num_blocks={num_blocks} is too small: need at least {1 + reserve_null_block}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.free_block_queue.popleft()
            assert self.null_block.block_id == NULL_BLOCK_ID
            self.null_block.is_null = True
        self.num_usable_blocks = num_blocks - reserve_null_block
        # Counters since the last take_num_evictions().
        self.num_evictions = 0
        self.enable_kv_cache_events = enable_kv_cache_events
        # NOTE: a deque, drained by popleft: a replica's drainer thread takes events while the
        # engine thread appends (see take_events).
        self.kv_event_queue: deque[KVCacheEvent] = deque()

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached-but-unreferenced ones included (they are evictable)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by at least one request."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the free queue head with ref_cnt 1, evicting their old hashes."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise NoFreeBlocksError(
                f"cannot allocate {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} are free"
            )
        # NOTE: the queue's popleft_n, inlined with the eviction: this is the allocation hot path.
        queue = self.free_block_queue
        head = queue.fake_free_list_head
        cache = self.cached_block_hash_to_block
        blocks = []
        removed: list[bytes] | None = [] if self.enable_kv_cache_events else None
        block = head.next_free_block
        for _ in range(num_blocks):
            blocks.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            if block.block_hash is not None:
                del cache[block.block_hash]
                if removed is not None:
                    removed.append(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head
        queue.num_free_blocks -= num_blocks
        if removed:
            self._queue_removed(removed)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a prefix-cache hit or a fork); unfree free ones."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 are appended to the free queue in order.

        Raises BlockDoubleFreeError for a block whose ref_cnt is already 0.
        """
        queue = self.free_block_queue
        tail = queue.fake_free_list_tail
        for block in ordered_blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt > 1:
                block.ref_cnt = ref_cnt - 1
            elif ref_cnt == 1:
                # NOTE: FreeKVCacheBlockQueue.append, inlined: this runs for every freed block.
                block.ref_cnt = 0
                last = tail.prev_free_block
                last.next_free_block = block
                block.prev_free_block = last
                block.next_free_block = tail
                tail.prev_free_block = block
                queue.num_free_blocks += 1
            elif not block.is_null:
                raise BlockDoubleFreeError(
                    f"block {block.block_id} freed with ref_cnt={block.ref_cnt} (double free)"
                )

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_suffix: bytes,
        request: Request | None = None,
    ) -> None:
        """Index blocks[num_cached_blocks:num_full_blocks] by their hashes (+ group suffix).

        A block whose hash is already cached (another request computed the same content) stays
        uncached; the earlier block keeps serving hits. Null blocks are skipped. With events on,
        `request` (whose blocks these are) supplies the token ids and extra keys of BlockStored.
        """
        cache = self.cached_block_hash_to_block
        stored: list[int] | None = [] if self.enable_kv_cache_events else None
        lora_id = None if request is None else request.lora_id
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            key = block_hashes[i] + group_suffix
            if key not in cache:
                cache[key] = block
                block.block_hash = key
                block.lora_id = lora_id
                if stored is not None:
                    stored.append(i)
        if stored:
            self._queue_stored(stored, block_hashes, group_suffix, request)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop blocks from the prefix cache (their contents were never computed)."""
        removed = []
        for block in blocks:
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                removed.append(block.block_hash)
                block.block_hash = None
        if removed and self.enable_kv_cache_events:
            self._queue_removed(removed)

    def uncache_lora_blocks(self, lora_id: str) -> int:
        """Drop every cached block of one LoRA adapter (it was unloaded); returns how many."""
        blocks = [b for b in self.cached_block_hash_to_block.values() if b.lora_id == lora_id]
        self.uncache_blocks(blocks)
        return len(blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held by a request."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events queued since the last call, oldest first (empty when events are off).

        NOTE: safe against an engine thread appending meanwhile. Swapping the list for a new one
        was not: `queue.append(BlockStored(...))` binds the old list before it builds the event,
        so an event built during the swap landed in a list already published, and was lost.
        """
        queue, events = self.kv_event_queue, []
        while queue:
            events.append(queue.popleft())
        return events

    def _queue_removed(self, keys: list[bytes]) -> None:
        by_group: dict[bytes, list[bytes]] = {}
        for key in keys:
            by_group.setdefault(key[-_GROUP_ID_BYTES:], []).append(key[:-_GROUP_ID_BYTES])
        for suffix, hashes in by_group.items():
            group_id = int.from_bytes(suffix, "big")
            self.kv_event_queue.append(BlockRemoved(tuple(hashes), group_id))

    def _queue_stored(
        self,
        indices: list[int],
        block_hashes: Sequence[bytes],
        group_suffix: bytes,
        request: Request | None,
    ) -> None:
        """One BlockStored per run of consecutive newly cached blocks (a gap breaks the chain)."""
        group_id = int.from_bytes(group_suffix, "big")
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            token_ids: tuple[int, ...] = ()
            extra_keys = None
            lora_name = None
            block_size = 0
            if request is not None and request.block_size:
                block_size = request.block_size
                token_ids = tuple(request.all_token_ids[first * block_size : end * block_size])
                lora_name = request.lora_id
                keys = [
                    block_extra_keys(
                        i * block_size,
                        (i + 1) * block_size,
                        request.lora_id,
                        request.mm_hashes,
                        request.cache_salt,
                    )
                    for i in run
                ]
                extra_keys = tuple(keys) if any(k is not None for k in keys) else None
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=tuple(block_hashes[first:end]),
                    parent_block_hash=block_hashes[first - 1] if first > 0 else None,
                    token_ids=token_ids,
                    block_size=block_size,
                    lora_name=lora_name,
                    extra_keys=extra_keys,
                    group_id=group_id,
                )
            )

    def take_num_evictions(self) -> int:
        """Evictions since the last call."""
        n, self.num_evictions = self.num_evictions, 0
        return n
