"""Routing policies and the request hasher: affinity, imbalance, misses, tenants, engine hashes."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedattn.core import kv_events as core
from pagedattn.core.kv_cache_utils import hash_request_tokens
from pagedattn.core.request import Request
from pagedattn.distributed.kv_events import make_batch
from pagedattn.serve.prefix_index import PrefixIndex
from pagedattn.serve.router import (
    PowerOfTwoPolicy,
    PrefixAwarePolicy,
    RequestHasher,
    RoundRobinPolicy,
    make_policy,
)

B = 4


def stored(hashes: list[bytes]) -> core.BlockStored:
    return core.BlockStored(tuple(hashes), None, tuple(range(B * len(hashes))), B)


def index_with(**held: list[bytes]) -> PrefixIndex:
    index = PrefixIndex()
    for replica, hashes in held.items():
        index.add_replica(replica)
        index.apply(replica, make_batch([stored(hashes)]))
    return index


def test_prefix_picks_the_longest_cached_prefix():
    h = hash_request_tokens(B, list(range(16)), "pagedattn")
    index = index_with(a=h[:1], b=h[:3], c=[])
    policy = PrefixAwarePolicy(index, imbalance_threshold=4, seed=0)
    for _ in range(5):
        assert policy.rank(["a", "b", "c"], {"a": 0, "b": 2, "c": 0}, h)[0] == "b"
    # A chained hash: holding block 2 without block 1 is no match past block 0.
    index = index_with(a=[h[0], h[2]], b=h[:2])
    policy = PrefixAwarePolicy(index, seed=0)
    assert policy.rank(["a", "b"], {}, h)[0] == "b"


def test_prefix_ignores_affinity_when_queues_are_imbalanced():
    h = hash_request_tokens(B, list(range(16)), "pagedattn")
    policy = PrefixAwarePolicy(index_with(a=h, b=[]), imbalance_threshold=4, seed=0)
    assert policy.rank(["a", "b"], {"a": 4, "b": 0}, h)[0] == "a"  # spread 4: not past it
    assert policy.rank(["a", "b"], {"a": 5, "b": 0}, h)[0] == "b"
    assert policy.num_imbalanced == 1
    # Two deep queues a few requests apart are not imbalanced (30 < 1.5 * 25): affinity holds.
    assert policy.rank(["a", "b"], {"a": 30, "b": 25}, h)[0] == "a"
    assert policy.rank(["a", "b"], {"a": 40, "b": 25}, h)[0] == "b"
    assert policy.num_imbalanced == 2
    with pytest.raises(ValueError, match="imbalance_ratio=0.5 is invalid"):
        PrefixAwarePolicy(PrefixIndex(), imbalance_ratio=0.5)


def test_misses_go_to_the_least_loaded_and_routed_prefixes_stick():
    index = index_with(a=[], b=[], c=[])
    policy = PrefixAwarePolicy(index, seed=0)
    h = hash_request_tokens(B, list(range(40, 60)), "pagedattn")
    first = policy.rank(["a", "b", "c"], {"a": 3, "b": 1, "c": 2}, h)
    assert first[0] == "b" and policy.num_misses == 1
    policy.on_routed("b", h)
    # Before b's events arrive, the same prefix follows it (even if b is now a bit busier).
    assert policy.rank(["a", "b", "c"], {"a": 0, "b": 2, "c": 0}, h)[0] == "b"
    # The routed entry expires when b's events evict those blocks.
    index.apply("b", make_batch([core.BlockRemoved(tuple(h))]))
    assert policy.rank(["a", "b", "c"], {"a": 0, "b": 2, "c": 1}, h)[0] == "a"


def test_equally_loaded_misses_go_to_the_replica_holding_fewer_blocks():
    index = index_with(a=[b"1" * 16, b"2" * 16], b=[b"3" * 16])
    policy = PrefixAwarePolicy(index, seed=0)
    new = [b"9" * 16]
    assert policy.rank(["a", "b"], {"a": 0, "b": 0}, new) == ["b", "a"]
    policy.on_routed("b", new + [b"8" * 16, b"7" * 16])
    assert policy.rank(["a", "b"], {"a": 0, "b": 0}, [b"6" * 16])[0] == "a"


def test_shared_blocks_count_prefixes_cached_on_several_replicas():
    h = hash_request_tokens(B, list(range(16)), "pagedattn")
    index = index_with(a=h[:3], b=h[1:4], c=h[2:3])
    assert index.num_shared_blocks() == 2  # h[1] on a and b, h[2] on all three
    index.apply("b", make_batch([core.AllBlocksCleared()]))
    assert index.num_shared_blocks() == 1


def test_a_queued_requests_claim_outlasts_a_long_queue():
    # An overloaded replica admits a request (and sends its BlockStored) minutes later; until
    # then the prefix stays claimed, so its next request is not sent to the other replica too.
    index = PrefixIndex()
    index.add_replica("a")
    index.add_replica("b")
    h = [b"x" * 16, b"y" * 16]
    index.note_routed("a", h, now=0.0)
    assert index.match_length("a", h, now=120.0) == 2
    assert index.match_length("b", h, now=120.0) == 0


def test_routed_entries_expire():
    index = PrefixIndex(routed_ttl_s=10.0)
    index.add_replica("a")
    h = [b"x" * 16, b"y" * 16]
    index.note_routed("a", h, now=100.0)
    assert index.match_length("a", h, now=105.0) == 2
    assert index.match_length("a", h, now=111.0) == 0


def test_tenants_never_match_each_others_blocks():
    hasher = RequestHasher(tokenizer=None, block_size=B)
    tokens = list(range(32))
    t1, t2 = hasher.block_hashes(tokens, "tenant-1"), hasher.block_hashes(tokens, "tenant-2")
    assert not set(t1) & set(t2)
    policy = PrefixAwarePolicy(index_with(a=t1, b=[]), seed=0)
    policy.rank(["a", "b"], {}, t2)
    assert policy.num_misses == 1 and policy.num_hits == 0
    policy.rank(["a", "b"], {}, t1)
    assert policy.num_hits == 1


def test_hasher_equals_the_engines_request_hashes():
    hasher = RequestHasher(tokenizer=None, block_size=B, hash_seed="seed-x")
    tokens = list(range(23))
    request = Request("r", tokens, block_size=B, hash_seed="seed-x", cache_salt="s")
    assert hasher.block_hashes(tokens, "s") == request.block_hashes


def test_round_robin_and_pow2():
    rr = RoundRobinPolicy()
    firsts = [rr.rank(["b", "a", "c"], {})[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    pow2 = PowerOfTwoPolicy(seed=0)
    counts = Counter(pow2.rank(["a", "b", "c"], {"a": 9, "b": 0, "c": 9})[0] for _ in range(300))
    # "b" wins whenever it is one of the two drawn (2/3 of draws); never loses a draw.
    assert 160 < counts["b"] < 240
    for ranked in (pow2.rank(["a", "b"], {"a": 1, "b": 0}) for _ in range(20)):
        assert ranked == ["b", "a"]


def test_make_policy_names():
    assert make_policy("pow2").name == "pow2"
    assert make_policy("round_robin").name == "round_robin"
    assert isinstance(make_policy("prefix"), PrefixAwarePolicy)
    with pytest.raises(ValueError, match="choose one of prefix, pow2, round_robin"):
        make_policy("random")
