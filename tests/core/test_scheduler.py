"""Scheduler: admission limits, chunked prefill, prefix hits, preemption, rejection, abort, fork."""

from __future__ import annotations

import random

import pytest

from pagedattn.config import CacheConfig, SchedulerConfig
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedattn.core.request import Request, RequestStatus
from pagedattn.core.scheduler import RequestRejectedError, Scheduler
from pagedattn.core.scheduler_output import RunnerOutput, SchedulerOutput
from pagedattn.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_batched_tokens: int | None = 64,
    max_num_seqs: int = 8,
    chunked: bool = True,
    policy: str = "fcfs",
    caching: bool = True,
    max_model_len: int = 256,
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    groups = [KVCacheGroupSpec(("layers.0",), FullAttentionSpec(block_size=BLOCK_SIZE))]
    manager = KVCacheManager(groups, num_blocks, enable_caching=caching)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        policy=policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_prefix_caching=caching
    )
    return Scheduler(scheduler_config, cache_config, manager, max_model_len)


def make_request(
    req_id: str,
    prompt: list[int],
    *,
    priority: int = 0,
    arrival_time: float = 0.0,
    max_tokens: int | None = None,
) -> Request:
    return Request(
        req_id,
        prompt,
        priority=priority,
        arrival_time=arrival_time,
        max_tokens=max_tokens,
        block_size=BLOCK_SIZE,
    )


def fake_token(token_ids: list[int]) -> int:
    """A deterministic "model": the next token depends on the whole context."""
    return sum((i + 1) * t for i, t in enumerate(token_ids)) * 2654435761 % 997


class FakeEngine:
    """Drives a scheduler like the engine: schedule -> fake model -> update_from_output.

    It also plays the model runner: it checks that every scheduled sequence carries its tokens,
    positions and a block table that covers them, and that the tables are the manager's.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.outputs: dict[str, list[int]] = {}

    def add(self, request: Request, max_tokens: int) -> None:
        request.max_tokens = max_tokens
        self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self._check_runner_view(out)
        # NOTE: a token for partial prefill chunks too: the scheduler must drop those.
        req_ids = [s.req_id for s in out.scheduled]
        tokens = [
            fake_token(list(s.prompt_token_ids) + list(s.output_token_ids)) for s in out.scheduled
        ]
        for s in out.scheduled:
            for child_id, _ in s.forks:
                req_ids.append(child_id)
                tokens.append(fake_token(list(s.prompt_token_ids)) + 1)
        for core in self.scheduler.update_from_output(out, RunnerOutput(req_ids, tokens)):
            self.outputs.setdefault(core.req_id, []).extend(core.new_token_ids)
        return out

    def run(self, max_steps: int = 2000) -> list[SchedulerOutput]:
        outs = []
        while self.scheduler.has_unfinished_requests():
            assert len(outs) < max_steps, "the scheduler made no progress"
            outs.append(self.step())
        return outs

    def _check_runner_view(self, out: SchedulerOutput) -> None:
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= self.scheduler.step_budget.max_tokens
        assert len(out.num_scheduled_tokens) <= self.scheduler.scheduler_config.max_num_seqs
        assert [s.req_id for s in out.scheduled] == list(out.num_scheduled_tokens)
        for s in out.scheduled:
            request = self.scheduler.requests[s.req_id]
            end = s.start_pos + len(s.token_ids)
            assert end == request.num_computed_tokens  # schedule() advanced it
            assert list(s.token_ids) == request.all_token_ids[s.start_pos : end]
            assert s.needs_sample == (end == request.num_tokens)
            assert len(s.block_ids[0]) * BLOCK_SIZE >= end
            assert (
                list(s.block_ids[0]) == self.scheduler.kv_cache_manager.get_block_ids(s.req_id)[0]
            )


def test_admission_limited_by_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 4, max_tokens=4))
    out = scheduler.schedule()
    assert [s.req_id for s in out.scheduled] == ["r0", "r1"]
    assert [s.needs_sample for s in out.scheduled] == [True, True]
    assert (out.stats.num_running_reqs, out.stats.num_waiting_reqs) == (2, 3)


@pytest.mark.parametrize("chunked, expected", [(False, [4, 4]), (True, [4, 4, 2])])
def test_admission_limited_by_token_budget(chunked: bool, expected: list[int]):
    scheduler = make_scheduler(max_num_batched_tokens=10, chunked=chunked)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 4, max_tokens=4))
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens.values()) == expected
    assert out.total_num_scheduled_tokens == sum(expected)


def test_decode_runs_before_admission():
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=8))
    engine.add(make_request("a", [1, 2, 3, 4]), max_tokens=8)
    engine.step()
    engine.add(make_request("b", list(range(10, 30))), max_tokens=8)
    out = engine.step()
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    decode = out.scheduled[0]
    assert (decode.req_id, decode.start_pos) == ("a", 4)
    assert decode.token_ids == [engine.scheduler.requests["a"].output_token_ids[0]]


def test_chunked_prefill_samples_only_after_the_last_chunk():
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=8))
    prompt = list(range(1, 31))
    engine.add(make_request("a", prompt), max_tokens=3)
    request = engine.scheduler.requests["a"]
    chunks = []
    for _ in range(4):
        out = engine.step()
        chunks.append(out.num_scheduled_tokens["a"])
        if len(chunks) < 4:
            assert request.output_token_ids == []
    assert chunks == [8, 8, 8, 6]
    assert request.output_token_ids == [fake_token(prompt)]
    assert engine.step().num_scheduled_tokens["a"] == 1


def test_non_chunked_long_prompt_waits_for_budget():
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=10, chunked=False))
    engine.add(make_request("a", [1] * 6), max_tokens=3)
    engine.add(make_request("b", [2] * 9), max_tokens=3)
    out = engine.step()
    assert list(out.num_scheduled_tokens) == ["a"]  # b (9 tokens) does not fit the 4 left
    while "b" not in engine.step().num_scheduled_tokens:
        pass
    assert engine.scheduler.requests["b"].num_computed_tokens == 9


@pytest.mark.parametrize("caching, expected_tokens", [(True, 2), (False, 18)])
def test_prefix_cache_hit_skips_computed_blocks(caching: bool, expected_tokens: int):
    engine = FakeEngine(make_scheduler(caching=caching))
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks, the last token always computed
    engine.add(make_request("a", prompt), max_tokens=2)
    engine.run()
    engine.add(make_request("b", prompt), max_tokens=2)
    out = engine.step()
    assert out.num_scheduled_tokens["b"] == expected_tokens
    assert out.scheduled[0].start_pos == 18 - expected_tokens
    assert engine.scheduler.requests["b"].num_cached_tokens == 18 - expected_tokens
    engine.run()
    assert engine.outputs["a"] == engine.outputs["b"]


def test_preemption_victim_is_latest_admitted():
    scheduler = make_scheduler(num_blocks=4)
    engine = FakeEngine(scheduler)
    engine.add(make_request("a", list(range(1, 9))), max_tokens=4)  # 2 full blocks
    engine.add(make_request("b", list(range(20, 26))), max_tokens=4)  # 2 blocks
    engine.step()
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    out = engine.step()  # a needs a third block: b is the victim
    b = engine.scheduler.requests["b"]
    assert out.preempted_req_ids == {"b"} and list(out.num_scheduled_tokens) == ["a"]
    assert (out.stats.num_preemptions, out.stats.num_recomputed_tokens) == (1, 6)
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert (b.num_preemptions, b.num_recomputed_tokens) == (1, 6)
    assert scheduler.waiting.peek() is b
    out = engine.step()
    while "b" not in out.num_scheduled_tokens:
        out = engine.step()
    # Resumed: prompt + output recomputed, its still-cached full block hit again.
    resumed = next(s for s in out.scheduled if s.req_id == "b")
    assert (resumed.start_pos, len(resumed.token_ids)) == (4, 3)
    assert list(resumed.token_ids) == b.all_token_ids[4:7]
    assert b.num_cached_tokens == 0  # recorded at first admission only
    engine.run()
    assert (
        scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_usable_blocks
    )


def run_workload(num_blocks: int, policy: str, seed: int) -> tuple[dict[str, list[int]], int]:
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks, max_num_batched_tokens=24, policy=policy)
    engine = FakeEngine(scheduler)
    shared = [rng.randrange(1, 500) for _ in range(8)]
    requests = []
    for i in range(12):
        tail = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 14))]
        request = make_request(
            f"r{i}",
            shared + tail if i % 3 == 0 else tail,
            priority=rng.randrange(3),
            arrival_time=float(i),
        )
        requests.append(request)
        engine.add(request, max_tokens=rng.randrange(1, 12))
    for _ in range(3):
        engine.step()
    snapshot_running = list(scheduler.running)
    while scheduler.has_unfinished_requests():
        out = engine.step()
        if policy == "fcfs" and out.preempted_req_ids:
            victims = snapshot_running[-len(out.preempted_req_ids) :]
            assert {r.request_id for r in victims} == out.preempted_req_ids
            assert list(scheduler.waiting)[: len(victims)] == victims
        snapshot_running = list(scheduler.running)
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks and manager.usage == 0.0
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    return engine.outputs, sum(r.num_preemptions for r in requests)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preemption_keeps_token_streams(policy: str, seed: int):
    big_outputs, big_preemptions = run_workload(256, policy, seed)
    small_outputs, small_preemptions = run_workload(10, policy, seed)
    assert big_preemptions == 0 and small_preemptions > 0
    assert small_outputs == big_outputs


@pytest.mark.parametrize("policy, victim", [("fcfs", "c"), ("priority", "b")])
def test_preemption_victim_by_policy(policy: str, victim: str):
    scheduler = make_scheduler(num_blocks=5, policy=policy)
    engine = FakeEngine(scheduler)
    engine.add(make_request("b", [1, 2, 3, 4], priority=5, arrival_time=0.0), max_tokens=8)
    engine.step()
    engine.add(make_request("a", list(range(10, 18)), priority=0, arrival_time=1.0), max_tokens=4)
    engine.add(make_request("c", [20, 21, 22, 23], priority=1, arrival_time=2.0), max_tokens=8)
    engine.step()
    assert [r.request_id for r in scheduler.running] == ["b", "a", "c"]
    out = engine.step()  # a needs a third block; b was already scheduled this step
    assert out.preempted_req_ids == {victim}
    assert set(out.num_scheduled_tokens) == {"a", "b", "c"} - {victim}
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    engine.run()


def test_reject_requests_that_can_never_fit():
    scheduler = make_scheduler(num_blocks=4, max_model_len=32)
    with pytest.raises(RequestRejectedError, match=r"20 prompt \+ 20 max_tokens = 40.*=32"):
        scheduler.add_request(make_request("long", [1] * 20, max_tokens=20))
    with pytest.raises(RequestRejectedError, match=r"5 KV cache blocks.*20 tokens.*4 blocks"):
        scheduler.add_request(make_request("big", [1] * 10, max_tokens=10))
    with pytest.raises(RequestRejectedError, match=r"32 prompt \+ 1 max_tokens = 33"):
        scheduler.add_request(make_request("unbounded", [1] * 32))
    params = SamplingParams(max_tokens=10)
    with pytest.raises(RequestRejectedError, match="5 KV cache blocks"):
        scheduler.add_request(Request("sp", [1] * 10, params, max_tokens=10, block_size=BLOCK_SIZE))
    assert not scheduler.has_unfinished_requests()
    siblings = Request("n", [1] * 4, max_tokens=1, block_size=BLOCK_SIZE, num_forks=8)
    with pytest.raises(RequestRejectedError, match=r"9 sequences \(n/best_of\).*max_num_seqs=8"):
        scheduler.add_request(siblings)
    scheduler.add_request(make_request("ok", [1] * 10, max_tokens=6))
    with pytest.raises(RequestRejectedError, match="already in use"):
        scheduler.add_request(make_request("ok", [1] * 4, max_tokens=1))
    no_chunk = make_scheduler(max_num_batched_tokens=8, chunked=False)
    with pytest.raises(RequestRejectedError, match="max_num_batched_tokens=8"):
        no_chunk.add_request(make_request("x", [1] * 9, max_tokens=1))


def test_abort_frees_blocks_at_once():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=1)
    engine = FakeEngine(scheduler)
    engine.add(make_request("a", list(range(1, 11))), max_tokens=5)
    engine.add(make_request("b", list(range(20, 30))), max_tokens=5)
    out = scheduler.schedule()
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == 13
    scheduler.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert manager.num_free_blocks == 16 and manager.usage == 0.0
    assert scheduler.update_from_output(out, RunnerOutput(["a"], [7])) == []
    assert not scheduler.has_unfinished_requests() and not scheduler.running
    assert scheduler.schedule().finished_req_ids == {"a", "b"}
    with pytest.raises(ValueError, match="FINISHED_"):
        scheduler.finish_requests("x", RequestStatus.RUNNING)


def test_finished_requests_free_blocks_and_are_reported():
    scheduler = make_scheduler()
    engine = FakeEngine(scheduler)
    engine.add(make_request("a", [1, 2, 3, 4, 5]), max_tokens=1)
    engine.step()
    assert "a" not in scheduler.requests and engine.outputs["a"] == [fake_token([1, 2, 3, 4, 5])]
    assert scheduler.kv_cache_manager.usage == 0.0
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"} and out.is_empty
    assert out.stats.schedule_time_s > 0.0


def test_forked_child_runs_with_shared_blocks():
    scheduler = make_scheduler()
    engine = FakeEngine(scheduler)
    engine.add(make_request("p", [1, 2, 3, 4, 5, 6], priority=3), max_tokens=4)
    engine.step()
    parent = scheduler.requests["p"]
    child = scheduler.fork_request("p", "p-1", seed=7)
    assert (child.priority, child.max_tokens, child.seed) == (3, 4, 7)
    assert child.output_token_ids == parent.output_token_ids
    out = engine.step()
    assert [s.req_id for s in out.scheduled] == ["p", "p-1"]
    assert out.scheduled[1].start_pos == 6
    # The parent writes the shared partial block first: copy-on-write gives it a new table.
    assert len(out.block_copies) == 1
    assert out.scheduled[0].block_ids[0][1] != out.scheduled[1].block_ids[0][1]
    engine.run()
    assert engine.outputs["p"][1:] == engine.outputs["p-1"]  # forked after its first token
    assert scheduler.kv_cache_manager.usage == 0.0


def test_n_siblings_fork_when_the_prompt_is_done():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    engine = FakeEngine(scheduler)
    parent = Request("p", list(range(1, 11)), num_forks=2, seed=5, block_size=BLOCK_SIZE)
    engine.add(parent, max_tokens=3)
    first = engine.step()  # a partial chunk: no fork yet
    assert first.scheduled[0].forks == ()
    engine.step()
    out = engine.step()  # the last chunk: the siblings sample from its row
    assert [c for c, _ in out.scheduled[0].forks] == ["p#1", "p#2"]
    assert len({seed for _, seed in out.scheduled[0].forks} | {5}) == 3
    assert set(scheduler.requests) == {"p", "p#1", "p#2"}
    manager = scheduler.kv_cache_manager
    assert manager.get_block_ids("p#1") == manager.get_block_ids("p")
    engine.run()
    assert all(len(engine.outputs[r]) == 3 for r in ("p", "p#1", "p#2"))
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_fork_replaces_the_last_sampled_token():
    scheduler = make_scheduler()
    engine = FakeEngine(scheduler)
    engine.add(make_request("p", [1, 2, 3]), max_tokens=6)
    engine.step()
    parent = scheduler.requests["p"]
    child = scheduler.fork_request("p", "c", last_token_id=99)
    assert child.all_token_ids == [1, 2, 3, 99] and parent.all_token_ids[-1] != 99
    # The token closed a block: its hash is the hash of the new content.
    assert child.block_hashes == make_request("x", [1, 2, 3, 99]).block_hashes
    assert child.block_hashes != parent.block_hashes
    with pytest.raises(RequestRejectedError, match="already in use"):
        scheduler.fork_request("p", "c")
    with pytest.raises(RequestRejectedError, match="no such live request"):
        scheduler.fork_request("zzz", "d")
    engine.run()
    assert engine.outputs["c"][:1] == [fake_token([1, 2, 3, 99])]


def test_max_tokens_that_fit_is_bounded_by_context_and_pool():
    scheduler = make_scheduler(num_blocks=8, max_model_len=256)
    assert scheduler.max_tokens_that_fit(10) == 8 * BLOCK_SIZE - 10
    assert scheduler.max_tokens_that_fit(40) == 0
    roomy = make_scheduler(num_blocks=1000, max_model_len=64)
    assert roomy.max_tokens_that_fit(10) == 54


def test_token_stops_are_the_schedulers():
    scheduler = make_scheduler()
    params = SamplingParams(stop_token_ids=[42], min_tokens=2)
    request = Request(
        "a", [1, 2, 3], params, eos_token_ids=(7,), max_tokens=5, block_size=BLOCK_SIZE
    )
    scheduler.add_request(request)
    out = scheduler.schedule()
    (core,) = scheduler.update_from_output(out, RunnerOutput(["a"], [42]))
    assert core.status is None  # min_tokens: a stop token before it does not count
    out = scheduler.schedule()
    (core,) = scheduler.update_from_output(out, RunnerOutput(["a"], [42]))
    assert (core.status, core.stop_reason) == (RequestStatus.FINISHED_STOPPED, 42)
    scheduler.add_request(Request("b", [1, 2], eos_token_ids=(7,), block_size=BLOCK_SIZE))
    (core,) = scheduler.update_from_output(scheduler.schedule(), RunnerOutput(["b"], [7]))
    assert (core.status, core.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)
    scheduler.add_request(Request("c", [1, 2], max_tokens=1, block_size=BLOCK_SIZE))
    (core,) = scheduler.update_from_output(scheduler.schedule(), RunnerOutput(["c"], [3]))
    assert core.status == RequestStatus.FINISHED_LENGTH
    scheduler.add_request(Request("d", [1, 2], block_size=BLOCK_SIZE))
    out = scheduler.schedule()
    (core,) = scheduler.update_from_output(out, RunnerOutput(failed={"d": "boom"}))
    assert (core.status, core.error) == (RequestStatus.FINISHED_ERROR, "boom")
    assert scheduler.kv_cache_manager.usage == 0.0 and not scheduler.has_unfinished_requests()


def test_priority_policy_admits_most_important_first():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("low", [1, 2], priority=2, arrival_time=0.0, max_tokens=2))
    scheduler.add_request(make_request("high", [3, 4], priority=0, arrival_time=1.0, max_tokens=2))
    scheduler.add_request(make_request("high2", [5, 6], priority=0, arrival_time=2.0, max_tokens=2))
    assert [r.request_id for r in scheduler.waiting] == ["high", "high2", "low"]
    assert list(scheduler.schedule().num_scheduled_tokens) == ["high"]


def test_sliding_window_group_needs_only_the_window():
    groups = [
        KVCacheGroupSpec(("layers.0",), FullAttentionSpec(block_size=BLOCK_SIZE)),
        KVCacheGroupSpec(("layers.1",), SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=8)),
    ]
    manager = KVCacheManager(groups, num_blocks=32)  # block 0 is the null block: 31 usable
    config = SchedulerConfig(max_num_batched_tokens=8)
    scheduler = Scheduler(config, CacheConfig(block_size=BLOCK_SIZE), manager, max_model_len=256)
    engine = FakeEngine(scheduler)
    # 100 tokens: 25 full-attention blocks + at most cdiv(8 - 1 + 8, 4) + 1 = 5 window blocks.
    engine.add(make_request("a", list(range(1, 61))), max_tokens=40)
    with pytest.raises(RequestRejectedError, match="32 KV cache blocks"):
        engine.add(make_request("b", list(range(1, 62))), max_tokens=44)
    engine.run()
    assert len(engine.outputs["a"]) == 40
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_a_failed_step_leaves_no_uncomputed_block_in_the_prefix_cache():
    scheduler = make_scheduler()
    manager = scheduler.kv_cache_manager
    prompt = list(range(1, 14))  # 3 full blocks of 4
    scheduler.add_request(make_request("a", prompt, max_tokens=2))
    scheduler.add_request(make_request("b", prompt + [50, 51], max_tokens=2))
    scheduler.add_request(make_request("c", [90, 91, 92, 93, 94], max_tokens=2))
    out = scheduler.schedule()
    # b hit a's blocks in the same step, before the step computed them.
    assert out.scheduled[1].start_pos == 12
    cores = scheduler.update_from_output(out, RunnerOutput(["c"], [7], failed={"a": "boom"}))
    status = {c.req_id: c.status for c in cores}
    assert status["a"] == status["b"] == RequestStatus.FINISHED_ERROR
    assert status["c"] is None
    assert len(manager.block_pool.cached_block_hash_to_block) == 1  # c's one full block
    again = make_request("d", prompt, max_tokens=2)
    assert manager.get_computed_blocks(again)[1] == 0


def test_the_step_budget_follows_measured_step_times():
    from pagedattn.core.step_budget import INITIAL_STEP_TOKENS, StepTokenBudget

    budget = StepTokenBudget(None, target_step_time_s=0.5, min_tokens=8)
    assert budget.tokens == INITIAL_STEP_TOKENS
    budget.observe(256, 256 * 0.005, 256)  # a slow CPU: 5 ms per token
    assert budget.tokens == 100
    budget.observe(4, 0.4, 4)  # a tiny step is mostly overhead: not measured
    assert budget.tokens == 100
    for _ in range(12):  # the machine is fast now: 0.1 ms per token; the budget doubles at most
        previous = budget.tokens
        budget.observe(budget.tokens, budget.tokens * 0.0001, budget.tokens)
        assert budget.tokens <= 2 * previous
    assert budget.tokens == 2048  # the cap
    # Decode-only steps, however wide, are not measured: 32 decodes in 22 ms are 0.69 ms per
    # token (the weights streamed for a few tokens), which would shrink a prompt's chunk to 700.
    for _ in range(50):
        budget.observe(32, 0.022, 0)
    assert budget.tokens == 2048
    budget.observe(40, 0.04, 8)  # a step with a prompt chunk beside the decodes is measured
    assert budget.tokens < 2048
    fixed = StepTokenBudget(512, target_step_time_s=0.5, min_tokens=8)
    fixed.observe(512, 512 * 0.005, 512)
    assert fixed.tokens == 512 and not fixed.is_adaptive
    assert budget.tokens_for(streaming=False) == budget.max_tokens == 2048
    assert budget.tokens_for(streaming=True) == budget.tokens


def test_a_step_with_no_stream_decoding_takes_the_whole_budget_cap():
    # 32 prompts of 64 tokens arrive at once on an unmeasured engine: nothing decodes yet, so the
    # first step takes the cap (2,048 tokens), not the small first budget (256) that protects
    # decoding streams; once streams decode, the measured budget applies.
    from pagedattn.core.step_budget import INITIAL_STEP_TOKENS

    scheduler = make_scheduler(
        num_blocks=1000, max_num_batched_tokens=None, max_num_seqs=64, max_model_len=512
    )
    engine = FakeEngine(scheduler)
    for i in range(48):
        engine.add(make_request(f"r{i}", list(range(1 + i, 65 + i))), max_tokens=4)
    first = engine.step()
    assert first.total_num_scheduled_tokens == 2048 == 32 * 64
    assert first.stats.num_prefill_tokens == 2048
    second = engine.step()  # 32 streams decode: the unmeasured budget (256) holds
    assert second.total_num_scheduled_tokens == INITIAL_STEP_TOKENS
    assert second.stats.num_prefill_tokens == INITIAL_STEP_TOKENS - 32


@pytest.mark.parametrize("max_num_batched_tokens", [None, 2048])
def test_a_long_prompt_does_not_stall_decoders_for_seconds(max_num_batched_tokens):
    # Synthetic timings of a 2-core CPU: a step costs 5 ms per token (a 2048-token chunk: 10 s).
    seconds_per_token = 0.005
    scheduler = make_scheduler(
        num_blocks=2000, max_num_batched_tokens=max_num_batched_tokens, max_model_len=8192
    )
    engine = FakeEngine(scheduler)
    engine.add(make_request("decoder", [1, 2, 3, 4]), max_tokens=200)
    engine.step()  # the decoder's prompt
    engine.add(make_request("long", list(range(5, 5005))), max_tokens=1)
    step_times = []
    while "long" in scheduler.requests:
        out = engine.step()
        assert "decoder" in out.num_scheduled_tokens  # it decodes every step
        step_time = out.total_num_scheduled_tokens * seconds_per_token
        scheduler.observe_step_time(
            out.total_num_scheduled_tokens, step_time, out.stats.num_prefill_tokens
        )
        step_times.append(step_time)
    if max_num_batched_tokens is None:
        # Only the first chunk (before any measurement) may pass the 0.5 s target.
        assert max(step_times[1:]) <= 0.5 + seconds_per_token
        assert step_times[0] <= 256 * seconds_per_token + seconds_per_token
    else:  # the explicit budget is kept: 2048-token chunks, a 10 s stall each
        assert max(step_times) > 10.0


def _long_and_shorts(threshold: int) -> tuple[FakeEngine, list[SchedulerOutput]]:
    """A 60-token prompt, then two 6-token prompts queued one step later; budget 24 a step."""
    engine = FakeEngine(
        make_scheduler(max_num_batched_tokens=24, long_prefill_token_threshold=threshold)
    )
    engine.add(make_request("long", list(range(100, 160))), max_tokens=3)
    outs = [engine.step()]
    engine.add(make_request("s0", list(range(1, 7))), max_tokens=4)
    engine.add(make_request("s1", list(range(7, 13))), max_tokens=4)
    return engine, outs + engine.run()


def test_long_prefill_threshold_admits_short_prompts_beside_a_capped_long_one():
    engine, outs = _long_and_shorts(threshold=8)
    # Every step the long prompt computes at most 8 tokens; the shorts fill the rest at once.
    assert outs[0].num_scheduled_tokens == {"long": 8}
    assert outs[1].num_scheduled_tokens == {"long": 8, "s0": 6, "s1": 6}
    assert all(out.num_scheduled_tokens.get("long", 0) <= 8 for out in outs)
    # The shorts sample their first token in step 2, not after the long prompt's last chunk.
    assert [s.req_id for s in outs[1].scheduled if s.needs_sample] == ["s0", "s1"]
    uncapped, uncapped_outs = _long_and_shorts(threshold=0)
    assert uncapped_outs[1].num_scheduled_tokens == {"long": 24}  # the shorts wait behind it
    # Chunking changes when tokens come, never which: the same tokens as without the cap.
    assert engine.outputs == uncapped.outputs
    assert sorted(engine.outputs) == ["long", "s0", "s1"]


def test_long_prefill_threshold_caps_a_preempted_request_resuming():
    engine = FakeEngine(
        make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=5, caching=False)
    )
    engine.add(make_request("a", list(range(1, 13))), max_tokens=3)
    sizes = [engine.step().num_scheduled_tokens["a"] for _ in range(4)]
    assert sizes == [5, 5, 2, 1]  # the prompt in capped chunks, then a decode step
    scheduler = engine.scheduler
    scheduler._preempt(scheduler.running.pop())  # 14 tokens (prompt + 2 outputs) to recompute
    assert engine.step().num_scheduled_tokens["a"] == 5
    engine.run()
    assert len(engine.outputs["a"]) == 3


def test_long_prefill_threshold_needs_chunked_prefill():
    from pagedattn.config import ConfigError

    with pytest.raises(ConfigError, match="chunked prefill is off"):
        SchedulerConfig(long_prefill_token_threshold=64, enable_chunked_prefill=False)
    with pytest.raises(ConfigError, match="long_prefill_token_threshold=-1"):
        SchedulerConfig(long_prefill_token_threshold=-1)
