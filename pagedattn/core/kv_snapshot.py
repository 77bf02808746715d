"""kv_snapshot(): the block pool's state as plain JSON (for /debug/kv, the dashboard, the viz).

Snapshot keys:
- ``num_blocks``, ``block_size``, ``num_groups``;
- per block (lists of length num_blocks): ``ref_cnt``, ``cached`` (has a prefix-cache hash),
  ``owners`` (request ids whose block tables hold it), ``state``: one of
  ``free`` (ref_cnt 0, no hash), ``cached`` (ref_cnt 0, hash kept: a prefix hit can revive it),
  ``owned`` (ref_cnt 1), ``shared`` (ref_cnt >= 2) or ``null`` (the reserved null block);
- ``block_tables``: request id -> one list of block ids per KV cache group;
- ``requests``: request id -> num_tokens, num_computed_tokens, status (when requests are given);
- ``stats``: num_free_blocks, num_cached_free_blocks, num_used_blocks, num_shared_blocks,
  num_requests, usage (used / usable blocks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedattn.core.kv_cache_manager import KVCacheManager
    from pagedattn.core.request import Request


def _block_state(ref_cnt: int, cached: bool, is_null: bool) -> str:
    if is_null:
        return "null"
    if ref_cnt >= 2:
        return "shared"
    if ref_cnt == 1:
        return "owned"
    return "cached" if cached else "free"


def build_snapshot(
    block_size: int,
    ref_cnt: Sequence[int],
    cached: Sequence[bool],
    block_tables: Mapping[str, Sequence[Sequence[int]]],
    *,
    null_block_ids: Sequence[int] = (),
    requests: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict:
    """Assemble a snapshot from raw per-block arrays and block tables (see the module doc)."""
    num_blocks = len(ref_cnt)
    nulls = set(null_block_ids)
    owners: list[list[str]] = [[] for _ in range(num_blocks)]
    for req_id, groups in block_tables.items():
        for block_id in sorted({b for group in groups for b in group} - nulls):
            owners[block_id].append(req_id)
    state = [_block_state(ref_cnt[i], cached[i], i in nulls) for i in range(num_blocks)]
    num_used = sum(s in ("owned", "shared") for s in state)
    num_usable = num_blocks - len(nulls)
    num_groups = len(next(iter(block_tables.values()))) if block_tables else 1
    return {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "num_groups": num_groups,
        "ref_cnt": list(ref_cnt),
        "cached": [bool(c) for c in cached],
        "owners": owners,
        "state": state,
        "block_tables": {r: [list(g) for g in groups] for r, groups in block_tables.items()},
        "requests": dict(requests or {}),
        "stats": {
            "num_free_blocks": state.count("free") + state.count("cached"),
            "num_cached_free_blocks": state.count("cached"),
            "num_used_blocks": num_used,
            "num_shared_blocks": state.count("shared"),
            "num_requests": len(block_tables),
            "usage": num_used / max(num_usable, 1),
        },
    }


def kv_snapshot(
    kv_cache_manager: KVCacheManager, requests: dict[str, Request] | None = None
) -> dict:
    """The manager's pool state, with the block tables of every request holding blocks.

    ``requests`` (e.g. the scheduler's, waiting ones included) adds their progress to the
    ``requests`` key; by default the requests the manager holds are described.
    """
    pool = kv_cache_manager.block_pool
    held = kv_cache_manager.requests
    tables = {req_id: kv_cache_manager.get_block_ids(req_id) for req_id in held}
    described = held if requests is None else requests
    info = {
        req_id: {
            "num_tokens": req.num_tokens,
            "num_computed_tokens": req.num_computed_tokens,
            "status": req.status.name,
        }
        for req_id, req in described.items()
    }
    return build_snapshot(
        kv_cache_manager.block_size,
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash is not None for b in pool.blocks],
        tables,
        null_block_ids=[pool.null_block.block_id] if pool.null_block is not None else [],
        requests=info,
    )
