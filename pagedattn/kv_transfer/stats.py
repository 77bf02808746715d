"""Counters of a KV connector: store hits and misses, bytes, time, skipped and failed saves."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class KVConnectorStats:
    """Totals since the connector started (KVConnector.stats hands out a copy)."""

    # Prompt tokens past the local hit that came from the store (counted once loaded), and those
    # that did not: absent at lookup, or promised by the lookup but not loaded.
    num_hit_tokens: int = 0
    num_miss_tokens: int = 0
    # Worker side, loads: blocks copied in, blocks the lookup promised that did not load, loads
    # that stopped early, entries that failed verification (deleted), reads past the deadline.
    num_loaded_blocks: int = 0
    num_failed_load_blocks: int = 0
    num_load_failures: int = 0
    num_corrupt_entries: int = 0
    num_load_timeouts: int = 0
    bytes_read: int = 0
    load_time_s: float = 0.0
    # Worker side, saves: written, skipped because the queue was full, failed in the store.
    num_saved_blocks: int = 0
    num_skipped_saves: int = 0
    num_failed_saves: int = 0
    bytes_written: int = 0
    # Time on the step (copying blocks out) and in the background writer (encode + put).
    save_copy_time_s: float = 0.0
    write_time_s: float = 0.0
    # Store calls that raised StoreUnavailableError (unreachable, timed out, breaker open).
    num_store_errors: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of the looked-up tokens the store could supply (0.0 before any lookup)."""
        total = self.num_hit_tokens + self.num_miss_tokens
        return self.num_hit_tokens / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        """Field name -> value, for metrics exporters and logs."""
        return dataclasses.asdict(self)
