"""The tensor-parallel group's collectives on 2 local ranks: gloo and the shared-memory path."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle

import pytest
import torch

from pagedattn.distributed.parallel_state import TensorParallelGroup
from pagedattn.distributed.shm_all_reduce import new_shm_path
from pagedattn.worker.tp_executor import free_port

# Rows of the all-reduces: a slot of 8 MiB holds 52428 rows of 40 floats (60000: two chunks);
# 5 and 9 rows also go as bfloat16.
SUM_CASES = ((1, torch.float32), (7, torch.float32), (60000, torch.float32), (5, torch.bfloat16),
             (9, torch.bfloat16))  # fmt: skip


def _rank_data(rank: int, rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, 40, generator=torch.Generator().manual_seed(rank)).to(dtype)


def _collectives(rank: int, port: int, kind: str, shm_path: str | None, queue) -> None:
    torch.set_num_threads(1)
    group = TensorParallelGroup(rank, 2, port, timeout_s=30, shm_path=shm_path)
    if kind == "shm_python":
        group.shm._ext = None  # the Python steps of the same protocol
    elif kind == "shm":
        assert group.shm._ext is not None, "the compiled collectives did not load"
    sums = [group.all_reduce(_rank_data(rank, rows, dtype)) for rows, dtype in SUM_CASES]
    gathered = group.gather_first(torch.full((2, 3), float(rank)))
    # 30 rows of 100000 floats (12 MB): two chunks of rows.
    wide = torch.arange(30 * 100_000, dtype=torch.float32).reshape(30, 100_000) + rank
    wide_gathered = group.gather_first(wide)
    wide_ok = rank != 0 or torch.equal(wide_gathered, torch.cat([wide - rank, wide - rank + 1], 1))
    result = (rank, sums, gathered, group.min_int(10 - rank), group.all_reduce_kind, wide_ok)
    # NOTE: plain pickle: a queue would share the tensors through fds the exiting peer closes.
    queue.put(pickle.dumps(result))
    group.close()


@pytest.mark.parametrize("kind", ["gloo", "shm", "shm_python"])
def test_all_reduce_gather_and_min_across_two_processes(kind):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    path = str(new_shm_path()) if kind != "gloo" else None
    peer = ctx.Process(target=_collectives, args=(1, port, kind, path, queue))
    peer.start()
    _collectives(0, port, kind, path, queue)
    results = dict((r[0], r[1:]) for r in (pickle.loads(queue.get(timeout=60)) for _ in range(2)))
    peer.join(timeout=30)
    for rank, (sums, gathered, minimum, used, wide_ok) in results.items():
        assert used == kind.removesuffix("_python") and minimum == 9 and wide_ok
        for total, (rows, dtype) in zip(sums, SUM_CASES, strict=True):
            expected = _rank_data(0, rows, dtype) + _rank_data(1, rows, dtype)
            assert total.dtype == dtype and torch.equal(total, expected)
        if rank == 0:
            assert gathered.tolist() == [[0.0] * 3 + [1.0] * 3] * 2
    # NOTE: both ranks sum in rank order: the same bits on every rank.
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0], strict=True))
    if path is not None:
        assert not os.path.exists(path)  # unlinked once both ranks mapped it
