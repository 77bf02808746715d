"""Redis store against a real redis-server on loopback: round trips, eviction, outages."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from pagedattn.kv_transfer.redis_store import RedisKVStore
from pagedattn.kv_transfer.store import StoreUnavailableError, make_store
from tests.kv_transfer.conftest import RedisServer, start_redis_server

pytest.importorskip("redis")


def test_round_trip_and_pipelined_queries(redis_server: RedisServer) -> None:
    store = make_store(redis_server.url)
    assert isinstance(store, RedisKVStore) and store.ping()
    assert store.get("missing") is None
    big = os.urandom(1 << 20)
    store.put("big", big)
    assert store.get("big") == big
    keys = [f"k{i}" for i in range(40)]  # more than one pipelined batch
    for key in keys[::2]:
        store.put(key, key.encode())
    assert store.exists_many(keys) == [i % 2 == 0 for i in range(40)]
    assert store.get_many(keys) == [k.encode() if i % 2 == 0 else None for i, k in enumerate(keys)]
    assert store.num_prefix_hits(["k0", "k2", "k1", "k4"]) == 2
    store.delete("k0")
    assert store.exists_many(["k0", "k2"]) == [False, True]
    store.close()


def test_server_maxmemory_policy_evicts_instead_of_failing() -> None:
    server = start_redis_server("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    try:
        store = RedisKVStore("127.0.0.1", server.port)
        for i in range(12):
            store.put(f"block{i}", bytes([i]) * (512 << 10))
        present = store.exists_many([f"block{i}" for i in range(12)])
        assert present[-1] and not all(present)
        assert store.breaker.num_failures == 0
        store.close()
    finally:
        server.stop()


def test_server_killed_mid_test_fails_fast_logs_once_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = start_redis_server()
    store = RedisKVStore("127.0.0.1", server.port, backoff_s=0.3, max_backoff_s=0.3)
    try:
        store.put("a", b"1")
        server.stop()
        caplog.set_level(logging.INFO, logger="pagedattn.kv_transfer")
        errors = 0
        start = time.monotonic()
        for _ in range(50):
            try:
                store.exists_many(["a"])
            except StoreUnavailableError:
                errors += 1
        assert errors == 50
        assert time.monotonic() - start < 2.0  # one failed connect, then fast refusals
        assert store.breaker.num_failures == 1 and store.breaker.num_rejected == 49
        time.sleep(0.35)
        with pytest.raises(StoreUnavailableError):
            store.get("a")  # the retry after the back-off fails too: counted, not logged
        assert store.breaker.num_failures == 2
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "serving without it" in warnings[0].getMessage()
        # A server back on the same port: after the back-off the store works again.
        restarted = start_redis_server(port=server.port)
        try:
            time.sleep(0.65)
            store.put("b", b"2")
            assert store.get("b") == b"2" and not store.breaker.is_open
            assert any("reachable again" in r.getMessage() for r in caplog.records)
        finally:
            restarted.stop()
    finally:
        server.stop()
        store.close()


def test_a_stalled_server_costs_one_timeout(redis_server: RedisServer) -> None:
    store = RedisKVStore("127.0.0.1", redis_server.port, socket_timeout_s=0.3, backoff_s=5.0)
    store.put("a", b"1")
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            store.get("a")
        first = time.monotonic() - start
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            store.get("a")
        second = time.monotonic() - start
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    assert 0.25 < first < 1.5, first
    assert second < 0.05, second
    store.close()


def test_get_many_into_copies_values_into_the_buffers(redis_server: RedisServer) -> None:
    import numpy as np

    store = RedisKVStore("127.0.0.1", redis_server.port)
    store.put("four", b"abcd")
    store.put("long", b"0123456789")
    rows = np.zeros((3, 6), dtype=np.uint8)
    assert store.get_many_into(["four", "missing", "long"], [rows[0], rows[1], rows[2]]) == [
        4,
        None,
        10,
    ]
    assert rows[0].tobytes() == b"abcd\0\0" and not rows[1:].any()
    store.close()
