"""A circuit breaker for a remote store: after a failure, skip the store for a back-off period."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pagedattn.kv_transfer.store import StoreUnavailableError

logger = logging.getLogger(__name__)


class CircuitBreaker:
    """Closed: calls go through. A failure opens it: calls fail fast until the back-off ends.

    The first failure of an outage is logged once as a warning; later failures of the same outage
    are only counted. The back-off doubles with each failed retry up to max_backoff_s, and the
    first success closes the breaker again (logged at info).
    """

    def __init__(
        self,
        name: str,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(
                f"backoff_s={backoff_s}, max_backoff_s={max_backoff_s}: "
                "use 0 < backoff_s <= max_backoff_s"
            )
        self.name = name
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until: float | None = None
        self._next_backoff_s = backoff_s
        # Calls that reached the store and failed.
        self.num_failures = 0
        # Calls refused without touching the store because the breaker was open.
        self.num_rejected = 0

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def before_call(self) -> None:
        """Raise StoreUnavailableError while the breaker is open and its back-off runs."""
        with self._lock:
            if self._open_until is not None and self._clock() < self._open_until:
                self.num_rejected += 1
                raise StoreUnavailableError(
                    f"kv store {self.name} is unavailable (retrying after a back-off)"
                )

    def record_success(self) -> None:
        with self._lock:
            if self._open_until is None:
                return
            self._open_until = None
            self._next_backoff_s = self.backoff_s
        logger.info("kv store %s is reachable again", self.name)

    def record_failure(self, error: BaseException) -> StoreUnavailableError:
        """Open the breaker and count; returns the error for the caller to raise."""
        with self._lock:
            first = self._open_until is None
            self.num_failures += 1
            backoff = self._next_backoff_s
            self._open_until = self._clock() + backoff
            self._next_backoff_s = min(backoff * 2, self.max_backoff_s)
        if first:
            logger.warning(
                "kv store %s failed (%s: %s); serving without it, retrying in %.1f s "
                "(further failures are counted, not logged)",
                self.name,
                type(error).__name__,
                error,
                backoff,
            )
        return StoreUnavailableError(f"kv store {self.name} failed: {error}")
