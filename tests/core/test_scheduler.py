"""Scheduler: admission limits, chunked prefill, prefix hits, preemption, rejection, abort, fork."""

from __future__ import annotations

import random

import pytest

from pagedattn.config import CacheConfig, SchedulerConfig
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedattn.core.request import Request, RequestStatus
from pagedattn.core.scheduler import RequestRejectedError, Scheduler
from pagedattn.core.scheduler_output import SchedulerOutput
from pagedattn.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    chunked: bool = True,
    policy: str = "fcfs",
    caching: bool = True,
    max_model_len: int = 256,
) -> Scheduler:
    groups = [KVCacheGroupSpec(("layers.0",), FullAttentionSpec(block_size=BLOCK_SIZE))]
    manager = KVCacheManager(groups, num_blocks, enable_caching=caching)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_prefix_caching=caching
    )
    return Scheduler(scheduler_config, cache_config, manager, max_model_len)


def make_request(
    req_id: str, prompt: list[int], *, priority: int = 0, arrival_time: float = 0.0
) -> Request:
    return Request(
        req_id, prompt, priority=priority, arrival_time=arrival_time, block_size=BLOCK_SIZE
    )


def fake_token(token_ids: list[int]) -> int:
    """A deterministic "model": the next token depends on the whole context."""
    return sum((i + 1) * t for i, t in enumerate(token_ids)) * 2654435761 % 997


class FakeEngine:
    """Drives a scheduler like the engine: schedule -> fake model -> stop check -> update.

    It also plays the model runner, keeping block tables from the outputs alone, and checks that
    every scheduled token has a slot and that new/cached/preempted/finished ids are consistent.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.max_tokens: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}

    def add(self, request: Request, max_tokens: int) -> None:
        self.scheduler.add_request(request, max_tokens)
        self.max_tokens[request.request_id] = max_tokens

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self._check_runner_view(out)
        sampled: dict[str, list[int]] = {}
        finished: dict[str, RequestStatus] = {}
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            # NOTE: sampled for partial prefill chunks too: the scheduler must drop those.
            sampled[req_id] = [fake_token(request.all_token_ids)]
            done_prefill = request.num_computed_tokens == request.num_tokens
            if done_prefill and request.num_output_tokens + 1 >= self.max_tokens[req_id]:
                finished[req_id] = RequestStatus.FINISHED_LENGTH
        for request in self.scheduler.update_from_output(out, sampled, finished):
            self.outputs[request.request_id] = list(request.output_token_ids)
        return out

    def run(self, max_steps: int = 2000) -> list[SchedulerOutput]:
        outs = []
        while self.scheduler.has_unfinished_requests():
            assert len(outs) < max_steps, "the scheduler made no progress"
            outs.append(self.step())
        return outs

    def _check_runner_view(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(req_id, None)
        for data in out.scheduled_new_reqs:
            assert data.req_id not in self.tables
            self.tables[data.req_id] = list(data.block_ids[0])
        for data in out.scheduled_cached_reqs:
            if data.block_ids is not None:
                self.tables[data.req_id] = list(data.block_ids[0])
            else:
                self.tables[data.req_id].extend(data.new_block_ids[0])
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert (
            out.total_num_scheduled_tokens <= self.scheduler.scheduler_config.max_num_batched_tokens
        )
        assert len(out.num_scheduled_tokens) <= self.scheduler.scheduler_config.max_num_seqs
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            assert len(self.tables[req_id]) * BLOCK_SIZE >= request.num_computed_tokens
            assert self.tables[req_id] == self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]


def test_admission_limited_by_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 4), max_tokens=4)
    out = scheduler.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == ["r0", "r1"]
    assert (out.stats.num_running_reqs, out.stats.num_waiting_reqs) == (2, 3)


@pytest.mark.parametrize("chunked, expected", [(False, [4, 4]), (True, [4, 4, 2])])
def test_admission_limited_by_token_budget(chunked: bool, expected: list[int]):
    scheduler = make_scheduler(max_num_batched_tokens=10, chunked=chunked)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 4), max_tokens=4)
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
    assert [d.req_id for d in out.scheduled_cached_reqs] == ["a"]
    assert out.scheduled_cached_reqs[0].new_token_ids == [
        engine.scheduler.requests["a"].output_token_ids[0]
    ]


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
    assert out.scheduled_new_reqs[0].num_computed_tokens == 18 - expected_tokens
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
    resumed = out.scheduled_new_reqs[0]
    assert (resumed.req_id, resumed.num_computed_tokens) == ("b", 4)
    assert out.num_scheduled_tokens["b"] == 3
    assert resumed.prompt_token_ids + resumed.output_token_ids == b.all_token_ids[:7]
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
        scheduler.add_request(make_request("long", [1] * 20), max_tokens=20)
    with pytest.raises(RequestRejectedError, match=r"5 KV cache blocks.*20 tokens.*4 blocks"):
        scheduler.add_request(make_request("big", [1] * 10), max_tokens=10)
    with pytest.raises(RequestRejectedError, match=r"32 prompt \+ 1 max_tokens = 33"):
        scheduler.add_request(make_request("unbounded", [1] * 32))
    params = SamplingParams(max_tokens=10)
    with pytest.raises(RequestRejectedError, match="5 KV cache blocks"):
        scheduler.add_request(Request("sp", [1] * 10, params, block_size=BLOCK_SIZE))
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("ok", [1] * 10), max_tokens=6)
    with pytest.raises(RequestRejectedError, match="already in use"):
        scheduler.add_request(make_request("ok", [1] * 4), max_tokens=1)
    no_chunk = make_scheduler(max_num_batched_tokens=8, chunked=False)
    with pytest.raises(RequestRejectedError, match="max_num_batched_tokens=8"):
        no_chunk.add_request(make_request("x", [1] * 9), max_tokens=1)


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
    assert scheduler.update_from_output(out, {"a": [7]}) == []
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
    engine.add(make_request("p", [1, 2, 3, 4, 5, 6]), max_tokens=4)
    engine.step()
    parent = scheduler.requests["p"]
    child = parent.clone("p-1")
    scheduler.kv_cache_manager.fork(parent, child)
    scheduler.add_running_request(child)
    engine.max_tokens["p-1"] = 4
    out = engine.step()
    new = out.scheduled_new_reqs[0]
    assert new.req_id == "p-1" and new.num_computed_tokens == 6
    assert new.output_token_ids == parent.output_token_ids[:1]
    # The parent writes the shared partial block first: copy-on-write gives it a new table.
    assert len(out.block_copies) == 1
    assert out.scheduled_cached_reqs[0].block_ids is not None
    engine.run()
    assert engine.outputs["p"] == engine.outputs["p-1"]
    assert scheduler.kv_cache_manager.usage == 0.0


def test_priority_policy_admits_most_important_first():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("low", [1, 2], priority=2, arrival_time=0.0), 2)
    scheduler.add_request(make_request("high", [3, 4], priority=0, arrival_time=1.0), 2)
    scheduler.add_request(make_request("high2", [5, 6], priority=0, arrival_time=2.0), 2)
    assert [r.request_id for r in scheduler.waiting] == ["high", "high2", "low"]
    assert list(scheduler.schedule().num_scheduled_tokens) == ["high"]


def test_add_running_request_needs_a_fork():
    scheduler = make_scheduler()
    with pytest.raises(KeyError, match="holds no blocks"):
        scheduler.add_running_request(make_request("orphan", [1, 2, 3]))
    assert not scheduler.has_unfinished_requests()


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
