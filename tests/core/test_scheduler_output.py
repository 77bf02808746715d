"""The step's contract values: a store load that fell short widens a new SchedulerOutput (the
one the scheduler made is never edited), a retry keeps its loads, and timings add up."""

from __future__ import annotations

from pagedattn.core.scheduler_output import (
    KVLoad,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    StepTimings,
)

PROMPT = list(range(100, 120))  # 20 tokens, blocks of 4


def _step() -> SchedulerOutput:
    # "a" hit 2 blocks locally and expects 3 more from the store: it computes [20 - 2, 20) ...
    a = ScheduledRequest("a", PROMPT[18:], 18, ([0, 1, 2, 3, 4],), True, None, None, PROMPT, [])
    b = ScheduledRequest("b", [7], 5, ([5, 6],), True, None, None, [1, 2, 3, 4, 5], [7])
    return SchedulerOutput(
        [a, b],
        {"a": 2, "b": 1},
        3,
        kv_loads=[KVLoad("a", 2, [2, 3, 4], [b"h2", b"h3", b"h4"])],
    )


def test_a_short_load_widens_a_new_output_and_counts_the_recomputed_prompt():
    sched = _step()
    assert sched.num_prompt_tokens_computed() == 2
    # ... but only the first of the 3 blocks loaded: it computes from position 12.
    widened = sched.with_kv_load_shortfalls({"a": 12})
    a, b = widened.scheduled
    assert (a.start_pos, list(a.token_ids)) == (12, PROMPT[12:])
    assert b == sched.scheduled[1]
    assert widened.num_scheduled_tokens == {"a": 8, "b": 1}
    assert widened.total_num_scheduled_tokens == 9 and widened.kv_loads == []
    assert widened.num_prompt_tokens_computed() == 8
    # The scheduler's own output is left as it was.
    assert sched.scheduled[0].start_pos == 18 and sched.num_scheduled_tokens["a"] == 2
    assert sched.total_num_scheduled_tokens == 3 and len(sched.kv_loads) == 1


def test_a_retried_sequence_keeps_its_store_load():
    sched = _step()
    assert [load.req_id for load in sched.subset({"a"}).kv_loads] == ["a"]
    assert sched.subset({"b"}).kv_loads == []


def test_merged_outputs_add_their_timings():
    out = RunnerOutput(timings=StepTimings(1.0, 2.0, 3.0))
    out.merge(RunnerOutput(timings=StepTimings(0.5, 0.25, 0.125)))
    assert (out.timings.prepare, out.timings.forward, out.timings.sample) == (1.5, 2.25, 3.125)
    assert out.timings.total == 6.875
