"""Speculation counters: get_stats(), /metrics under vLLM's names, the CLI summary."""

from __future__ import annotations

from pagedattn.cli import kv_summary_lines
from pagedattn.engine.stats import EngineStats
from pagedattn.metrics import ServerMetrics
from pagedattn.spec_decode.speculator import SpecDecodeStats


def _stats(spec: SpecDecodeStats) -> EngineStats:
    return EngineStats(
        num_blocks=8, block_size=4, num_free_blocks=8, num_cached_blocks=0, kv_cache_usage=0.0,
        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, num_recomputed_tokens=0,
        internal_fragmentation=0, num_running=0, num_waiting=0, num_prompt_tokens=3,
        num_generation_tokens=9, spec_decode=spec,
    )  # fmt: skip


def test_counters_reach_prometheus_under_vllm_names_and_only_go_up():
    spec = SpecDecodeStats(4, 16, 10, [4, 3, 2, 1])
    assert spec.acceptance_rate == 10 / 16 and spec.mean_accepted_length == 1 + 10 / 4
    metrics = ServerMetrics("m")
    metrics.record_engine_stats(_stats(spec))
    spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens = 6, 24, 11
    spec.num_accepted_tokens_per_pos[0] = 6
    metrics.record_engine_stats(_stats(spec))
    text = metrics.render()[0].decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 6.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 24.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 11.0' in text
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 6.0'
        in text
    )


def test_cli_summary_names_the_acceptance():
    lines = kv_summary_lines(_stats(SpecDecodeStats(4, 16, 10, [4, 3, 2, 1], 2)))
    assert any("10/16 draft tokens accepted (62.5%)" in line and "3.50" in line for line in lines)
    plain = _stats(SpecDecodeStats())
    plain.spec_decode = None
    assert not any("[spec]" in line for line in kv_summary_lines(plain))
