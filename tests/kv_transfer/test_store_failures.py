"""The KV store never hangs or poisons the step (issue 21 H2, L5, L8): FIFOs and hung reads,
hits counted only when blocks load, and a Redis key of another type treated as corrupt."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from pagedattn.kv_transfer.connector import KVConnector
from pagedattn.kv_transfer.file_store import FileKVStore
from pagedattn.kv_transfer.store import KVStore
from tests.kv_transfer.caches import BLOCK_SIZE, hashes, make_caches


def connector(store: KVStore, **kw) -> KVConnector:
    return KVConnector(
        store, "tiny-model", "flash", make_caches(None)[0][0].dtype, BLOCK_SIZE, **kw
    )


def _in_thread(fn, timeout_s: float = 10.0):
    """fn() on a daemon thread; fails the test (instead of hanging it) if fn blocks."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "the store blocked"
    return result[0]


def _entry_path(store: FileKVStore, conn: KVConnector, block_hash: bytes) -> Path:
    return store._path(store._stem(conn.key_space.key(block_hash)))


def test_a_fifo_under_an_entry_name_is_a_corrupt_entry_not_a_hang(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path)
    conn = connector(store)
    src, block_hashes = make_caches(seed=1), hashes(3)
    conn.save_blocks(src, [0, 1, 2], block_hashes)
    conn.flush()
    fifo = _entry_path(store, conn, block_hashes[1])
    fifo.unlink()
    os.mkfifo(fifo)  # a reader's open() of a FIFO blocks until a writer comes
    assert _in_thread(lambda: store.get(conn.key_space.key(block_hashes[1]))) == b""
    fresh = connector(FileKVStore(tmp_path))
    assert fresh.get_num_new_matched_tokens(block_hashes, 0) == 3 * BLOCK_SIZE
    dst = make_caches(seed=None)
    assert _in_thread(lambda: fresh.load_blocks(dst, [5, 6, 7], block_hashes)) == 1
    stats = fresh.stats
    assert stats.num_corrupt_entries == 1 and stats.num_store_errors == 0
    assert not fifo.exists() and not fresh.store.breaker.is_open
    conn.close()
    fresh.close()


class HangingStore(KVStore):
    """Every read blocks until `release` is set (a stuck network mount)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_reads = 0

    def get(self, key: str) -> bytes | None:
        self.num_reads += 1
        self.release.wait()
        return None

    def put(self, key: str, value: bytes) -> None:
        return None

    def exists_many(self, keys) -> list[bool]:
        return [True] * len(keys)

    def delete(self, key: str) -> None:
        return None


def test_a_hung_read_is_given_up_at_the_deadline_and_the_store_skipped_until_it_returns():
    store = HangingStore()
    conn = connector(store, load_timeout_s=0.2)
    block_hashes = hashes(3)
    assert conn.get_num_new_matched_tokens(block_hashes, 0) == 3 * BLOCK_SIZE
    start = time.monotonic()
    assert conn.load_blocks(make_caches(seed=None), [0, 1, 2], block_hashes) == 0
    assert time.monotonic() - start < 2.0
    stats = conn.stats
    assert stats.num_load_timeouts == 1 and stats.num_failed_load_blocks == 3
    assert stats.num_hit_tokens == 0
    # While the read hangs the store is not asked: no lookup hit, no load, no waiting.
    num_reads = store.num_reads
    assert conn.get_num_new_matched_tokens(block_hashes, 0) == 0
    assert conn.load_blocks(make_caches(seed=None), [0], block_hashes[:1]) == 0
    assert store.num_reads == num_reads and conn.stats.num_load_timeouts == 1
    store.release.set()
    deadline = time.monotonic() + 5
    while conn._stalled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conn.get_num_new_matched_tokens(block_hashes, 0) == 3 * BLOCK_SIZE
    conn.close()


def test_hits_count_only_blocks_that_loaded(tmp_path: Path) -> None:
    # A store that lists every key but holds nothing valid: 0% hits, not 100%.
    store = FileKVStore(tmp_path)
    conn = connector(store)
    block_hashes = hashes(4)
    for h in block_hashes:
        store.put(conn.key_space.key(h), b"not a block")
    assert conn.get_num_new_matched_tokens(block_hashes, 0) == 4 * BLOCK_SIZE
    assert conn.load_blocks(make_caches(seed=None), [0, 1, 2, 3], block_hashes) == 0
    stats = conn.stats
    assert stats.num_hit_tokens == 0 and stats.hit_rate == 0.0
    assert stats.num_miss_tokens == 4 * BLOCK_SIZE and stats.num_failed_load_blocks == 4
    assert stats.num_corrupt_entries == 1 and stats.num_load_failures == 1
    conn.close()


def test_a_redis_key_of_another_type_is_deleted_as_corrupt(redis_server) -> None:
    pytest.importorskip("redis")
    import redis

    from pagedattn.kv_transfer.redis_store import RedisKVStore

    store = RedisKVStore("127.0.0.1", redis_server.port)
    conn = connector(store)
    src, block_hashes = make_caches(seed=2), hashes(3)
    conn.save_blocks(src, [0, 1, 2], block_hashes)
    conn.flush()
    key = conn.key_space.key(block_hashes[1])
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.delete(key)
    client.hset(key, "field", "value")  # someone else's hash under a block's key
    assert store.get(key) == b""
    assert conn.load_blocks(make_caches(seed=None), [4, 5, 6], block_hashes) == 1
    stats = conn.stats
    assert stats.num_corrupt_entries == 1 and stats.num_store_errors == 0
    assert not store.breaker.is_open and not client.exists(key)
    # Other requests keep using the store.
    assert conn.get_num_new_matched_tokens(block_hashes[:1], 0) == BLOCK_SIZE
    client.close()
    conn.close()
