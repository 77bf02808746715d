"""File store: atomic files, LRU eviction by a size cap, state rebuilt from the directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pagedattn.kv_transfer.file_store import FileKVStore
from pagedattn.kv_transfer.store import StoreUnavailableError


def entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*") if p.is_file())


def test_put_get_exists_delete(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path)
    assert store.get("a") is None
    store.put("a", b"alpha")
    store.put("b", b"beta")
    assert store.get("a") == b"alpha"
    assert store.exists_many(["a", "x", "b"]) == [True, False, True]
    assert store.num_prefix_hits(["a", "b", "x", "a"]) == 2
    store.put("a", b"alpha2")
    assert store.get("a") == b"alpha2"
    store.delete("a")
    store.delete("never-stored")
    assert store.get("a") is None
    assert store.total_bytes == len(b"beta")
    # One file per key, no temp files left behind, key text not used as a file name.
    files = entry_files(tmp_path)
    assert len(files) == 1 and files[0].suffix == ".kv"


def test_lru_eviction_keeps_total_under_the_cap(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path, max_bytes=300)
    for key in "abc":
        store.put(key, key.encode() * 100)
        time.sleep(0.01)
    assert store.get("a") is not None  # a becomes the most recently used
    store.put("d", b"d" * 100)
    assert store.exists_many(list("abcd")) == [True, False, True, True]
    assert store.total_bytes == 300 and store.num_evicted == 1
    assert len(entry_files(tmp_path)) == 3
    store.put("big", b"x" * 301)  # larger than the whole cap: not stored, nothing evicted
    assert store.get("big") is None and len(store) == 3


def test_restart_rebuilds_index_and_lru_order(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path)
    for key in "abcd":
        store.put(key, key.encode() * 100)
        time.sleep(0.01)
    store.get("a")
    store.close()
    # A fresh process with a smaller cap: the scan evicts the least recently used (b, then c).
    restarted = FileKVStore(tmp_path, max_bytes=250)
    assert restarted.total_bytes == 200 and len(restarted) == 2
    assert restarted.exists_many(list("abcd")) == [True, False, False, True]
    assert restarted.get("d") == b"d" * 100


def test_scan_removes_stale_temp_files_only(tmp_path: Path) -> None:
    FileKVStore(tmp_path).put("a", b"alpha")
    subdir = entry_files(tmp_path)[0].parent
    stale, fresh = subdir / "x.kv.tmp.1.2", subdir / "y.kv.tmp.3.4"
    stale.write_bytes(b"half a val")
    fresh.write_bytes(b"being written")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    store = FileKVStore(tmp_path)
    assert not stale.exists() and fresh.exists()
    assert len(store) == 1 and store.total_bytes == len(b"alpha")


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    writer, reader = FileKVStore(tmp_path), FileKVStore(tmp_path, max_bytes=1000)
    writer.put("k", b"v" * 10)
    assert reader.exists_many(["k"]) == [True]
    assert reader.total_bytes == 10  # indexed once seen, so its cap counts it
    assert reader.get("k") == b"v" * 10
    writer.delete("k")
    assert reader.get("k") is None and reader.total_bytes == 0


def test_io_errors_become_store_unavailable_and_open_the_breaker(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path)
    stem = store._stem("k")
    (tmp_path / stem[:2]).write_bytes(b"a file where the key's directory should be")
    with pytest.raises(StoreUnavailableError):
        store.put("k", b"value")
    assert store.breaker.is_open and store.breaker.num_failures == 1
    with pytest.raises(StoreUnavailableError):
        store.get("other")  # refused during the back-off without touching the disk
    assert store.breaker.num_rejected == 1 and store.breaker.num_failures == 1


def test_get_many_into_reads_into_the_buffers(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path)
    store.put("four", b"abcd")
    store.put("long", b"0123456789")
    outs = [bytearray(6) for _ in range(3)]
    assert store.get_many_into(["four", "missing", "long"], [memoryview(o) for o in outs]) == [
        4,
        None,
        10,
    ]
    assert outs[0] == b"abcd\0\0"
    assert outs[2] == bytearray(6)  # too long for its buffer: not copied, its length reported
