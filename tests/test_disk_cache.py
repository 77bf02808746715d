"""disk_cache.update_json: concurrent writers of different keys keep each other's entries."""

from __future__ import annotations

import multiprocessing as mp

from pagedattn import disk_cache


def _write_keys(path: str, prefix: str, count: int) -> None:
    from pathlib import Path

    for i in range(count):
        disk_cache.update_json(Path(path), f"{prefix}{i}", i)


def test_update_json_from_two_processes_loses_no_key(tmp_path):
    path = tmp_path / "plans.json"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_write_keys, args=(str(path), p, 150)) for p in "ab"]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    data = disk_cache.read_json(path)
    assert sorted(data) == sorted(f"{p}{i}" for p in "ab" for i in range(150))
