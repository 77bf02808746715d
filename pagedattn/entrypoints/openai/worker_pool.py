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

    async def run(
        self, fn: Callable[..., Any], *args: Any, queue_timeout_s: float | None = None
    ) -> Any:
        """`fn(*args)` on a worker thread; cancelling the caller drops a job not yet started.

        queue_timeout_s: a job no worker has picked up by then is dropped (TimeoutError); one
        that started runs to its end (the job bounds its own run time)."""
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
            future = self._executor.submit(self._job, fn, args)
            waiter = asyncio.wrap_future(future)
            if queue_timeout_s is None:
                return await waiter
            try:
                return await asyncio.wait_for(asyncio.shield(waiter), queue_timeout_s)
            except asyncio.CancelledError:
                future.cancel()  # NOTE: the shield kept it from the caller's cancellation
                raise
            except TimeoutError:
                # NOTE: cancel() fails once a worker runs the job: then wait for its end.
                if future.cancel():
                    raise
                return await waiter
        finally:
            with self._lock:
                self.num_pending -= 1
