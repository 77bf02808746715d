"""KVCacheManager: prefix hits, allocation, free, eviction, fork/CoW, errors, stats."""

from __future__ import annotations

import pytest

from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpecError,
    SlidingWindowSpec,
)
from pagedattn.core.kv_cache_utils import (
    NULL_BLOCK_ID,
    KVCacheError,
    UnknownRequestError,
)
from pagedattn.core.request import Request


def make_manager(num_blocks: int, block_size: int = 16, caching: bool = True) -> KVCacheManager:
    groups = [KVCacheGroupSpec(("layer.0",), FullAttentionSpec(block_size))]
    return KVCacheManager(groups, num_blocks, enable_caching=caching)


def make_request(manager: KVCacheManager, request_id: str, tokens: list[int], **kw) -> Request:
    return Request(request_id, tokens, block_size=manager.block_size, **kw)


def admit(manager: KVCacheManager, request: Request) -> int | None:
    """First scheduling of a whole prompt; returns the hit tokens (None: does not fit)."""
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    if manager.allocate_slots(request, request.num_tokens - num_hit, hit_blocks, num_hit) is None:
        return None
    request.num_computed_tokens = request.num_tokens
    return num_hit


def decode(manager: KVCacheManager, request: Request, token: int) -> None:
    request.append_output_token_ids(token)
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1


def table(manager: KVCacheManager, request: Request) -> list[int]:
    return manager.get_block_ids(request.request_id)[0]


def test_spec_worked_example_35_tokens():
    manager = make_manager(16)
    req = make_request(manager, "a", list(range(35)))
    assert admit(manager, req) == 0
    block_ids = table(manager, req)
    assert len(block_ids) == 3
    stats = manager.make_stats()
    assert stats.internal_fragmentation == 16 - 3  # the last block holds 3/16
    assert stats.num_blocks_per_request == {"a": 3} and stats.num_cached_blocks == 2
    slots = AttentionMetadata.build([35], [35], [block_ids], 16).slot_mapping.tolist()
    assert slots[20] == block_ids[1] * 16 + 4


def test_decode_appends_a_block_only_when_the_last_one_is_full():
    manager = make_manager(8, block_size=4)
    req = make_request(manager, "a", [1, 2, 3])
    admit(manager, req)
    assert len(table(manager, req)) == 1
    decode(manager, req, 4)
    assert len(table(manager, req)) == 1
    req.append_output_token_ids(5)
    new = manager.allocate_slots(req, 1)
    assert len(new.blocks[0]) == 1 and table(manager, req)[-1] == new.blocks[0][0].block_id


def test_block_size_one():
    manager = make_manager(10, block_size=1)
    a = make_request(manager, "a", [5, 6, 7, 8, 9])
    assert admit(manager, a) == 0 and len(table(manager, a)) == 5
    decode(manager, a, 1)
    assert len(table(manager, a)) == 6
    b = make_request(manager, "b", [5, 6, 7, 8, 9])
    assert admit(manager, b) == 4  # last prompt token recomputed
    assert table(manager, b)[:4] == table(manager, a)[:4]


@pytest.mark.parametrize(
    ("prompt_len", "num_blocks", "num_hit"), [(15, 1, 0), (16, 1, 0), (17, 2, 16), (32, 2, 16)]
)
def test_prompt_lengths_at_block_boundaries(prompt_len, num_blocks, num_hit):
    manager = make_manager(16)
    a = make_request(manager, "a", list(range(prompt_len)))
    admit(manager, a)
    assert len(table(manager, a)) == num_blocks
    b = make_request(manager, "b", list(range(prompt_len)))
    assert admit(manager, b) == num_hit
    assert len(table(manager, b)) == num_blocks
    assert table(manager, b)[: num_hit // 16] == table(manager, a)[: num_hit // 16]


def test_fully_cached_prompt_recomputes_last_token_in_a_fresh_block():
    manager = make_manager(8, block_size=4)
    a = make_request(manager, "a", list(range(8)))
    admit(manager, a)
    manager.free(a)
    b = make_request(manager, "b", list(range(8)))
    hit_blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4 and len(hit_blocks.blocks[0]) == 1
    new = manager.allocate_slots(b, 4, hit_blocks, num_hit)
    assert len(new.blocks[0]) == 1 and table(manager, b)[0] == table(manager, b)[0]


def test_generated_block_cached_as_soon_as_full():
    manager = make_manager(8, block_size=4)
    a = make_request(manager, "a", [1, 2, 3])
    admit(manager, a)
    decode(manager, a, 4)  # block 0 now full with a generated token
    b = make_request(manager, "b", [1, 2, 3, 4, 9])
    assert admit(manager, b) == 4
    assert table(manager, b)[0] == table(manager, a)[0]


def test_eviction_is_lazy_and_lru_with_tail_blocks_first():
    manager = make_manager(4, block_size=2)
    a = make_request(manager, "a", [1, 2, 3, 4, 5, 6, 7])  # 4 blocks, 3 cached
    admit(manager, a)
    a_table = table(manager, a)
    manager.free(a)
    free_order = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order == a_table[::-1]  # tail first: the shared prefix is evicted last
    assert manager.stats.num_cached_blocks == 3
    c = make_request(manager, "c", [9, 9, 9])  # 2 blocks: evicts a's partial block and its block 2
    admit(manager, c)
    assert manager.make_stats().num_evictions == 1
    manager.free(c)
    b = make_request(manager, "b", [1, 2, 3, 4, 5, 6, 8])
    assert admit(manager, b) == 4  # a's first two blocks survived
    assert table(manager, b)[:2] == a_table[:2]


def test_cannot_allocate_returns_none_and_changes_nothing():
    manager = make_manager(3, block_size=4)
    a = make_request(manager, "a", list(range(8)))
    admit(manager, a)
    b = make_request(manager, "b", list(range(100, 109)))  # needs 3 blocks, 1 free
    free_before = manager.num_free_blocks
    assert admit(manager, b) is None
    assert manager.num_free_blocks == free_before and "b" not in manager.requests
    with pytest.raises(UnknownRequestError):
        manager.get_block_ids("b")


def test_cached_free_blocks_count_as_free_and_hits_in_free_queue_count_as_used():
    manager = make_manager(4, block_size=2)
    a = make_request(manager, "a", [1, 2, 3, 4, 5, 6])
    admit(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4  # three cached blocks are evictable
    c = make_request(manager, "c", [7])
    admit(manager, c)  # takes the one never-used block
    b = make_request(manager, "b", [1, 2, 3, 4, 5, 6, 7, 8])
    # 3 hits sit in the free queue: touching them leaves no block for the 4th.
    assert admit(manager, b) is None and manager.num_free_blocks == 3
    manager.free(c)
    assert admit(manager, b) == 6


def test_free_unknown_and_double_free_are_noops():
    manager = make_manager(4, block_size=2)
    a = make_request(manager, "a", [1, 2, 3])
    manager.free(a)  # never allocated
    admit(manager, a)
    manager.free(a)
    manager.free(a)  # preempt then abort
    assert manager.num_free_blocks == 4 and manager.requests == {}


@pytest.mark.parametrize("parent_first", [True, False])
def test_fork_then_free_in_either_order(parent_first):
    manager = make_manager(8, block_size=4)
    parent = make_request(manager, "p", list(range(10)))
    admit(manager, parent)
    child = parent.fork("c")
    manager.fork(parent, child)
    assert table(manager, child) == table(manager, parent)
    blocks = manager.managers[0].req_to_blocks["p"]
    assert [b.ref_cnt for b in blocks] == [2, 2, 2] and manager.num_free_blocks == 5
    first, second = (parent, child) if parent_first else (child, parent)
    manager.free(first)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1] and manager.num_free_blocks == 5
    decode(manager, second, 99)  # the survivor writes its (now private) partial block in place
    assert manager.take_block_copies() == []
    manager.free(second)
    assert manager.num_free_blocks == 8


def test_copy_on_write_of_shared_partial_block():
    manager = make_manager(8, block_size=4)
    parent = make_request(manager, "p", list(range(10)))  # block 2 holds 2/4 tokens
    admit(manager, parent)
    child = parent.fork("c")
    manager.fork(parent, child)
    shared = table(manager, parent)
    decode(manager, child, 50)
    child_table = table(manager, child)
    assert child_table[:2] == shared[:2] and child_table[2] != shared[2]
    assert manager.take_block_copies() == [(shared[2], child_table[2])]
    assert manager.take_block_copies() == []
    decode(manager, parent, 60)  # now the only owner: no copy
    assert table(manager, parent) == shared and manager.take_block_copies() == []
    full_blocks = manager.managers[0].req_to_blocks["p"][:2]
    assert [b.ref_cnt for b in full_blocks] == [2, 2]


def test_full_shared_block_is_not_copied_and_cow_without_room_returns_none():
    manager = make_manager(3, block_size=4)
    parent = make_request(manager, "p", list(range(8)))
    admit(manager, parent)
    child = parent.fork("c")
    manager.fork(parent, child)
    decode(manager, child, 1)  # new block appended, full blocks stay shared
    assert manager.take_block_copies() == [] and manager.num_free_blocks == 0
    child.append_output_token_ids(2)
    parent.append_output_token_ids(3)
    grand = child.fork("g")
    manager.fork(child, grand)
    assert manager.allocate_slots(grand, 1) is None  # CoW needs a block; none free
    assert table(manager, grand) == table(manager, child)


def test_cache_salt_and_lora_isolate_prefixes():
    manager = make_manager(8, block_size=4)
    tokens = list(range(9))

    def num_hit(request_id: str, **kw) -> int | None:
        request = make_request(manager, request_id, tokens, **kw)
        hit = admit(manager, request)
        manager.free(request)
        return hit

    assert num_hit("a", cache_salt="tenant-1") == 0
    assert num_hit("b", cache_salt="tenant-2") == 0
    assert num_hit("c") == 0
    assert num_hit("d", cache_salt="tenant-1") == 8
    assert num_hit("e", lora_id="adapter-1") == 0
    assert num_hit("f", lora_id="adapter-2") == 0
    assert num_hit("g", lora_id="adapter-1") == 8


def test_preempted_request_hits_its_own_blocks_including_outputs():
    manager = make_manager(8, block_size=4)
    a = make_request(manager, "a", [1, 2, 3, 4, 5, 6])
    admit(manager, a)
    for t in (7, 8, 9):
        decode(manager, a, t)
    manager.free(a)
    a.num_computed_tokens = 0
    a.append_output_token_ids(10)  # sampled before preemption, not yet computed
    assert admit(manager, a) == 8


def test_misuse_raises_specific_errors():
    manager = make_manager(8, block_size=4)
    a = make_request(manager, "a", [1, 2, 3])
    with pytest.raises(UnknownRequestError):
        manager.fork(a, a.fork("b"))
    admit(manager, a)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(a, 0)
    hit, n = manager.get_computed_blocks(a)
    with pytest.raises(KVCacheError, match="first allocation"):
        manager.allocate_slots(a, 1, hit, n)
    with pytest.raises(KVCacheError, match="already holds blocks"):
        manager.fork(a, a)
    with pytest.raises(KVCacheError, match="block_size"):
        manager.get_computed_blocks(Request("x", [1, 2], block_size=8))


def test_reset_prefix_cache_and_stats_counters():
    manager = make_manager(8, block_size=4)
    a = make_request(manager, "a", list(range(9)))
    admit(manager, a)
    assert manager.reset_prefix_cache() is False
    b = make_request(manager, "b", list(range(9)))
    admit(manager, b)
    stats = manager.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 18)
    assert stats.num_blocks_per_request == {"a": 3, "b": 3}
    assert manager.make_stats().prefix_cache_queries == 0  # reset by the previous call
    manager.free(a)
    manager.free(b)
    assert manager.reset_prefix_cache() is True
    assert admit(manager, make_request(manager, "c", list(range(9)))) == 0
    assert manager.usage == pytest.approx(3 / 8)


def test_caching_disabled_never_hits():
    manager = make_manager(8, block_size=4, caching=False)
    admit(manager, make_request(manager, "a", list(range(9))))
    assert admit(manager, make_request(manager, "b", list(range(9)))) == 0
    assert manager.stats.num_cached_blocks == 0


def make_sliding_manager(num_blocks: int, window: int, hybrid: bool) -> KVCacheManager:
    groups = [KVCacheGroupSpec(("layer.1",), SlidingWindowSpec(2, sliding_window=window))]
    if hybrid:
        groups.insert(0, KVCacheGroupSpec(("layer.0",), FullAttentionSpec(2)))
    return KVCacheManager(groups, num_blocks)


def run_long_decode(manager: KVCacheManager) -> Request:
    """Prompt [1..4] then outputs 5..10: 10 tokens in blocks of 2."""
    a = make_request(manager, "a", [1, 2, 3, 4])
    admit(manager, a)
    for t in range(5, 11):
        decode(manager, a, t)
    return a


def test_sliding_window_frees_blocks_that_leave_the_window():
    manager = make_sliding_manager(1 + 6, window=4, hybrid=False)
    assert manager.num_usable_blocks == 6
    a = run_long_decode(manager)
    # The last allocation was for position 9: it reads keys 6..9, so blocks 0-2 are dropped.
    sw_table = table(manager, a)
    assert sw_table[:3] == [NULL_BLOCK_ID] * 3 and NULL_BLOCK_ID not in sw_table[3:]
    assert manager.num_free_blocks == 4
    assert manager.make_stats().num_blocks_per_request == {"a": 2}
    manager.free(a)
    assert manager.num_free_blocks == 6


def test_sliding_window_hit_needs_only_the_last_window_blocks():
    manager = make_sliding_manager(1 + 6, window=4, hybrid=False)
    a = run_long_decode(manager)
    a_table = table(manager, a)
    c = make_request(manager, "c", list(range(100, 108)))  # 4 blocks: evicts a's blocks 0-2
    assert admit(manager, c) == 0
    manager.free(c)
    b = make_request(manager, "b", list(range(1, 12)))
    hit_blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 10  # blocks 3, 4 cached; 0-2 fall out of the window of position 10
    assert hit_blocks.get_block_ids()[0] == [NULL_BLOCK_ID] * 3 + a_table[3:]
    assert manager.allocate_slots(b, 1, hit_blocks, num_hit) is not None
    assert table(manager, b)[:5] == [NULL_BLOCK_ID] * 3 + a_table[3:]


def test_hybrid_groups_share_one_pool_and_hit_is_the_min_over_groups():
    manager = make_sliding_manager(1 + 12, window=4, hybrid=True)
    a = run_long_decode(manager)
    full_table, sw_table = manager.get_block_ids("a")
    assert len(full_table) == 5 and NULL_BLOCK_ID not in full_table
    assert sw_table[:3] == [NULL_BLOCK_ID] * 3
    assert not set(full_table) & set(sw_table[3:])  # one pool, distinct blocks
    assert manager.num_free_blocks == 12 - 5 - 2
    # Evict the sliding-window group's dropped blocks (freed first, so first in LRU order).
    # 2 never-used blocks, then the sliding-window group's blocks 0, 1 (freed first) go.
    c = make_request(manager, "c", list(range(100, 104)))  # 2 blocks per group
    assert admit(manager, c) == 0 and manager.make_stats().num_evictions == 2
    manager.free(c)
    b = make_request(manager, "b", [1, 2, 3, 4, 5, 6, 7])
    full_hits = manager.managers[0].find_longest_cache_hit(b.block_hashes, 6)
    assert len(full_hits) == 3  # full attention alone would hit 6 tokens
    hit_blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 0 and hit_blocks.get_block_ids() == ([], [])
    # A prefix whose window blocks survive hits in both groups.
    d = make_request(manager, "d", list(range(1, 12)))
    hit_blocks, num_hit = manager.get_computed_blocks(d)
    assert num_hit == 10
    assert hit_blocks.get_block_ids() == (full_table, [NULL_BLOCK_ID] * 3 + sw_table[3:])
    manager.free(a)
    assert manager.allocate_slots(d, 1, hit_blocks, num_hit) is not None
    assert manager.get_block_ids("d")[0][:5] == full_table


def test_hybrid_groups_need_one_block_size():
    groups = [
        KVCacheGroupSpec(("a",), FullAttentionSpec(16)),
        KVCacheGroupSpec(("b",), SlidingWindowSpec(32, sliding_window=64)),
    ]
    with pytest.raises(KVCacheSpecError, match="one block size"):
        KVCacheManager(groups, 8)
    with pytest.raises(KVCacheSpecError, match="sliding_window"):
        SlidingWindowSpec(16, sliding_window=0)


def test_prefix_query_counts_once_per_admission_not_per_waiting_step():
    manager = make_manager(num_blocks=4, block_size=4)
    first = make_request(manager, "a", list(range(12)))
    assert admit(manager, first) is not None  # 3 blocks held, 1 free
    manager.make_stats()  # reset the counters
    waiting = make_request(manager, "b", list(range(8)) + [99, 98, 97, 96, 95])
    for _ in range(3):  # it waits: 8 tokens hit, but 2 more blocks do not fit
        blocks, num_hit = manager.get_computed_blocks(waiting)
        assert num_hit == 8
        assert manager.allocate_slots(waiting, 13 - num_hit, blocks, num_hit) is None
    stats = manager.make_stats(reset=False)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    manager.free(first)
    blocks, num_hit = manager.get_computed_blocks(waiting)
    assert manager.allocate_slots(waiting, 13 - num_hit, blocks, num_hit) is not None
    stats = manager.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13, 8)
