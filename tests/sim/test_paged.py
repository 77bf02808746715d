"""The paged replay runs the real Scheduler and KVCacheManager: exact numbers, drained pool."""

from __future__ import annotations

import pytest

from pagedattn.sim.contiguous import ContiguousPolicy, PagePolicy
from pagedattn.sim.paged import PagedRun, run_paged
from pagedattn.sim.stepper import SimSchedulerConfig, run_policy
from pagedattn.sim.traces import TraceRequest, generate_trace

CONFIG = SimSchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)


def assert_drained(run: PagedRun) -> None:
    """Every block back in the free queue with ref_cnt 0; no request left anywhere."""
    manager, scheduler = run.kv_cache_manager, run.scheduler
    pool = manager.block_pool
    assert not scheduler.has_unfinished_requests() and not scheduler.running
    assert not manager.requests
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
    assert len(pool.free_block_queue.get_all_free_blocks()) == manager.num_usable_blocks


def test_two_requests_match_the_hand_count() -> None:
    # Same trace as tests/sim/test_stepper.py, B=2, 4 blocks: the real scheduler allocates like
    # 2-token pages. step 0: blocks 1,1: T=3 A=4 R=1 I=0; step 1: 2,1: T=5 A=6 R=0 I=1;
    # step 2: B alone, 2 blocks: T=3 A=4 R=0 I=1.  sums: T=11 A=14 R=1 I=2.
    trace = [TraceRequest("A", 2, 2, 0.0, 2), TraceRequest("B", 1, 3, 0.0, 3)]
    run = run_paged(trace, block_size=2, capacity_slots=8, config=CONFIG, max_seq_len=6)
    r = run.result
    assert (r.num_steps, r.num_output_tokens, r.num_preemptions) == (3, 5, 0)
    assert r.utilization == pytest.approx(11 / 14)
    assert r.reservation_frac == pytest.approx(1 / 14)
    assert r.internal_frac == pytest.approx(2 / 14)
    assert r.external_frac == 0.0
    assert r == run_policy(trace, PagePolicy("paged-B2", 8, page_tokens=2), CONFIG)
    assert_drained(run)


def test_preemption_by_recompute_matches_the_model() -> None:
    # 5 blocks of 1 token: B cannot grow at step 1 and is preempted (see test_stepper.py).
    trace = [TraceRequest("A", 2, 3, 0.0, 3), TraceRequest("B", 2, 3, 0.0, 3)]
    run = run_paged(trace, block_size=1, capacity_slots=5, config=CONFIG, max_seq_len=8)
    r = run.result
    assert (r.num_preemptions, r.num_steps, r.num_output_tokens) == (1, 5, 6)
    assert_drained(run)


def test_sharegpt_target_utilisation_and_concurrency() -> None:
    # The targets: >= 96% utilisation at B=16 and >= 3x the concurrency of reserving
    # max_seq_len, for the same memory (12 GiB of OPT-13B KV = 15728 slots).
    trace = generate_trace("sharegpt", 120, max_seq_len=2048, seed=0)
    config = SimSchedulerConfig()
    run = run_paged(trace, block_size=16, capacity_slots=15728, config=config, max_seq_len=2048)
    baseline = run_policy(trace, ContiguousPolicy("max", 15728, 2048), config)
    assert run.result.utilization >= 0.96
    assert run.result.mean_concurrent >= 3 * baseline.mean_concurrent
    assert run.result.num_output_tokens == sum(r.output_len for r in trace)
    assert_drained(run)


def test_prefix_caching_run_drains_and_leaves_cached_blocks() -> None:
    trace = generate_trace("alpaca", 40, arrival_rate=2.0, seed=2)
    run = run_paged(
        trace, block_size=4, capacity_slots=400, config=CONFIG, max_seq_len=512, enable_caching=True
    )
    assert_drained(run)
    assert run.kv_cache_manager.block_pool.cached_block_hash_to_block  # evictable, still findable
