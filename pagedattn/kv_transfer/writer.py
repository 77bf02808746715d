"""The background writer: encodes copied-out blocks and puts them in the store, off the step."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedattn.kv_transfer.codec import BlockFormat, encode_block
from pagedattn.kv_transfer.store import KVStore

logger = logging.getLogger(__name__)


@dataclass
class SaveJob:
    """Blocks copied out of the cache, layer-major: block j's payload is k[:, j] then v[:, j]."""

    fmt: BlockFormat
    keys: list[str]
    k: np.ndarray  # uint8 [num_layers, num_blocks, key bytes of one layer's block]
    v: np.ndarray  # uint8 [num_layers, num_blocks, value bytes of one layer's block]


class BlockWriter:
    """One thread draining a queue bounded in bytes: a job that does not fit is not admitted.

    count(**deltas) receives num_saved_blocks, num_failed_saves, bytes_written and write_time_s;
    on_stored(keys) the keys now in the store; on_error(error) each failed put.
    """

    def __init__(
        self,
        store: KVStore,
        max_pending_bytes: int,
        count: Callable[..., None],
        on_stored: Callable[[list[str]], None],
        on_error: Callable[[Exception], None],
    ) -> None:
        if max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes={max_pending_bytes} is invalid: use >= 0")
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self._count = count
        self._on_stored = on_stored
        self._on_error = on_error
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kv-store-writer", daemon=True)
        self._thread.start()
        self.closed = False

    def reserve(self, num_blocks: int, value_bytes: int) -> int:
        """Admit up to num_blocks blocks of value_bytes each; returns how many fit the bound."""
        with self._lock:
            room = (self.max_pending_bytes - self._pending_bytes) // value_bytes
            num_admitted = max(0, min(num_blocks, room))
            self._pending_bytes += num_admitted * value_bytes
        return num_admitted

    def submit(self, job: SaveJob) -> None:
        """Queue a job whose blocks reserve() admitted."""
        if self.closed:
            raise RuntimeError("the KV store writer is closed")
        self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception:  # NOTE: the writer must outlive any one bad job.
                logger.exception("kv store writer failed on a batch; its blocks are not stored")
            finally:
                self._queue.task_done()

    def _write(self, job: SaveJob) -> None:
        start = time.perf_counter()
        num_saved = num_bytes = 0
        num_layers = job.fmt.num_layers
        try:
            for j, key in enumerate(job.keys):
                parts = [job.k[i, j] for i in range(num_layers)]
                parts += [job.v[i, j] for i in range(num_layers)]
                value = encode_block(job.fmt, key, *parts)
                self.store.put(key, value)
                self._on_stored([key])
                num_saved += 1
                num_bytes += len(value)
        except Exception as error:  # NOTE: a failed put drops the rest of the job, never raises.
            self._on_error(error)
        finally:
            with self._lock:
                self._pending_bytes -= len(job.keys) * job.fmt.value_bytes
            self._count(
                num_saved_blocks=num_saved,
                num_failed_saves=len(job.keys) - num_saved,
                bytes_written=num_bytes,
                write_time_s=time.perf_counter() - start,
            )

    def flush(self) -> None:
        """Wait until every queued job has been written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self.closed:
            return
        self.closed = True
        self._queue.put(None)
        self._thread.join()
