"""Issue 52: /metrics counts every KV store outcome an operator acts on, corrupt entries too."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagedattn.engine.stats import EngineStats, StepTimes
from pagedattn.kv_transfer.stats import KVConnectorStats
from pagedattn.metrics import ServerMetrics


def _stats(store: KVConnectorStats) -> EngineStats:
    return EngineStats(
        num_blocks=64, block_size=16, num_free_blocks=60, num_cached_blocks=0,
        kv_cache_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
        num_recomputed_tokens=0, internal_fragmentation=0, num_running=0, num_waiting=0,
        num_prompt_tokens=0, num_generation_tokens=0, step_times=StepTimes(), kv_store=store,
    )  # fmt: skip


def _value(metrics: ServerMetrics, name: str) -> float:
    text = generate_latest(metrics.registry).decode()
    line = next(x for x in text.splitlines() if x.startswith(f"pagedattn_{name}_total{{"))
    return float(line.rsplit(" ", 1)[1])


def test_corrupt_store_entries_are_counted():
    metrics = ServerMetrics("m")
    metrics.record_engine_stats(_stats(KVConnectorStats(num_corrupt_entries=2)))
    metrics.record_engine_stats(
        _stats(KVConnectorStats(num_corrupt_entries=3, num_loaded_blocks=4))
    )
    assert _value(metrics, "kv_store_corrupt_entries") == 3
    assert _value(metrics, "kv_store_loaded_blocks") == 4


def test_every_kv_store_counter_names_a_field():
    from pagedattn.metrics import KV_STORE_COUNTERS

    fields = set(KVConnectorStats().as_dict())
    assert {field for _, field, _ in KV_STORE_COUNTERS} <= fields
