"""KV cache events from the block pool: they replay to exactly the prefix-cache index."""

from __future__ import annotations

import random

from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedattn.core.kv_cache_utils import hash_request_tokens
from pagedattn.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedattn.core.request import Request


def make_manager(num_blocks: int, block_size: int = 4, hybrid: bool = False) -> KVCacheManager:
    groups = [KVCacheGroupSpec(("layer.0",), FullAttentionSpec(block_size))]
    if hybrid:
        groups.append(KVCacheGroupSpec(("layer.1",), SlidingWindowSpec(block_size, 2 * block_size)))
    return KVCacheManager(groups, num_blocks, enable_kv_cache_events=True)


def run(manager: KVCacheManager, request_id: str, tokens: list[int], num_decode: int = 0, **kw):
    """Admit a whole prompt, decode num_decode tokens, free; returns the request."""
    request = Request(request_id, tokens, block_size=manager.block_size, **kw)
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hit_blocks, num_hit)
    request.num_computed_tokens = request.num_tokens
    for t in range(num_decode):
        request.append_output_token_ids(1000 + t)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    manager.free(request)
    return request


def replay(index: set[tuple[int, bytes]], events) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                assert (event.group_id, h) not in index, "stored twice without a removal"
                index.add((event.group_id, h))
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                index.remove((event.group_id, h))
        else:
            assert isinstance(event, AllBlocksCleared)
            index.clear()


def cached_set(manager: KVCacheManager) -> set[tuple[int, bytes]]:
    return {
        (int.from_bytes(key[-4:], "big"), key[:-4])
        for key in manager.block_pool.cached_block_hash_to_block
    }


def test_events_are_off_by_default():
    groups = [KVCacheGroupSpec(("layer.0",), FullAttentionSpec(4))]
    manager = KVCacheManager(groups, 16)
    run(manager, "a", list(range(12)))
    assert manager.take_events() == []
    assert len(manager.block_pool.cached_block_hash_to_block) == 3


def test_block_stored_carries_chain_tokens_and_salt():
    manager = make_manager(32)
    tokens = list(range(10))
    run(manager, "a", tokens, cache_salt="tenant-1")
    (event,) = manager.take_events()
    assert isinstance(event, BlockStored)
    expected = hash_request_tokens(4, tokens, "pagedattn", cache_salt="tenant-1")
    assert list(event.block_hashes) == expected  # 2 full blocks of 4; the last 2 tokens are not
    assert event.parent_block_hash is None
    assert event.token_ids == tuple(range(8))
    assert event.block_size == 4
    assert event.extra_keys == ((("salt", "tenant-1"),), None)
    # A longer prompt with the same prefix stores only its new block, chained to the old ones.
    run(manager, "b", tokens + [10, 11], cache_salt="tenant-1")
    (event,) = manager.take_events()
    assert event.parent_block_hash == expected[1]
    assert event.token_ids == (8, 9, 10, 11)
    assert event.extra_keys is None


def test_decode_fills_blocks_that_are_stored_in_later_events():
    manager = make_manager(32)
    run(manager, "a", [1, 2, 3], num_decode=6)  # 9 tokens: 2 full blocks, filled while decoding
    events = manager.take_events()
    assert all(isinstance(e, BlockStored) for e in events)
    stored = [h for e in events for h in e.block_hashes]
    assert len(stored) == 2
    assert [t for e in events for t in e.token_ids] == [1, 2, 3, 1000, 1001, 1002, 1003, 1004]


def test_replay_equals_cache_through_evictions_and_reset():
    rng = random.Random(0)
    manager = make_manager(24)
    prefixes = [[rng.randrange(500) for _ in range(8)] for _ in range(3)]
    index: set[tuple[int, bytes]] = set()
    num_removed = 0
    for i in range(60):
        tokens = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(1, 14))]
        run(manager, f"r{i}", tokens, num_decode=rng.randrange(4))
        events = manager.take_events()
        num_removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        replay(index, events)
        assert index == cached_set(manager)
    assert num_removed > 0, "the pool is small enough that the run evicts"
    assert manager.reset_prefix_cache()
    events = manager.take_events()
    assert events == [AllBlocksCleared()]
    replay(index, events)
    assert index == cached_set(manager) == set()


def test_hybrid_groups_tag_events_with_their_group():
    manager = make_manager(40, hybrid=True)
    index: set[tuple[int, bytes]] = set()
    for i in range(12):
        run(manager, f"r{i}", list(range(i, i + 13)), num_decode=3)
        replay(index, manager.take_events())
        assert index == cached_set(manager)
    assert {group for group, _ in index} == {0, 1}


def test_refused_reset_emits_nothing():
    manager = make_manager(16)
    request = Request("held", list(range(8)), block_size=4)
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    manager.allocate_slots(request, 8, hit_blocks, num_hit)
    manager.take_events()
    assert not manager.reset_prefix_cache()
    assert manager.take_events() == []
