"""WorkerPool: a small named thread pool that bounds its queue and reports a stuck job."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedattn.entrypoints.openai.protocol import APIError


class WorkerPool:
    """Runs blocking jobs off the event loop; knows how long its oldest running job has run.

    A job whose caller is cancelled before a worker picks it up never runs (the executor future
    is cancelled with the awaiting task). With `max_queued`, a job arriving while that many wait
    is refused with a 503 instead of joining an unbounded queue.
    """

    def __init__(self, name: str, num_workers: int, max_queued: int | None = None) -> None:
        self.name = name
        self.max_queued = max_queued
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._running: dict[int, float] = {}
        self.num_pending = 0

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def oldest_running_s(self) -> float:
        """Seconds the longest-running job has run so far (0.0 when idle)."""
        with self._lock:
            started = min(self._running.values(), default=None)
        return 0.0 if started is None else time.monotonic() - started

    def _job(self, fn: Callable[..., Any], args: tuple) -> Any:
        job_id = next(self._ids)
        with self._lock:
            self._running[job_id] = time.monotonic()
        try:
            return fn(*args)
        finally:
            with self._lock:
                del self._running[job_id]

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a worker thread; cancelling the caller drops a job not yet started."""
        with self._lock:
            num_waiting = self.num_pending - len(self._running)
            if self.max_queued is not None and num_waiting >= self.max_queued:
                raise APIError(
                    f"the server's {self.name} workers are busy ({num_waiting} jobs waiting): "
                    "retry shortly",
                    status_code=503,
                    err_type="server_error",
                    code="server_busy",
                )
            self.num_pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, self._job, fn, args)
        finally:
            with self._lock:
                self.num_pending -= 1
