"""Waiting queues of the scheduler: first-come-first-served and priority order."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedattn.core.request import Request


class RequestQueue(ABC):
    """The waiting requests, in the order the scheduler admits them."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Add a newly arrived request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put back a preempted request so that it is admitted before newer arrivals."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit (the queue must not be empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request to admit."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove a request anywhere in the queue (aborts; O(n))."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue(RequestQueue):
    """Arrival order; preempted requests go to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest ``priority`` value first, then earliest arrival (vLLM convention)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        # NOTE: the counter breaks ties so that Request objects are never compared.
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def prepend(self, request: Request) -> None:
        # A preempted request keeps its (priority, arrival_time) rank, which puts it ahead of every
        # later arrival of the same priority.
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a scheduling policy ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}: use 'fcfs' or 'priority'")
