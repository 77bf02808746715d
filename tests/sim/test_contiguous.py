"""FirstFitArena: first-fit placement, coalescing, double free; external fragmentation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedattn.sim.contiguous import ContiguousPolicy, FirstFitArena, SimAllocationError
from pagedattn.sim.traces import TraceRequest


def test_first_fit_takes_the_lowest_hole_and_coalesces() -> None:
    arena = FirstFitArena(10)
    a, b, c = arena.allocate(3), arena.allocate(3), arena.allocate(3)
    assert (a, b, c) == (0, 3, 6)
    arena.free(a, 3)
    arena.free(c, 3)  # merges with the tail [9, 10)
    assert arena.holes == [(0, 3), (6, 4)]
    assert arena.allocate(4) == 6  # [0, 3) is too small: first fit skips it
    assert arena.allocate(2) == 0
    arena.free(b, 3)
    assert arena.holes == [(2, 4)]  # [2, 3) + [3, 6)
    with pytest.raises(SimAllocationError, match="double free"):
        arena.free(3, 1)


def test_holes_too_small_for_the_waiting_head_are_stranded() -> None:
    policy = ContiguousPolicy("exact", 12, max_seq_len=12)
    reqs = [TraceRequest(f"r{i}", 3, 2, 0.0, 2) for i in range(3)]  # 4 slots each
    assert all(policy.allocate(r, 3) for r in reqs)
    policy.free("r1")  # hole [4, 8)
    big = TraceRequest("big", 5, 2, 0.0, 2)  # needs 6 contiguous slots; 4 are free
    assert not policy.allocate(big, 5)
    assert policy.stranded_free_slots(big) == 4
    assert policy.stranded_free_slots(reqs[1]) == 0  # a 4-slot request fits the hole


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=60))
def test_arena_never_overlaps_and_accounts_every_slot(ops: list[tuple[bool, int]]) -> None:
    arena = FirstFitArena(40)
    live: list[tuple[int, int]] = []
    for do_alloc, size in ops:
        if do_alloc or not live:
            start = arena.allocate(size)
            if start is not None:
                live.append((start, size))
        else:
            arena.free(*live.pop(size % len(live)))
        used = sorted(live)
        for (s0, n0), (s1, _) in zip(used, used[1:], strict=False):
            assert s0 + n0 <= s1
        assert arena.num_free + sum(n for _, n in live) == 40
        holes = arena.holes
        for (s0, n0), (s1, _) in zip(holes, holes[1:], strict=False):
            assert s0 + n0 < s1  # never adjacent: freed neighbours merge
