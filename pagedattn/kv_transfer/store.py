"""The KV store interface (a byte-valued key-value store), its errors, and make_store(url)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit


class StoreUnavailableError(RuntimeError):
    """The store could not be reached or failed; callers recompute instead of loading."""


class StoreURLError(ValueError):
    """A --kv-store URL is malformed or names an unknown scheme."""


class KVStore(ABC):
    """Bytes by string key; thread-safe; every I/O failure raises StoreUnavailableError."""

    # Short name for logs and metrics ("file", "redis").
    name: str = "store"

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value stored under key, or None if there is none."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None:
        """Store value under key (replacing any value there)."""

    @abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a value, in one round trip where the backend allows."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Drop the value under key if there is one (a corrupted entry, say)."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """get() of each key; backends override it with one round trip."""
        return [self.get(key) for key in keys]

    def get_many_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int | None]:
        """Copy each key's value into the start of its buffer; each value's length (None if
        missing). A value longer than its buffer is not copied (its length tells the caller).

        Backends that can read straight into the buffers (files: readinto) override this.
        """
        lengths: list[int | None] = []
        for value, out in zip(self.get_many(keys), outs, strict=True):
            if value is not None and len(value) <= len(out):
                memoryview(out).cast("B")[: len(value)] = value
            lengths.append(None if value is None else len(value))
        return lengths

    def num_prefix_hits(self, keys: Sequence[str]) -> int:
        """How many of keys, from the first, are present without a gap."""
        num_hits = 0
        for present in self.exists_many(keys):
            if not present:
                break
            num_hits += 1
        return num_hits

    def close(self) -> None:
        """Release connections or files (nothing to release by default)."""
        return None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '1048576', '512M', '10G' or '10GiB' (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise StoreURLError(f"size {text!r} is invalid: use bytes or a K/M/G/T suffix, e.g. 10G")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def make_store(url: str) -> KVStore:
    """A store from a URL: file:///abs/dir[?max_bytes=10G] or redis://host:port[/db]."""
    parts = urlsplit(url)
    options = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise StoreURLError(
                f"kv store URL {url!r} is invalid: use file:///absolute/dir (three slashes)"
            )
        unknown = set(options) - {"max_bytes"}
        if unknown:
            raise StoreURLError(
                f"kv store URL {url!r} has unknown option(s) {sorted(unknown)}: only max_bytes"
            )
        max_bytes = parse_size(options["max_bytes"]) if "max_bytes" in options else None
        from pagedattn.kv_transfer.file_store import FileKVStore

        return FileKVStore(parts.path, max_bytes=max_bytes)
    if parts.scheme in ("redis", "valkey"):
        try:
            port = parts.port or 6379
        except ValueError:
            raise StoreURLError(f"kv store URL {url!r} has an invalid port") from None
        if not parts.hostname:
            raise StoreURLError(f"kv store URL {url!r} has no host: use redis://host:port[/db]")
        db_text = parts.path.strip("/") or "0"
        if not db_text.isdigit():
            raise StoreURLError(f"kv store URL {url!r} names database {db_text!r}: use a number")
        if options:
            raise StoreURLError(f"kv store URL {url!r} takes no options, got {sorted(options)}")
        from pagedattn.kv_transfer.redis_store import RedisKVStore

        return RedisKVStore(parts.hostname, port, db=int(db_text), password=parts.password)
    raise StoreURLError(
        f"kv store URL {url!r} has scheme {parts.scheme!r}: use file:///dir or redis://host:port"
    )
