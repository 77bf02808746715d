"""Prometheus collectors of a serving engine: KV cache, prefix cache, scheduler, latencies.

Each `ServerMetrics` owns a private `CollectorRegistry`, so several servers (and tests) can live in
one process. The engine loop thread calls `record_engine_stats` after each step and the
`observe_*` methods as outputs arrive; prometheus-client collectors are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "pagedattn"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0)  # fmt: skip


# (metric name, KVConnectorStats field, help) of the KV store tier's counters.
KV_STORE_COUNTERS = (
    ("kv_store_hit_tokens", "num_hit_tokens", "Prompt tokens past the local hit the store held."),
    ("kv_store_miss_tokens", "num_miss_tokens", "Prompt tokens past the local hit it lacked."),
    ("kv_store_bytes_read", "bytes_read", "Bytes loaded from the KV store."),
    ("kv_store_bytes_written", "bytes_written", "Bytes written to the KV store."),
    ("kv_store_load_seconds", "load_time_s", "Time loading blocks from the KV store."),
    ("kv_store_save_seconds", "save_copy_time_s", "Step time copying blocks out for the store."),
    (
        "kv_store_skipped_saves",
        "num_skipped_saves",
        "Blocks not saved: the writer's queue was full.",
    ),
    ("kv_store_errors", "num_store_errors", "KV store calls that failed (recomputed instead)."),
    ("kv_store_loaded_blocks", "num_loaded_blocks", "Blocks loaded from the KV store."),
    ("kv_store_saved_blocks", "num_saved_blocks", "Blocks written to the KV store."),
    (
        "kv_store_corrupt_entries",
        "num_corrupt_entries",
        "KV store entries that failed verification on load (deleted; the blocks recomputed).",
    ),
    (
        "kv_store_failed_load_blocks",
        "num_failed_load_blocks",
        "Blocks the lookup promised that did not load (recomputed).",
    ),
    ("kv_store_load_timeouts", "num_load_timeouts", "KV store reads past their deadline."),
    ("kv_store_failed_saves", "num_failed_saves", "Blocks the KV store failed to write."),
)


# (metric name, SpecDecodeStats field, help): vLLM's speculative decoding counters.
SPEC_DECODE_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "num_drafts", "Sequence-steps that verified draft tokens."),
    ("vllm:spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens proposed."),
    ("vllm:spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
)


class ServerMetrics:
    """The Prometheus metrics of one served model, in a registry of their own."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            g = Gauge(f"{PREFIX}_{name}", doc, labels, registry=self.registry)
            return g.labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            c = Counter(f"{PREFIX}_{name}", doc, labels, registry=self.registry)
            return c.labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use.")
        self.num_free_blocks = gauge("kv_cache_free_blocks", "KV cache blocks with ref_cnt 0.")
        self.num_cached_blocks = gauge(
            "kv_cache_cached_blocks", "Blocks findable in the prefix cache (in use or evictable)."
        )
        self.num_total_blocks = gauge("kv_cache_total_blocks", "KV cache blocks in the pool.")
        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Requests preempted (blocks freed).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = Counter(
            f"{PREFIX}_request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.failed_requests = counter(
            "failed_requests", "Requests that failed inside a step (the engine went on)."
        )
        # The second KV tier (--kv-store); they stay at 0 without a store.
        self.kv_store_counters = {
            field: counter(name, doc) for name, field, doc in KV_STORE_COUNTERS
        }
        # Speculative decoding, under vLLM's names; they stay at 0 without speculation.
        self.spec_decode_counters = {
            field: Counter(name, doc, labels, registry=self.registry).labels(model_name)
            for name, field, doc in SPEC_DECODE_COUNTERS
        }
        self.spec_decode_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens at each draft position.",
            ["model_name", "position"],
            registry=self.registry,
        )
        self._last_totals: dict[str, float] = {}

    def record_engine_stats(self, stats) -> None:
        """Copy an `EngineStats` snapshot into the gauges and advance the cumulative counters."""
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.num_free_blocks.set(stats.num_free_blocks)
        self.num_cached_blocks.set(stats.num_cached_blocks)
        self.num_total_blocks.set(stats.num_blocks)
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self._advance(self.prefix_cache_queries, "queries", stats.prefix_cache_queries)
        self._advance(self.prefix_cache_hits, "hits", stats.prefix_cache_hits)
        self._advance(self.num_preemptions, "preemptions", stats.num_preemptions)
        self._advance(self.failed_requests, "failed", getattr(stats, "num_failed_requests", 0))
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            for field, counter in self.spec_decode_counters.items():
                self._advance(counter, f"spec_decode.{field}", getattr(spec, field))
            for pos, total in enumerate(spec.num_accepted_tokens_per_pos):
                counter = self.spec_decode_per_pos.labels(self.model_name, str(pos))
                self._advance(counter, f"spec_decode.pos{pos}", total)
        store = getattr(stats, "kv_store", None)
        if store is not None:
            for field, counter in self.kv_store_counters.items():
                self._advance(counter, f"kv_store.{field}", getattr(store, field))

    def _advance(self, counter: Counter, key: str, total: float) -> None:
        """Turn an engine-lifetime total into counter increments (counters only go up)."""
        delta = total - self._last_totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_totals[key] = total

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        """A request produced its first token."""
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_tokens(self, num_new_tokens: int, itl_s: float | None) -> None:
        """A request produced tokens in a step; `itl_s` is None for its first step."""
        self.generation_tokens.inc(num_new_tokens)
        if itl_s is not None:
            self.itl.observe(itl_s)

    def observe_finished(self, e2e_s: float, finish_reason: str) -> None:
        """A request finished (stop, length or abort)."""
        self.e2e.observe(e2e_s)
        self._request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The registry in Prometheus text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
