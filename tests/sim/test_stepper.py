"""Hand-checked accounting of the baseline policies on two tiny requests."""

from __future__ import annotations

import pytest

from pagedattn.sim.contiguous import ContiguousPolicy, PagePolicy, SimAllocationError
from pagedattn.sim.stepper import SimSchedulerConfig, run_policy
from pagedattn.sim.traces import TraceRequest

CONFIG = SimSchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
# A: prompt 2, output 2 -> final KV length 3; B: prompt 1, output 3 -> final KV length 3.
TRACE = [TraceRequest("A", 2, 2, 0.0, 2), TraceRequest("B", 1, 3, 0.0, 3)]


def test_reserve_max_seq_len_strands_the_tail_hole() -> None:
    # 8 slots, max_seq_len 6: A takes [0, 6); B needs 6, the hole [6, 8) is too small.
    # step 0: A held 2 of 6 (final 3): T=2 R=1 I=3, E=2 (B waits)
    # step 1: A held 3: T=3 R=0 I=3, E=2; A finishes
    # step 2: B takes [0, 6), held 1 (final 3): T=1 R=2 I=3
    # step 3: T=2 R=1 I=3;  step 4: T=3 R=0 I=3; B finishes.
    # sums: T=11, A=30, R=4, I=15, E=4, capacity 5*8=40.
    r = run_policy(TRACE, ContiguousPolicy("max", 8, max_seq_len=6), CONFIG)
    assert r.num_steps == 5 and r.num_output_tokens == 5
    assert r.utilization == pytest.approx(11 / 30)
    assert r.reservation_frac == pytest.approx(4 / 30)
    assert r.internal_frac == pytest.approx(15 / 30)
    assert r.external_frac == pytest.approx(4 / 40)
    assert r.occupancy == pytest.approx(30 / 40)
    assert (r.max_concurrent, r.mean_concurrent) == (1, 1.0)  # steps 0-1 had B waiting
    assert r.num_preemptions == 0 and r.tokens_per_step == pytest.approx(1.0)


def test_reserve_prompt_plus_max_tokens() -> None:
    # A reserves 2+2=4, B 1+3=4: both fit in 8 slots at step 0.
    # step 0: held 2,1: T=3 A=8 R=1+2 I=1+1;  step 1: held 3,2: T=5 R=0+1 I=2 (A ends)
    # step 2: held 3: T=3 A=4 R=0 I=1.  sums: T=11 A=20 R=4 I=5.
    r = run_policy(TRACE, ContiguousPolicy("max_tokens", 8, max_seq_len=6), CONFIG)
    assert r.num_steps == 3
    assert r.utilization == pytest.approx(11 / 20)
    assert r.reservation_frac == pytest.approx(4 / 20)
    assert r.internal_frac == pytest.approx(5 / 20)
    assert r.external_frac == 0.0
    assert r.max_concurrent == 2 and r.mean_concurrent == pytest.approx(5 / 3)
    assert r.tokens_per_step == pytest.approx(5 / 3)


def test_exact_reservation_has_no_internal_fragmentation() -> None:
    # Each reserves its final length 3: A = 6, 6, 3 per step; T = 3, 5, 3; R = 3, 1, 0.
    r = run_policy(TRACE, ContiguousPolicy("exact", 8, max_seq_len=6), CONFIG)
    assert r.utilization == pytest.approx(11 / 15)
    assert r.reservation_frac == pytest.approx(4 / 15)
    assert r.internal_frac == 0.0


def test_pages_of_two_tokens() -> None:
    # step 0: pages 1,1 (slots 2,2): T=3 A=4 R=(2-2)+(2-1)=1 I=0
    # step 1: A holds 3 -> 2 pages, B 2 -> 1 page: T=5 A=6 R=0 I=(4-3)=1
    # step 2: B holds 3 -> 2 pages: T=3 A=4 R=0 I=1.  sums: T=11 A=14 R=1 I=2.
    r = run_policy(TRACE, PagePolicy("paged", 8, page_tokens=2), CONFIG)
    assert r.num_steps == 3
    assert r.utilization == pytest.approx(11 / 14)
    assert r.reservation_frac == pytest.approx(1 / 14)
    assert r.internal_frac == pytest.approx(2 / 14)


def test_growth_preempts_the_newest_request() -> None:
    # 5 one-token pages; A and B: prompt 2, output 3. step 0: 2+2 used. step 1: A grows to 3
    # (5 used); B cannot grow and preempts itself. step 2: A grows to 4 (B's 2 freed); B needs 3
    # (2 prompt + 1 output) but 1 is free. A ends. steps 3-4: B recomputes 3, then 4, and ends.
    trace = [TraceRequest("A", 2, 3, 0.0, 3), TraceRequest("B", 2, 3, 0.0, 3)]
    r = run_policy(trace, PagePolicy("paged", 5, page_tokens=1), CONFIG)
    assert (r.num_preemptions, r.num_steps, r.num_output_tokens) == (1, 5, 6)


def test_request_larger_than_memory_is_reported() -> None:
    with pytest.raises(SimAllocationError, match="can never fit"):
        run_policy(TRACE, ContiguousPolicy("max", 4, max_seq_len=6), CONFIG)
