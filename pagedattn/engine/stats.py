"""Engine counters: time per part of the step, and the KV cache and request totals."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepTimes:
    """Seconds spent in each part of the engine's steps so far."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    process: float = 0.0
    num_steps: int = 0


@dataclass
class EngineStats:
    """Engine-level counters: KV usage, prefix-cache hit rate, preemptions, fragmentation."""

    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_recomputed_tokens: int
    internal_fragmentation: int
    num_running: int
    num_waiting: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_failed_requests: int = 0
    step_times: StepTimes = field(default_factory=StepTimes)
    # The second KV tier's counters (kv_transfer.KVConnectorStats), when a store is set.
    kv_store: object | None = None
    # Speculative decoding's counters (spec_decode.SpecDecodeStats), when it is on.
    spec_decode: object | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )
