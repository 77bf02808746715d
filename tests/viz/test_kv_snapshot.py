"""kv_snapshot() of a real KVCacheManager: block states, owners, tables, stats, JSON."""

from __future__ import annotations

import json

from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedattn.core.kv_snapshot import build_snapshot, kv_snapshot
from pagedattn.core.request import Request


def _admit(manager: KVCacheManager, req: Request) -> None:
    hit, num_hit = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - num_hit, hit, num_hit) is not None
    req.num_computed_tokens = req.num_tokens


def test_states_follow_allocation_fork_and_free() -> None:
    manager = KVCacheManager([KVCacheGroupSpec(("l0",), FullAttentionSpec(4))], 8)
    parent = Request("p", list(range(10)), block_size=4)  # 2 full blocks + 2 tokens
    _admit(manager, parent)
    child = parent.fork("c")
    manager.fork(parent, child)
    waiting = Request("w", [1, 2, 3], block_size=4)
    snap = kv_snapshot(manager, {"p": parent, "c": child, "w": waiting})
    json.dumps(snap)  # plain JSON for /debug/kv
    assert snap["block_tables"] == {"p": [[0, 1, 2]], "c": [[0, 1, 2]]}
    assert snap["state"][:4] == ["shared", "shared", "shared", "free"]
    assert snap["owners"][2] == ["p", "c"] and snap["ref_cnt"][:3] == [2, 2, 2]
    assert snap["requests"]["w"] == {"num_tokens": 3, "num_computed_tokens": 0, "status": "WAITING"}
    assert snap["stats"] == {
        "num_free_blocks": 5,
        "num_cached_free_blocks": 0,
        "num_used_blocks": 3,
        "num_shared_blocks": 3,
        "num_requests": 2,
        "usage": 3 / 8,
    }
    manager.free(child)
    manager.free(parent)
    snap = kv_snapshot(manager)
    # Full blocks keep their hashes (prefix cache); the partial block is plain free.
    assert snap["state"][:3] == ["cached", "cached", "free"]
    assert snap["stats"]["num_cached_free_blocks"] == 2 and snap["block_tables"] == {}


def test_null_block_of_a_sliding_window_pool() -> None:
    groups = [
        KVCacheGroupSpec(("l0",), FullAttentionSpec(4)),
        KVCacheGroupSpec(("l1",), SlidingWindowSpec(4, sliding_window=4)),
    ]
    manager = KVCacheManager(groups, 16, enable_caching=False)
    req = Request("r", list(range(6)), block_size=4)
    _admit(manager, req)
    snap = kv_snapshot(manager)
    assert snap["num_groups"] == 2 and snap["state"][0] == "null"
    assert snap["stats"]["usage"] == snap["stats"]["num_used_blocks"] / 15


def test_build_snapshot_counts_owners_once_per_request() -> None:
    snap = build_snapshot(2, [1, 0, 1], [False, True, False], {"a": [[0, 2], [2]]})
    assert snap["owners"] == [["a"], [], ["a"]]
    assert snap["state"] == ["owned", "cached", "owned"]
