"""PrefixIndex: per replica, the block hashes its prefix cache holds, kept from its KV events."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence

from pagedattn.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

# How long a routing decision counts as "this replica will hold these blocks" before its own
# BlockStored events confirm it. NOTE: the events come when the request is admitted, so this must
# outlast the longest queueing delay: with 30 s, an overloaded replica's queued request lost its
# claim before admission and the prefix's next request was sent to the other replica too
# (computed twice, cached twice). A claim that is never confirmed (the request failed) only keeps
# the prefix's next request on the same replica, which then computes it.
DEFAULT_ROUTED_TTL_S = 300.0


def hashes_digest(hashes: Iterable[bytes]) -> str:
    """A short digest of a set of block hashes (equal sets, equal digests), for cross-checks."""
    h = hashlib.sha256()
    for block_hash in sorted(hashes):
        h.update(block_hash)
    return h.hexdigest()[:16]


class PrefixIndex:
    """Cached block hashes per replica (full-attention group 0), from that replica's events.

    Beside the confirmed hashes, `note_routed` records what a replica was just sent: the router
    counts those as cached for `routed_ttl_s` (or until an event confirms or evicts them), so a
    burst of requests with one new prefix goes to one replica instead of being spread.
    """

    def __init__(self, routed_ttl_s: float = DEFAULT_ROUTED_TTL_S) -> None:
        self.routed_ttl_s = routed_ttl_s
        self._cached: dict[str, set[bytes]] = {}
        self._routed: dict[str, dict[bytes, float]] = {}

    @property
    def replica_ids(self) -> list[str]:
        """Replicas the index knows."""
        return list(self._cached)

    def add_replica(self, replica_id: str) -> None:
        """Start an empty entry (a new replica, or a restarted one: its cache starts empty)."""
        self._cached[replica_id] = set()
        self._routed[replica_id] = {}

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica that left or died."""
        self._cached.pop(replica_id, None)
        self._routed.pop(replica_id, None)

    def apply(self, replica_id: str, batch: EventBatch) -> None:
        """Apply one event batch of a replica, in order."""
        if replica_id not in self._cached:
            self.add_replica(replica_id)
        cached = self._cached[replica_id]
        routed = self._routed[replica_id]
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.group_idx:
                    continue
                cached.update(event.block_hashes)
                for h in event.block_hashes:
                    routed.pop(h, None)
            elif isinstance(event, BlockRemoved):
                if event.group_idx:
                    continue
                cached.difference_update(event.block_hashes)
                for h in event.block_hashes:
                    routed.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                cached.clear()
                routed.clear()

    def cached_hashes(self, replica_id: str) -> set[bytes]:
        """The confirmed cached hashes of a replica (a copy)."""
        return set(self._cached.get(replica_id, ()))

    def num_shared_blocks(self) -> int:
        """Confirmed hashes cached by more than one replica (the same prefix computed twice)."""
        seen: set[bytes] = set()
        shared: set[bytes] = set()
        for cached in self._cached.values():
            shared |= seen & cached
            seen |= cached
        return len(shared)

    def num_blocks(self, replica_id: str) -> int:
        """Blocks the replica holds or was just sent (a tie-breaker: spread new prefixes)."""
        return len(self._cached.get(replica_id, ())) + len(self._routed.get(replica_id, ()))

    def note_routed(
        self, replica_id: str, block_hashes: Iterable[bytes], now: float | None = None
    ) -> None:
        """Count block_hashes as held by replica_id until the TTL passes or events say so."""
        routed = self._routed.get(replica_id)
        if routed is None:
            return
        expiry = (time.monotonic() if now is None else now) + self.routed_ttl_s
        for h in block_hashes:
            if h not in self._cached[replica_id]:
                routed[h] = expiry

    def match_length(
        self, replica_id: str, block_hashes: Sequence[bytes], now: float | None = None
    ) -> int:
        """Leading blocks of a request (chained hashes) that the replica holds or was just sent."""
        cached = self._cached.get(replica_id)
        if cached is None:
            return 0
        routed = self._routed[replica_id]
        now = time.monotonic() if now is None else now
        n = 0
        for h in block_hashes:
            if h in cached:
                n += 1
                continue
            expiry = routed.get(h)
            if expiry is None:
                break
            if expiry < now:
                del routed[h]
                break
            n += 1
        return n
