"""Circuit breaker: fail fast during the back-off, doubling back-off, one warning per outage."""

from __future__ import annotations

import logging

import pytest

from pagedattn.kv_transfer.circuit_breaker import CircuitBreaker
from pagedattn.kv_transfer.store import StoreUnavailableError


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_the_cap_and_success_resets_it(caplog) -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("test", backoff_s=1.0, max_backoff_s=3.0, clock=clock)
    caplog.set_level(logging.INFO, logger="pagedattn.kv_transfer")
    breaker.before_call()  # closed: passes
    for expected_backoff in (1.0, 2.0, 3.0, 3.0):
        error = breaker.record_failure(ConnectionError("refused"))
        assert isinstance(error, StoreUnavailableError) and "refused" in str(error)
        clock.now += expected_backoff - 0.01
        with pytest.raises(StoreUnavailableError):
            breaker.before_call()
        clock.now += 0.02
        breaker.before_call()  # the back-off is over: one retry goes through
    assert breaker.num_failures == 4 and breaker.num_rejected == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "retrying in 1.0 s" in warnings[0].getMessage()
    breaker.record_success()
    assert not breaker.is_open
    assert [r.levelno for r in caplog.records].count(logging.INFO) == 1
    breaker.record_failure(TimeoutError("slow"))  # a new outage: warned again, back-off reset
    clock.now += 1.01
    breaker.before_call()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_invalid_backoff_is_rejected() -> None:
    with pytest.raises(ValueError, match="backoff_s"):
        CircuitBreaker("x", backoff_s=0)
    with pytest.raises(ValueError, match="backoff_s"):
        CircuitBreaker("x", backoff_s=2, max_backoff_s=1)
