"""Sharing through the real manager's fork + copy-on-write: hand count and sanity bounds."""

from __future__ import annotations

import pytest

from pagedattn.sim.sharing import (
    simulate_beam_search,
    simulate_parallel_sampling,
    simulate_system_prompt,
)
from pagedattn.sim.stepper import SimSchedulerConfig
from pagedattn.sim.traces import TraceRequest, generate_trace


def test_parallel_sampling_hand_count() -> None:
    # One request, prompt 8 = two full blocks of B=4, n=2 samples of 2 tokens each.
    # prefill step: both forks hold blocks [0,1] and their first sampled token: used 2, private 4.
    # decode: each writes its first token (position 8) into a new block (no shared partial block
    # to copy) and samples its second and last token: used 2+2=4, private 3+3=6.
    # saving = 1 - (2+4) / (4+6) = 4/10.
    trace = [TraceRequest("r", 8, 2, 0.0, 2)]
    r = simulate_parallel_sampling(trace, 2, block_size=4)
    assert (r.used_block_steps, r.private_block_steps) == (6, 10)
    assert r.saving == pytest.approx(4 / 10)
    assert r.num_block_copies == 0


def test_parallel_sampling_copies_a_shared_partial_block() -> None:
    # Prompt 6 = one full block + a half block shared by both samples; the first sample to write
    # token 6 into the half block copies it (one CoW), the second then owns the original.
    trace = [TraceRequest("r", 6, 2, 0.0, 2)]
    r = simulate_parallel_sampling(trace, 2, block_size=4)
    assert r.num_block_copies == 1
    # prefill: used 2, private 4; decode: used 1 shared + 2 tails = 3, private 4.
    assert (r.used_block_steps, r.private_block_steps) == (5, 8)


def test_beam_search_shares_more_than_parallel_sampling() -> None:
    trace = generate_trace("alpaca", 12, seed=4)
    parallel = simulate_parallel_sampling(trace, 4, block_size=16)
    beam = simulate_beam_search(trace, 4, block_size=16)
    assert 0 < parallel.saving < beam.saving < 1
    assert beam.num_block_copies > 0
    wider = simulate_beam_search(trace, 6, block_size=16)
    assert wider.saving > beam.saving


def test_system_prompt_hits_the_prefix_cache() -> None:
    trace = generate_trace("alpaca", 30, arrival_rate=0.5, seed=5)
    r = simulate_system_prompt(
        trace, 64, block_size=16, capacity_slots=4096, config=SimSchedulerConfig(), max_seq_len=2048
    )
    # Every request after the first finds the 4 system-prompt blocks cached.
    assert r.prefix_hit_rate > 0.5
    assert r.saving > 0.3
