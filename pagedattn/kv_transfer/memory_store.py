"""In-memory KV stores for prefill/decode transfer: a bounded LRU dict, and a two-tier store."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from pagedattn.kv_transfer.store import KVStore

Buffer = bytes | bytearray | memoryview


class MemoryKVStore(KVStore):
    """Values in a dict, least recently used dropped past max_bytes; thread-safe.

    The prefill side's outbox holds the encoded blocks its steps computed until a decode replica
    pulls them; the decode side's inbox holds pulled blocks until its first step loads them
    (``pop_on_read``: a value read once is gone, so the inbox never keeps what the cache holds).
    """

    name = "memory"

    def __init__(self, max_bytes: int = 1 << 30, *, pop_on_read: bool = False) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes} is invalid: use a positive byte count")
        self.max_bytes = max_bytes
        self.pop_on_read = pop_on_read
        self._lock = threading.Lock()
        self._values: OrderedDict[str, Buffer] = OrderedDict()
        self.total_bytes = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._take(key)
        return None if value is None else bytes(value)

    def _take(self, key: str) -> Buffer | None:
        value = self._values.get(key)
        if value is None:
            return None
        if self.pop_on_read:
            del self._values[key]
            self.total_bytes -= len(value)
        else:
            self._values.move_to_end(key)
        return value

    def get_many_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int | None]:
        with self._lock:
            values = [self._take(key) for key in keys]
        lengths: list[int | None] = []
        for value, out in zip(values, outs, strict=True):
            if value is not None and len(value) <= len(out):
                memoryview(out).cast("B")[: len(value)] = value
            lengths.append(None if value is None else len(value))
        return lengths

    def put(self, key: str, value: Buffer) -> None:
        if len(value) > self.max_bytes:
            return  # NOTE: never fits: a miss later, as for an evicted value.
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self.total_bytes -= len(old)
            self._values[key] = value
            self.total_bytes += len(value)
            while self.total_bytes > self.max_bytes:
                _, dropped = self._values.popitem(last=False)
                self.total_bytes -= len(dropped)
                self.num_evicted += 1

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def delete(self, key: str) -> None:
        with self._lock:
            value = self._values.pop(key, None)
            if value is not None:
                self.total_bytes -= len(value)

    def discard(self, keys: Sequence[str]) -> None:
        """Drop keys (a transfer whose request went away before it loaded)."""
        for key in keys:
            self.delete(key)


class TieredKVStore(KVStore):
    """Reads the primary store first and the fallback (the shared file/Redis store) for misses.

    Writes go to both (a prefill replica's outbox and the shared store).
    """

    def __init__(self, primary: KVStore, fallback: KVStore) -> None:
        self.primary = primary
        self.fallback = fallback
        self.name = f"{primary.name}+{fallback.name}"

    def get(self, key: str) -> bytes | None:
        value = self.primary.get(key)
        return self.fallback.get(key) if value is None else value

    def get_many_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int | None]:
        lengths = self.primary.get_many_into(keys, outs)
        missing = [i for i, length in enumerate(lengths) if length is None]
        if missing:
            try:
                more = self.fallback.get_many_into(
                    [keys[i] for i in missing], [outs[i] for i in missing]
                )
            except Exception:  # NOTE: a fallback outage must not lose the primary's hits.
                return lengths
            for i, length in zip(missing, more, strict=True):
                lengths[i] = length
        return lengths

    def put(self, key: str, value: bytes) -> None:
        self.primary.put(key, value)
        try:
            self.fallback.put(key, value)
        except Exception:  # NOTE: the shared store is a fallback: its outage must not cost
            pass  # the primary the rest of the writer's batch (its breaker logs the outage)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        present = self.primary.exists_many(keys)
        missing = [i for i, here in enumerate(present) if not here]
        if missing:
            try:
                more = self.fallback.exists_many([keys[i] for i in missing])
            except Exception:  # NOTE: as in get_many_into
                return present
            for i, here in zip(missing, more, strict=True):
                present[i] = here
        return present

    def delete(self, key: str) -> None:
        self.primary.delete(key)
        self.fallback.delete(key)

    def close(self) -> None:
        self.primary.close()
        self.fallback.close()
