"""KVConnector on real paged caches: bitwise round trips, prefix matching, tenants, corruption."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from pagedattn.attention.layout import KVCacheLayout
from pagedattn.kv_transfer.connector import KVConnector
from pagedattn.kv_transfer.file_store import FileKVStore
from pagedattn.kv_transfer.store import KVStore
from tests.kv_transfer.caches import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_blocks_equal,
    hashes,
    make_caches,
)


def connector(store: KVStore, layout=KVCacheLayout.FLASH, dtype=torch.float32, **kw):
    return KVConnector(store, "tiny-model", layout, dtype, BLOCK_SIZE, **kw)


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [
        (KVCacheLayout.FLASH, torch.float32),
        (KVCacheLayout.FLASH, torch.bfloat16),
        (KVCacheLayout.CLASSIC, torch.float32),
    ],
)
def test_save_then_load_into_other_blocks_is_bitwise(tmp_path: Path, layout, dtype) -> None:
    src = make_caches(seed=0, layout=layout, dtype=dtype)
    conn = connector(FileKVStore(tmp_path), layout, dtype)
    block_hashes = hashes(3)
    assert conn.save_blocks(src, [3, 5, 7], block_hashes) == 3
    conn.flush()
    dst = make_caches(seed=None, layout=layout, dtype=dtype)
    # A fresh connector (a restarted process) over the same directory.
    fresh = connector(FileKVStore(tmp_path), layout, dtype)
    assert fresh.get_num_new_matched_tokens(block_hashes, 0) == 3 * BLOCK_SIZE
    assert fresh.load_blocks(dst, [10, 11, 12], block_hashes) == 3
    assert_blocks_equal(src, [3, 5, 7], dst, [10, 11, 12])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (10, 11, 12)]
    assert all(not k[untouched].any() and not v[untouched].any() for k, v in dst)
    stats = conn.stats
    assert stats.num_saved_blocks == 3 and stats.bytes_written > 0 and stats.num_skipped_saves == 0
    assert fresh.stats.num_loaded_blocks == 3 and fresh.stats.bytes_read == stats.bytes_written
    conn.close()
    fresh.close()


def test_matched_tokens_count_contiguous_blocks_after_the_local_hit(tmp_path: Path) -> None:
    conn = connector(FileKVStore(tmp_path))
    caches = make_caches(seed=1)
    block_hashes = hashes(5)
    conn.save_blocks(caches, [1, 2, 3, 5], [block_hashes[i] for i in (0, 1, 2, 4)])
    conn.flush()
    assert conn.get_num_new_matched_tokens(block_hashes, 0) == 3 * BLOCK_SIZE
    assert conn.get_num_new_matched_tokens(block_hashes, 2 * BLOCK_SIZE) == BLOCK_SIZE
    assert conn.get_num_new_matched_tokens(block_hashes, 3 * BLOCK_SIZE) == 0  # block 3 missing
    assert conn.get_num_new_matched_tokens(block_hashes, 5 * BLOCK_SIZE) == 0
    assert conn.get_num_new_matched_tokens(block_hashes, BLOCK_SIZE + 1) == 0  # not aligned
    stats = conn.stats
    # Hits count once the blocks load, not on the lookup's word.
    assert stats.num_hit_tokens == 0
    assert stats.num_miss_tokens == (2 + 2 + 2) * BLOCK_SIZE
    assert conn.load_blocks(make_caches(seed=None), [0, 1, 2], block_hashes[:3]) == 3
    assert conn.stats.num_hit_tokens == 3 * BLOCK_SIZE
    high_bar = connector(FileKVStore(tmp_path), min_hit_tokens=4 * BLOCK_SIZE)
    assert high_bar.get_num_new_matched_tokens(block_hashes, 0) == 0
    conn.close()
    high_bar.close()


def test_tenants_with_different_salts_never_load_each_others_blocks(tmp_path: Path) -> None:
    tenant_a, tenant_b = hashes(4, salt="tenant-a"), hashes(4, salt="tenant-b")
    assert not set(tenant_a) & set(tenant_b) and not set(tenant_a) & set(hashes(4))
    conn = connector(FileKVStore(tmp_path))
    conn.save_blocks(make_caches(seed=2), [0, 1, 2, 3], tenant_a)
    conn.flush()
    dst = make_caches(seed=None)
    assert conn.get_num_new_matched_tokens(tenant_b, 0) == 0
    assert conn.get_num_new_matched_tokens(hashes(4), 0) == 0
    assert conn.load_blocks(dst, [0, 1, 2, 3], tenant_b) == 0
    assert all(not k.any() and not v.any() for k, v in dst)
    assert conn.get_num_new_matched_tokens(tenant_a, 0) == 4 * BLOCK_SIZE
    conn.close()


def _entry_path(store: FileKVStore, conn: KVConnector, block_hash: bytes) -> Path:
    return store._path(store._stem(conn.key_space.key(block_hash)))


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_key"])
def test_a_damaged_entry_stops_the_load_and_is_replaced_later(tmp_path: Path, damage) -> None:
    store = FileKVStore(tmp_path)
    conn = connector(store)
    src = make_caches(seed=3)
    block_hashes = hashes(4)
    conn.save_blocks(src, [4, 5, 6, 7], block_hashes)
    conn.flush()
    path = _entry_path(store, conn, block_hashes[2])
    data = path.read_bytes()
    if damage == "flip":
        data = data[:200] + bytes([data[200] ^ 0x10]) + data[201:]
    elif damage == "truncate":
        data = data[:-5]
    else:  # a well-formed entry of another block under this block's key
        data = _entry_path(store, conn, block_hashes[3]).read_bytes()
    path.write_bytes(data)
    dst = make_caches(seed=None)
    assert conn.load_blocks(dst, [0, 1, 2, 3], block_hashes) == 2
    assert_blocks_equal(src, [4, 5], dst, [0, 1])
    assert not dst[0][0][2:4].any()  # nothing written past the bad entry
    stats = conn.stats
    assert stats.num_corrupt_entries == 1 and stats.num_load_failures == 1
    assert not path.exists()  # dropped, so the recomputed block can be saved again
    assert conn.get_num_new_matched_tokens(block_hashes, 0) == 2 * BLOCK_SIZE
    assert conn.save_blocks(src, [6], [block_hashes[2]]) == 1
    conn.flush()
    assert conn.load_blocks(dst, [0, 1, 2, 3], block_hashes) == 4
    assert_blocks_equal(src, [4, 5, 6, 7], dst, [0, 1, 2, 3])
    conn.close()


def test_a_group_connector_touches_only_its_layers(tmp_path: Path) -> None:
    src, dst = make_caches(seed=4), make_caches(seed=None)
    block_hashes = hashes(2)
    group1 = connector(FileKVStore(tmp_path), group_id=1, layer_indices=[0, 2])
    group1.save_blocks(src, [1, 2], block_hashes)
    group1.flush()
    group0 = connector(FileKVStore(tmp_path))
    assert group0.get_num_new_matched_tokens(block_hashes, 0) == 0
    assert group1.load_blocks(dst, [8, 9], block_hashes) == 2
    assert_blocks_equal([src[0], src[2]], [1, 2], [dst[0], dst[2]], [8, 9])
    assert not dst[1][0].any() and not dst[1][1].any()
    group0.close()
    group1.close()


def test_cache_that_does_not_match_the_config_is_rejected(tmp_path: Path) -> None:
    conn = connector(FileKVStore(tmp_path), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        conn.save_blocks(make_caches(seed=0), [0], hashes(1))
    other = KVConnector(FileKVStore(tmp_path), "m", KVCacheLayout.FLASH, torch.float32, 8)
    with pytest.raises(ValueError, match="block_size=8"):
        other.load_blocks(make_caches(seed=0), [0], hashes(1))
    with pytest.raises(ValueError, match="2 block ids but 1"):
        other.load_blocks(make_caches(seed=0), [0, 1], hashes(1))
    conn.close()
    other.close()


class SlowStore(FileKVStore):
    """A file store whose puts wait until the test releases them."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def put(self, key: str, value: bytes) -> None:
        self.release.wait(timeout=30)
        super().put(key, value)


def test_saves_never_wait_and_a_full_queue_skips_and_counts(tmp_path: Path) -> None:
    store = SlowStore(tmp_path)
    caches = make_caches(seed=5)
    probe = connector(FileKVStore(tmp_path / "probe"))
    value_bytes = probe.block_format(caches).value_bytes
    probe.close()
    conn = connector(store, max_pending_bytes=2 * value_bytes + 1)
    block_hashes = hashes(5)
    start = time.monotonic()
    assert conn.save_blocks(caches, [0, 1, 2], block_hashes[:3]) == 2
    assert conn.save_blocks(caches, [3, 4], block_hashes[3:]) == 0
    assert time.monotonic() - start < 5  # returned while the store was still blocked
    assert conn.stats.num_skipped_saves == 3 and conn.stats.num_saved_blocks == 0
    store.release.set()
    conn.flush()
    assert conn.stats.num_saved_blocks == 2
    # Room again; blocks already stored are not written twice.
    assert conn.save_blocks(caches, [0, 1, 2], block_hashes[:3]) == 1
    conn.close()
    assert conn.stats.num_saved_blocks == 3
    keys = [conn.key_space.key(h) for h in block_hashes[:4]]
    assert FileKVStore(tmp_path).exists_many(keys) == [True, True, True, False]


class BrokenStore(FileKVStore):
    """A store with a bug: every call raises something other than StoreUnavailableError."""

    def get(self, key: str) -> bytes | None:
        raise RuntimeError("bug in get")

    def get_many_into(self, keys, outs) -> list[int | None]:
        raise RuntimeError("bug in get_many_into")

    def put(self, key: str, value: bytes) -> None:
        raise RuntimeError("bug in put")

    def exists_many(self, keys) -> list[bool]:
        raise KeyError("bug in exists_many")


def test_a_store_bug_never_reaches_the_caller(tmp_path: Path, caplog) -> None:
    conn = connector(BrokenStore(tmp_path))
    caches, block_hashes = make_caches(seed=6), hashes(3)
    for _ in range(3):
        assert conn.get_num_new_matched_tokens(block_hashes, 0) == 0
        assert conn.load_blocks(caches, [0, 1, 2], block_hashes) == 0
        assert conn.save_blocks(caches, [0, 1, 2], block_hashes) == 3
        conn.flush()
    stats = conn.stats
    assert stats.num_store_errors == 9 and stats.num_failed_saves == 9
    assert stats.num_saved_blocks == 0
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "treated as unavailable" in errors[0].getMessage()
    conn.close()


def test_a_block_evicted_behind_the_connector_is_saved_again(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path)
    conn = connector(store)
    caches, block_hashes = make_caches(seed=7), hashes(2)
    assert conn.save_blocks(caches, [0, 1], block_hashes) == 2
    conn.flush()
    assert conn.save_blocks(caches, [0, 1], block_hashes) == 0  # known to be stored
    assert conn.get_num_new_matched_tokens(block_hashes, 0) == 2 * BLOCK_SIZE
    FileKVStore(tmp_path).delete(conn.key_space.key(block_hashes[1]))  # another process evicts
    assert conn.load_blocks(make_caches(seed=None), [2, 3], block_hashes) == 1
    assert conn.save_blocks(caches, [0, 1], block_hashes) == 1  # the recomputed block only
    conn.close()
    assert conn.get_num_new_matched_tokens(block_hashes, 0) == 2 * BLOCK_SIZE
