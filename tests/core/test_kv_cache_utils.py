"""KVCacheBlock, FreeKVCacheBlockQueue, block hashing, slot mapping and Request hashes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedattn.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVCacheError,
    NoFreeBlocksError,
    block_extra_keys,
    hash_block_tokens,
    hash_request_tokens,
    init_root_hash,
)
from pagedattn.core.request import Request, RequestStatus


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_popleft_append_remove_order():
    blocks, queue = make_queue(5)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    queue.remove(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 4]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 4, 2, 0]
    assert queue.num_free_blocks == 5
    assert ids(queue.popleft_n(3)) == [1, 3, 4]
    assert ids(queue.get_all_free_blocks()) == [2, 0]
    queue.remove(blocks[0])  # the tail
    queue.remove(blocks[2])  # the last one
    assert queue.num_free_blocks == 0 and queue.get_all_free_blocks() == []
    queue.append(blocks[4])
    queue.append(blocks[1])
    assert ids(queue.get_all_free_blocks()) == [4, 1]


def test_free_queue_misuse_raises():
    blocks, queue = make_queue(2)
    with pytest.raises(KVCacheError, match="already in the free queue"):
        queue.append(blocks[0])
    queue.popleft()
    with pytest.raises(KVCacheError, match="not in the free queue"):
        queue.remove(blocks[0])
    with pytest.raises(NoFreeBlocksError):
        queue.popleft_n(2)
    assert queue.num_free_blocks == 1


def test_hash_is_128_bit_chained_and_deterministic():
    root = init_root_hash("seed")
    h1 = hash_block_tokens(root, [1, 2, 3, 4])
    assert isinstance(h1, bytes) and len(h1) == 16
    assert hash_block_tokens(root, [1, 2, 3, 4]) == h1
    assert hash_block_tokens(init_root_hash("other"), [1, 2, 3, 4]) != h1
    assert hash_block_tokens(root, [1, 2, 3, 5]) != h1
    # Same block content after a different parent: a different hash.
    h2a = hash_block_tokens(h1, [5, 6, 7, 8])
    h2b = hash_block_tokens(hash_block_tokens(root, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert h2a != h2b
    assert hash_request_tokens(4, [1, 2, 3, 4, 5, 6, 7, 8, 9], "seed") == [h1, h2a]


def test_hash_same_in_another_process():
    code = (
        "from pagedattn.core.kv_cache_utils import hash_request_tokens as h;"
        "print(h(4, list(range(12)), 's', lora_id='a', cache_salt='t')[-1].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert (
        out == hash_request_tokens(4, list(range(12)), "s", lora_id="a", cache_salt="t")[-1].hex()
    )


def test_extra_keys_salt_first_block_lora_every_block_mm_only_overlapping():
    mm = [(5, 4, "img")]  # tokens 5..8
    assert block_extra_keys(0, 4, None, mm, "salt") == (("salt", "salt"),)
    assert block_extra_keys(4, 8, "lora", mm, "salt") == (("lora", "lora"), ("mm", "img", 5))
    assert block_extra_keys(8, 12, None, mm, "salt") == (("mm", "img", 5),)
    assert block_extra_keys(12, 16, None, mm, "salt") is None


def test_salt_lora_and_mm_change_hashes_as_scoped():
    tokens = list(range(12))
    plain = hash_request_tokens(4, tokens, "s")
    salted = hash_request_tokens(4, tokens, "s", cache_salt="tenant")
    # The salt enters block 0 only, but the chain carries it to every later block.
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert hash_request_tokens(4, tokens, "s", cache_salt="other")[0] != salted[0]
    lora = hash_request_tokens(4, tokens, "s", lora_id="a")
    assert all(a != b for a, b in zip(plain, lora, strict=True))
    with_mm = hash_request_tokens(4, tokens, "s", mm_hashes=[(9, 2, "img")])
    assert with_mm[:2] == plain[:2] and with_mm[2] != plain[2]


def test_request_hashes_incrementally_and_matches_full_hash():
    req = Request("r", list(range(10)), block_size=4, cache_salt="x", lora_id="l")
    assert len(req.block_hashes) == 2
    first_two = list(req.block_hashes)
    req.append_output_token_ids(10)
    assert req.block_hashes == first_two  # block 2 holds 3/4 tokens: not hashed
    req.append_output_token_ids(11)
    req.append_output_token_ids([12, 13, 14, 15, 16])
    assert req.block_hashes[:2] == first_two and len(req.block_hashes) == 4
    full = hash_request_tokens(4, list(range(17)), "pagedattn", lora_id="l", cache_salt="x")
    assert req.block_hashes == full
    assert req.num_tokens == 17 and req.num_output_tokens == 7 and req.num_prompt_tokens == 10


def test_request_without_block_size_keeps_no_hashes_and_validates_input():
    req = Request("r", [1] * 40)
    req.append_output_token_ids([2] * 40)
    assert req.block_hashes == []
    with pytest.raises(ValueError, match="empty"):
        Request("r", [])
    with pytest.raises(ValueError, match=">= 0"):
        Request("r", [1, -1])
    with pytest.raises(ValueError, match="mm_hashes"):
        Request("r", [1, 2], mm_hashes=[(0, "h")])


def test_request_clone_shares_nothing_mutable_and_status():
    req = Request("p", [1, 2, 3, 4, 5], block_size=2)
    req.num_computed_tokens = 5
    child = req.fork("c")
    child.append_output_token_ids(6)
    assert child.request_id == "c" and child.num_computed_tokens == 5
    assert req.num_tokens == 5 and len(req.block_hashes) == 2 and len(child.block_hashes) == 3
    assert not req.is_finished()
    req.status = RequestStatus.FINISHED_ABORTED
    assert req.is_finished() and not RequestStatus.is_finished(RequestStatus.PREEMPTED)
