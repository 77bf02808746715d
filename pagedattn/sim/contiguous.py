"""Baseline KV allocators: contiguous reservations in a first-fit arena, and page-granular pools.

A policy answers one question per request per step: can the request hold ``num_tokens`` KV
tokens now? Contiguous policies reserve the whole range at admission (later calls are free);
page-granular policies (paging modelled outside the real manager, and vAttention-style virtual
memory) grow on demand.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod

from pagedattn.sim.traces import TraceRequest


class SimAllocationError(RuntimeError):
    """A policy was asked for an impossible allocation (a bug in the simulator, not a full pool)."""


class FirstFitArena:
    """A linear slot space; allocation takes the lowest-addressed hole that fits."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._starts: list[int] = [0]  # holes, sorted by start, never adjacent
        self._sizes: list[int] = [capacity]

    @property
    def holes(self) -> list[tuple[int, int]]:
        """(start, size) of every free range, by address."""
        return list(zip(self._starts, self._sizes, strict=True))

    @property
    def num_free(self) -> int:
        return sum(self._sizes)

    def allocate(self, size: int) -> int | None:
        """The start of a new range of ``size`` slots, or None when no hole fits."""
        for i, hole in enumerate(self._sizes):
            if hole >= size:
                start = self._starts[i]
                if hole == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        """Return a range, merging it with its neighbours."""
        i = bisect.bisect_left(self._starts, start)
        overlaps_next = i < len(self._starts) and self._starts[i] < start + size
        overlaps_prev = i > 0 and self._starts[i - 1] + self._sizes[i - 1] > start
        if overlaps_next or overlaps_prev:
            raise SimAllocationError(f"double free of [{start}, {start + size})")
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:
            i -= 1
            self._sizes[i] += size
        else:
            self._starts.insert(i, start)
            self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)


class MemoryPolicy(ABC):
    """How a baseline system lays out KV memory."""

    name: str
    capacity_slots: int

    @abstractmethod
    def allocate(self, req: TraceRequest, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` KV tokens of ``req``; False when the pool cannot."""

    @abstractmethod
    def free(self, request_id: str) -> None: ...

    @abstractmethod
    def allocated_slots(self, request_id: str) -> int: ...

    @abstractmethod
    def total_allocated(self) -> int: ...

    @abstractmethod
    def stranded_free_slots(self, waiting_head: TraceRequest) -> int:
        """Free slots unusable by ``waiting_head`` because they are not contiguous enough."""


class ContiguousPolicy(MemoryPolicy):
    """One contiguous range per request, sized at admission by ``mode``.

    ``max``: max_seq_len (FasterTransformer/Orca "max"); ``max_tokens``: prompt + max_tokens;
    ``exact``: the final KV length, as if an oracle knew the output length (Orca "oracle").
    """

    MODES = ("max", "max_tokens", "exact")

    def __init__(self, mode: str, capacity_slots: int, max_seq_len: int) -> None:
        if mode not in self.MODES:
            raise ValueError(f"unknown contiguous mode {mode!r}: use one of {self.MODES}")
        self.name = f"contiguous-{mode}"
        self.mode = mode
        self.capacity_slots = capacity_slots
        self.max_seq_len = max_seq_len
        self.arena = FirstFitArena(capacity_slots)
        self._ranges: dict[str, tuple[int, int]] = {}

    def reservation(self, req: TraceRequest) -> int:
        if self.mode == "max":
            return self.max_seq_len
        if self.mode == "max_tokens":
            return req.prompt_len + req.max_tokens
        return req.final_kv_len

    def allocate(self, req: TraceRequest, num_tokens: int) -> bool:
        if req.request_id not in self._ranges:
            size = self.reservation(req)
            start = self.arena.allocate(size)
            if start is None:
                return False
            self._ranges[req.request_id] = (start, size)
        size = self._ranges[req.request_id][1]
        if num_tokens > size:
            raise SimAllocationError(
                f"{req.request_id} needs {num_tokens} slots but reserved {size}: "
                "the trace's lengths exceed the reservation policy's bound"
            )
        return True

    def free(self, request_id: str) -> None:
        self.arena.free(*self._ranges.pop(request_id))

    def allocated_slots(self, request_id: str) -> int:
        return self._ranges[request_id][1]

    def total_allocated(self) -> int:
        return self.capacity_slots - self.arena.num_free

    def stranded_free_slots(self, waiting_head: TraceRequest) -> int:
        need = self.reservation(waiting_head)
        return sum(size for _, size in self.arena.holes if size < need)


class PagePolicy(MemoryPolicy):
    """Fixed-size pages of ``page_tokens`` slots, mapped on demand, never contiguous.

    With small pages this models PagedAttention's block pool; with 2 MB pages it models
    vAttention (contiguous virtual ranges, physical pages mapped as the sequence grows).
    """

    def __init__(self, name: str, capacity_slots: int, page_tokens: int) -> None:
        if page_tokens < 1:
            raise ValueError(f"page_tokens={page_tokens} must be >= 1")
        self.name = name
        self.page_tokens = page_tokens
        self.num_pages = capacity_slots // page_tokens
        self.capacity_slots = self.num_pages * page_tokens
        self._pages: dict[str, int] = {}
        self._num_used = 0

    def allocate(self, req: TraceRequest, num_tokens: int) -> bool:
        have = self._pages.get(req.request_id, 0)
        need = -(-num_tokens // self.page_tokens) - have
        if need > self.num_pages - self._num_used:
            return False
        if need > 0:
            self._pages[req.request_id] = have + need
            self._num_used += need
        else:
            self._pages.setdefault(req.request_id, have)
        return True

    def free(self, request_id: str) -> None:
        self._num_used -= self._pages.pop(request_id)

    def allocated_slots(self, request_id: str) -> int:
        return self._pages[request_id] * self.page_tokens

    def total_allocated(self) -> int:
        return self._num_used * self.page_tokens

    def stranded_free_slots(self, waiting_head: TraceRequest) -> int:
        return 0
