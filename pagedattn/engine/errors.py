"""Errors the engine raises for bad input; entrypoints turn them into user-facing messages."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request cannot be served as given (empty or over-long prompt, bad parameters)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineFaultError(RuntimeError):
    """The engine itself failed (not one request): no step can run; restart the process."""
