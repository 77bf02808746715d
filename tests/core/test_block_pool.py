"""BlockPool: allocation, ref counts, free order, lazy LRU eviction, prefix-cache index."""

from __future__ import annotations

import pytest

from pagedattn.core.block_pool import BlockPool
from pagedattn.core.kv_cache_utils import (
    NULL_BLOCK_ID,
    BlockDoubleFreeError,
    NoFreeBlocksError,
    hash_request_tokens,
)
from pagedattn.core.kv_events import AllBlocksCleared

G0 = (0).to_bytes(4, "big")


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def test_blocks_created_once_and_handed_out_from_head():
    pool = BlockPool(4, enable_caching=True)
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3]
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 1 and pool.get_usage() == pytest.approx(0.75)
    with pytest.raises(NoFreeBlocksError, match="only 1 are free"):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1  # nothing half-allocated


def test_free_appends_in_given_order_and_double_free_raises():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 0]
    with pytest.raises(BlockDoubleFreeError, match="block 3"):
        pool.free_blocks([blocks[3]])


def test_shared_block_returns_to_queue_only_at_ref_cnt_zero():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 2


def test_cached_free_block_stays_findable_until_handed_out_lru_first():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = hash_request_tokens(1, [10, 11, 12], "s")
    pool.cache_full_blocks(blocks, hashes, 0, 3, G0)
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])  # LRU order: 1, 0, 2
    assert all(pool.cached_block_hash_to_block.get(h + G0) is not None for h in hashes)
    assert len(pool.cached_block_hash_to_block) == 3
    (new,) = pool.get_new_blocks(1)
    assert new.block_id == 1 and new.block_hash is None
    assert pool.cached_block_hash_to_block.get(hashes[1] + G0) is None
    assert pool.cached_block_hash_to_block.get(hashes[0] + G0) is blocks[0]
    assert pool.take_num_evictions() == 1 and pool.take_num_evictions() == 0


def test_touch_revives_a_cached_free_block_from_the_middle_of_the_queue():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = hash_request_tokens(1, [1, 2, 3], "s")
    pool.cache_full_blocks(blocks, hashes, 0, 3, G0)
    pool.free_blocks(blocks)
    hit = pool.cached_block_hash_to_block.get(hashes[1] + G0)
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_ids(pool) == [0, 2]
    assert pool.cached_block_hash_to_block.get(hashes[1] + G0) is hit  # still cached while in use


def test_duplicate_content_keeps_first_block_cached():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    (h,) = hash_request_tokens(2, [1, 2], "s")
    pool.cache_full_blocks([a], [h], 0, 1, G0)
    pool.cache_full_blocks([b], [h], 0, 1, G0)
    assert pool.cached_block_hash_to_block.get(h + G0) is a and b.block_hash is None
    # Another group's key is distinct.
    pool.cache_full_blocks([b], [h], 0, 1, (1).to_bytes(4, "big"))
    assert pool.cached_block_hash_to_block.get(h + (1).to_bytes(4, "big")) is b


def test_reset_prefix_cache_only_when_nothing_in_use():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hash_request_tokens(1, [1, 2], "s"), 0, 2, G0)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in blocks)


def test_null_block_reserved_and_ignored_by_touch_and_free():
    pool = BlockPool(3, enable_caching=True, reserve_null_block=True)
    null = pool.null_block
    assert null is not None and null.block_id == NULL_BLOCK_ID and null.is_null
    assert pool.num_usable_blocks == 2 and pool.get_num_free_blocks() == 2
    assert NULL_BLOCK_ID not in free_ids(pool)
    pool.touch([null])
    pool.free_blocks([null])
    assert null.ref_cnt == 0 and NULL_BLOCK_ID not in free_ids(pool)
    assert pool.reset_prefix_cache() is True
    with pytest.raises(ValueError, match="too small"):
        BlockPool(1, enable_caching=True, reserve_null_block=True)


def test_an_event_appended_while_the_events_are_taken_is_not_lost():
    """A replica's drainer thread takes the events while the engine thread appends one: the
    append binds the queue before it builds the event (`queue.append(BlockStored(...))`), so the
    event lands in the queue as it was before the take, and the next take must return it."""
    pool = BlockPool(num_blocks=4, enable_caching=True, enable_kv_cache_events=True)
    pool.reset_prefix_cache()
    bound = pool.kv_event_queue  # what the engine thread's append has bound
    assert [type(e) for e in pool.take_events()] == [AllBlocksCleared]
    late = AllBlocksCleared()
    bound.append(late)  # the append finishes after the drainer's take
    assert pool.take_events() == [late]
    assert pool.take_events() == []
