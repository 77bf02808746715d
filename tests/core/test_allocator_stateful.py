"""Hypothesis state machine: random admit/step/fork/CoW/free/preempt/evict keep the pool sound."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedattn.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedattn.core.request import Request

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=12)  # tiny vocab: many shared prefixes
CHUNK = st.integers(1, 8)


class AllocatorMachine(RuleBasedStateMachine):
    """Mirrors what the engine does with a KVCacheManager and checks the pool after each step."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 14),
        window=st.one_of(st.none(), st.integers(1, 6)),
    )
    def setup(self, block_size: int, num_blocks: int, window: int | None) -> None:
        groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size))]
        if window is not None:
            groups.append(KVCacheGroupSpec(("sw",), SlidingWindowSpec(block_size, window)))
        self.manager = KVCacheManager(groups, num_blocks + (window is not None))
        self.block_size = block_size
        self.windows = [None, window][: len(groups)]
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        # What the runner wrote: block id -> {offset: token id}.
        self.content: dict[int, dict[int, int]] = {}
        # Prefix-cache key -> the tokens its block must hold.
        self.key_tokens: dict[bytes, tuple[int, ...]] = {}
        self.next_id = 0

    # Helpers.

    def _note_hashes(self, req: Request) -> None:
        B = self.block_size
        for i, block_hash in enumerate(req.block_hashes):
            tokens = tuple(req.all_token_ids[i * B : (i + 1) * B])
            for gid in range(self.manager.num_groups):
                key = block_hash + gid.to_bytes(4, "big")
                assert self.key_tokens.setdefault(key, tokens) == tokens, "hash collision"

    def _write(self, req: Request, out: KVCacheBlocks, num_new: int) -> None:
        for group in out.blocks:
            for block in group:
                self.content[block.block_id] = {}
        for src, dst in self.manager.take_block_copies():
            event("copy-on-write")
            self.content[dst] = dict(self.content[src])
        B = self.block_size
        start = req.num_computed_tokens
        tables = self.manager.get_block_ids(req.request_id)
        for table, window in zip(tables, self.windows, strict=True):
            # Every key the new tokens attend to is in the cache, in a live block, correct.
            first_read = 0 if window is None else max(start - window + 1, 0)
            for pos in range(first_read, start):
                block_id = table[pos // B]
                assert not self.manager.block_pool.blocks[block_id].is_null, f"{pos} dropped"
                assert self.content[block_id].get(pos % B) == req.all_token_ids[pos]
            for pos in range(start, start + num_new):
                block = self.manager.block_pool.blocks[table[pos // B]]
                assert not block.is_null and block.ref_cnt == 1, f"write to shared {block}"
                written = self.content[block.block_id]
                assert pos % B not in written, f"slot {pos % B} of {block} written twice"
                written[pos % B] = req.all_token_ids[pos]
        req.num_computed_tokens = start + num_new

    def _admit(self, req: Request, chunk: int) -> None:
        hits, num_hit = self.manager.get_computed_blocks(req)
        assert num_hit < req.num_tokens and num_hit % self.block_size == 0
        event("prefix hit" if num_hit else "prefix miss")
        B = self.block_size
        for group in hits.blocks:
            for i, block in enumerate(group):
                if not block.is_null:
                    expected = dict(enumerate(req.all_token_ids[i * B : (i + 1) * B]))
                    assert self.content[block.block_id] == expected, "hit serves wrong tokens"
        num_new = min(chunk, req.num_tokens - num_hit)
        out = self.manager.allocate_slots(req, num_new, hits, num_hit)
        if out is None:
            event("cannot allocate")
            assert req.request_id not in self.manager.requests
            self.waiting.append(req)
            return
        req.num_computed_tokens = num_hit
        self.running[req.request_id] = req
        self._write(req, out, num_new)

    def _preempt(self, req: Request) -> None:
        self.manager.free(req)
        del self.running[req.request_id]
        req.num_computed_tokens = 0
        self.waiting.append(req)

    # Rules.

    @rule(tokens=TOKENS, salt=st.sampled_from([None, "tenant"]), chunk=CHUNK)
    def admit(self, tokens: list[int], salt: str | None, chunk: int) -> None:
        self.next_id += 1
        req = Request(f"r{self.next_id}", tokens, cache_salt=salt, block_size=self.block_size)
        self._note_hashes(req)
        self._admit(req, chunk)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=CHUNK)
    def resume(self, data: st.DataObject, chunk: int) -> None:
        req = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        self._admit(req, chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2), chunk=CHUNK)
    def step(self, data: st.DataObject, token: int, chunk: int) -> None:
        req = data.draw(st.sampled_from(sorted(self.running.values(), key=lambda r: r.request_id)))
        if req.num_computed_tokens < req.num_tokens:
            num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        else:
            req.append_output_token_ids(token)
            self._note_hashes(req)
            num_new = 1
        out = self.manager.allocate_slots(req, num_new)
        if out is None:
            event("preempted for lack of blocks")
            self._preempt(req)
        else:
            self._write(req, out, num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(
            st.sampled_from(sorted(self.running.values(), key=lambda r: r.request_id))
        )
        self.next_id += 1
        child = parent.fork(f"r{self.next_id}")
        self.manager.fork(parent, child)
        self.running[child.request_id] = child

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        req = data.draw(st.sampled_from(sorted(self.running.values(), key=lambda r: r.request_id)))
        if preempt:
            self._preempt(req)
        else:
            self.manager.free(req)
            del self.running[req.request_id]
            self.manager.free(req)  # double free of a request: a no-op

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.running)

    # Invariants.

    @invariant()
    def pool_is_consistent(self) -> None:
        manager = self.manager
        pool = manager.block_pool
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) == pool.get_num_free_blocks()
        assert set(manager.requests) == set(self.running)
        refs = Counter(
            block_id
            for req_id in self.running
            for table in manager.get_block_ids(req_id)
            for block_id in table
        )
        free_set = set(free)
        for block in pool.blocks:
            if block.is_null:
                assert block.block_id not in free_set and block.ref_cnt == 0
                continue
            assert block.ref_cnt == refs[block.block_id], f"{block} in {refs[block.block_id]}"
            assert (block.ref_cnt == 0) == (block.block_id in free_set)
        if pool.num_evictions:
            event("eviction")
        for key, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == key and not block.is_null
            tokens = self.key_tokens[key]
            assert self.content[block.block_id] == dict(enumerate(tokens)), "cached != content"

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for req in list(self.running.values()):
            self.manager.free(req)
        pool = self.manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)


AllocatorMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocator = AllocatorMachine.TestCase
