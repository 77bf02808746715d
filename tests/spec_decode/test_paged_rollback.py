"""Paged rollback: accept/reject patterns through the scheduler and the KV cache manager.

A fake model (the next token is a hash of the context) and a fake proposer whose drafts are right
for a random prefix drive speculative steps across block boundaries, with preemption and forks.
After every step: the pool's counts and reference counts add up, every table covers exactly the
computed tokens (a block of rejected drafts went back), and the hash chain and the prefix cache
hold accepted tokens only.
"""

from __future__ import annotations

import random

import pytest

from pagedattn.config import CacheConfig, SchedulerConfig
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedattn.core.kv_cache_utils import hash_request_tokens
from pagedattn.core.kv_events import BlockStored
from pagedattn.core.request import Request
from pagedattn.core.scheduler import Scheduler
from pagedattn.core.scheduler_output import RunnerOutput, SchedulerOutput

BLOCK_SIZE = 4
K = 5


def fake_token(token_ids: list[int]) -> int:
    """The "model": the next token depends on the whole context."""
    return sum((i + 1) * t for i, t in enumerate(token_ids)) * 2654435761 % 997


def reference(prompt: list[int], max_tokens: int, first: int | None = None) -> list[int]:
    """Greedy decoding without speculation (a fork's first token given)."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        token = fake_token(tokens) if first is None or out else first
        out.append(token)
        tokens.append(token)
    return out


def make_scheduler(num_blocks: int, sliding: bool = False, max_num_seqs: int = 8) -> Scheduler:
    groups = [KVCacheGroupSpec(("layers.0",), FullAttentionSpec(block_size=BLOCK_SIZE))]
    if sliding:
        groups.append(
            KVCacheGroupSpec(
                ("layers.1",), SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=6)
            )
        )
    manager = KVCacheManager(groups, num_blocks, enable_kv_cache_events=True)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks)
    return Scheduler(config, cache, manager, max_model_len=256)


class SpecFakeEngine:
    """schedule -> fake verification -> update_from_output, with drafts right for a random
    number of positions (0..K), and the checks after every step."""

    def __init__(self, scheduler: Scheduler, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.outputs: dict[str, list[int]] = {}
        self.all_sequences: list[list[int]] = []
        self.stored_hashes: set[bytes] = set()
        self.num_accepted = self.num_rejected = 0

    def propose(self) -> None:
        drafts = {}
        for request in self.scheduler.decoding_requests():
            tokens = list(request.token_ids)
            num_right = self.rng.randint(0, K)
            draft = []
            for i in range(K):
                token = fake_token(tokens)
                draft.append(token if i < num_right else (token + 1) % 997)
                tokens.append(draft[-1])
            drafts[request.req_id] = draft
        self.scheduler.update_draft_token_ids(drafts)

    def step(self) -> SchedulerOutput:
        self.propose()
        out = self.scheduler.schedule()
        req_ids, tokens, accepted = [], [], {}
        for s in out.scheduled:
            request = self.scheduler.requests[s.req_id]
            table = self.scheduler.kv_cache_manager.get_block_ids(s.req_id)
            assert all(len(t) * BLOCK_SIZE >= s.start_pos + len(s.token_ids) for t in table)
            if not s.needs_sample:
                continue
            known = list(s.prompt_token_ids) + list(s.output_token_ids)
            draft = list(s.spec_token_ids)
            assert list(s.token_ids) == known[s.start_pos :] + draft
            n = 0
            while n < len(draft) and draft[n] == fake_token(known + draft[:n]):
                n += 1
            self.num_accepted += n
            self.num_rejected += len(draft) - n
            req_ids.append(s.req_id)
            tokens.append(fake_token(known + draft[:n]))
            if draft:
                accepted[s.req_id] = draft[:n]
            for child_id, _ in s.forks:
                req_ids.append(child_id)
                tokens.append(fake_token(list(s.prompt_token_ids)) + 1)
            assert request.spec_token_ids == draft
        runner = RunnerOutput(req_ids, tokens, accepted_draft_ids=accepted)
        for core in self.scheduler.update_from_output(out, runner):
            self.outputs.setdefault(core.req_id, []).extend(core.new_token_ids)
        self.check()
        return out

    def check(self) -> None:
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        refs: dict[int, int] = {}
        for m in manager.managers:
            for blocks in m.req_to_blocks.values():
                for b in blocks:
                    if not b.is_null:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
        # The pool: free + held = usable, and each block's ref_cnt = the tables holding it.
        assert pool.get_num_free_blocks() + len(refs) == pool.num_usable_blocks
        for block in pool.blocks:
            if not block.is_null:
                assert block.ref_cnt == refs.get(block.block_id, 0), block
        for req_id, request in self.scheduler.requests.items():
            assert request.spec_token_ids == []
            assert request.block_hashes == hash_request_tokens(
                BLOCK_SIZE, request.all_token_ids, request.hash_seed
            )
            for m in manager.managers:
                blocks = m.req_to_blocks.get(req_id)
                if blocks is None:
                    continue
                # No block past the computed tokens: rejected drafts' blocks went back.
                assert len(blocks) == -(-request.num_computed_tokens // BLOCK_SIZE)
                for i, block in enumerate(blocks):
                    if block.block_hash is not None:
                        assert (i + 1) * BLOCK_SIZE <= request.num_computed_tokens
                        assert block.block_hash[:-4] == request.block_hashes[i]
        for event in manager.take_events():
            if isinstance(event, BlockStored):
                self.stored_hashes.update(event.block_hashes)

    def run(self, max_steps: int = 500) -> None:
        steps = 0
        while self.scheduler.has_unfinished_requests():
            steps += 1
            assert steps < max_steps, "no progress"
            self.step()

    def check_stored_hashes_accepted(self) -> None:
        """Every BlockStored hash is a block of a final (accepted-only) token sequence."""
        accepted = set()
        for tokens in self.all_sequences:
            accepted.update(hash_request_tokens(BLOCK_SIZE, tokens, "pagedattn"))
        assert self.stored_hashes and self.stored_hashes <= accepted


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_accept_patterns_match_plain_decoding(seed, sliding):
    engine = SpecFakeEngine(make_scheduler(128, sliding), seed)
    rng = random.Random(seed)
    prompts = {
        f"r{i}": [rng.randrange(1, 997) for _ in range(rng.randint(3, 14))] for i in range(4)
    }
    max_tokens = {req_id: rng.randint(1, 30) for req_id in prompts}
    for req_id, prompt in prompts.items():
        engine.scheduler.add_request(
            Request(req_id, prompt, max_tokens=max_tokens[req_id], block_size=BLOCK_SIZE)
        )
    engine.run()
    for req_id, prompt in prompts.items():
        # max_tokens is never exceeded, and the tokens are those of plain decoding.
        assert engine.outputs[req_id] == reference(prompt, max_tokens[req_id])
    assert engine.num_accepted > 0 and engine.num_rejected > 0
    engine.all_sequences = [prompts[r] + engine.outputs[r] for r in prompts]
    engine.check_stored_hashes_accepted()
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_preemption_during_speculation_keeps_tokens_and_pool():
    # 20 blocks of 4 for six sequences growing to 12..26 tokens: preemption is certain.
    engine = SpecFakeEngine(make_scheduler(20), seed=3)
    rng = random.Random(3)
    prompts = {
        f"r{i}": [rng.randrange(1, 997) for _ in range(rng.randint(6, 12))] for i in range(6)
    }
    for req_id, prompt in prompts.items():
        engine.scheduler.add_request(Request(req_id, prompt, max_tokens=14, block_size=BLOCK_SIZE))
    engine.run()
    assert engine.scheduler.num_preemptions_total > 0
    for req_id, prompt in prompts.items():
        assert engine.outputs[req_id] == reference(prompt, 14)
    engine.all_sequences = [prompts[r] + engine.outputs[r] for r in prompts]
    engine.check_stored_hashes_accepted()


def test_forked_siblings_speculate_on_shared_blocks():
    engine = SpecFakeEngine(make_scheduler(64), seed=4)
    prompt = [7, 8, 9, 10, 11, 12]  # a shared partial block: the first write copies it
    engine.scheduler.add_request(
        Request("p", prompt, max_tokens=17, block_size=BLOCK_SIZE, num_forks=2)
    )
    engine.run()
    assert engine.outputs["p"] == reference(prompt, 17)
    first = fake_token(prompt) + 1
    for child in ("p#1", "p#2"):
        assert engine.outputs[child] == reference(prompt, 17, first=first)
    assert engine.scheduler.kv_cache_manager.num_cow_copies > 0
    assert engine.num_rejected > 0


def test_block_of_rejected_drafts_goes_straight_back():
    scheduler = make_scheduler(16)
    manager = scheduler.kv_cache_manager
    request = Request("a", [1, 2, 3, 4, 5, 6], max_tokens=20, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    out = scheduler.schedule()  # the prompt: 2 blocks
    known = request.prompt_token_ids
    scheduler.update_from_output(out, RunnerOutput(["a"], [fake_token(known)]))
    assert request.num_computed_tokens == 6 and len(manager.get_block_ids("a")[0]) == 2
    free_before = manager.num_free_blocks
    scheduler.update_draft_token_ids({"a": [900, 901, 902, 903]})  # positions 7..10: 3rd block
    out = scheduler.schedule()
    table = manager.get_block_ids("a")[0]
    assert len(table) == 3 and out.scheduled[0].token_ids == [
        request.all_token_ids[-1],
        900,
        901,
        902,
        903,
    ]
    third = manager.block_pool.blocks[table[2]]
    # Every draft rejected: the target's own token comes instead.
    scheduler.update_from_output(out, RunnerOutput(["a"], [5], accepted_draft_ids={"a": []}))
    assert request.output_token_ids[-1] == 5 and request.num_computed_tokens == 7
    assert manager.get_block_ids("a")[0] == table[:2]
    assert third.ref_cnt == 0 and third.block_hash is None
    assert third in manager.block_pool.free_block_queue.get_all_free_blocks()
    assert manager.num_free_blocks == free_before
    # The second block's hash covers the accepted token, never a draft; its last slot is not
    # computed yet, so it is not in the prefix cache.
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6, known_next(request), 5]
    assert request.block_hashes == hash_request_tokens(
        BLOCK_SIZE, request.all_token_ids, "pagedattn"
    )
    assert manager.block_pool.blocks[table[1]].block_hash is None
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert [list(e.token_ids) for e in stored] == [[1, 2, 3, 4]]


def known_next(request: Request) -> int:
    return fake_token(request.prompt_token_ids)
