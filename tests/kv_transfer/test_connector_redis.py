"""KVConnector over a real redis-server: one process's blocks served to another; outages."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedattn.attention.layout import KVCacheLayout
from pagedattn.kv_transfer.connector import KVConnector
from pagedattn.kv_transfer.redis_store import RedisKVStore
from pagedattn.kv_transfer.store import make_store
from tests.kv_transfer.caches import BLOCK_SIZE, assert_blocks_equal, hashes, make_caches
from tests.kv_transfer.conftest import RedisServer, start_redis_server

pytest.importorskip("redis")
REPO = Path(__file__).resolve().parents[2]


def connector(store) -> KVConnector:
    return KVConnector(store, "tiny-model", KVCacheLayout.FLASH, torch.float32, BLOCK_SIZE)


def test_blocks_saved_by_another_process_load_bitwise(redis_server: RedisServer) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.kv_transfer.save_blocks_proc", redis_server.url, "7",
         "2,4,6,8", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "queued=4 saved=4 failed=0" in result.stdout
    conn = connector(make_store(redis_server.url))
    block_hashes = hashes(5)  # one block more than the other process saved
    assert conn.get_num_new_matched_tokens(block_hashes, 0) == 4 * BLOCK_SIZE
    dst = make_caches(seed=None)
    assert conn.load_blocks(dst, [1, 3, 5, 7, 9], block_hashes) == 4
    assert_blocks_equal(make_caches(seed=7), [2, 4, 6, 8], dst, [1, 3, 5, 7])
    assert not dst[0][0][9].any()
    assert conn.stats.num_load_failures == 1 and conn.stats.num_corrupt_entries == 0
    conn.close()


def test_store_killed_mid_run_recomputes_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    server = start_redis_server()
    try:
        store = RedisKVStore("127.0.0.1", server.port, backoff_s=0.2, max_backoff_s=0.2)
        conn = connector(store)
        caches, block_hashes = make_caches(seed=8), hashes(6)
        conn.save_blocks(caches, [0, 1, 2], block_hashes[:3])
        conn.flush()
        assert conn.get_num_new_matched_tokens(block_hashes, 0) == 3 * BLOCK_SIZE
        server.stop()
        caplog.set_level(logging.WARNING, logger="pagedattn.kv_transfer")
        dst = make_caches(seed=None)
        for _ in range(5):
            assert conn.get_num_new_matched_tokens(block_hashes, 0) == 0
            assert conn.load_blocks(dst, [0, 1, 2], block_hashes[:3]) == 0
            conn.save_blocks(caches, [3, 4, 5], block_hashes[3:])
            conn.flush()
        assert not any(k.any() or v.any() for k, v in dst)
        stats = conn.stats
        assert stats.num_store_errors >= 15 and stats.num_failed_saves == 15
        assert stats.num_saved_blocks == 3 and stats.num_miss_tokens >= 5 * 6 * BLOCK_SIZE
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
        conn.close()
    finally:
        server.stop()
