"""A KV store in a local directory: one file per key, atomic writes, LRU eviction by a size cap."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b
from pathlib import Path

from pagedattn.kv_transfer.circuit_breaker import CircuitBreaker
from pagedattn.kv_transfer.store import KVStore

_SUFFIX = ".kv"
_TMP_MARK = ".tmp."
# A temp file this old belongs to a writer that died (a live one renames it within a second).
_STALE_TMP_S = 600.0


class FileKVStore(KVStore):
    """Files under root/<2 hex>/<40 hex>.kv named by a hash of the key; survives restarts.

    Writes go to a temp file in the same directory and os.replace it into place, so a reader sees
    a whole value or none. With max_bytes the least recently used files are deleted once the
    total passes the cap; recency is the file's mtime (touched on every read), so the order
    survives a restart, when the directory is scanned. Several processes may share a directory;
    each one enforces the cap over the files it knows (its scan, its writes, what it has read).
    """

    name = "file"

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes} is invalid: use a positive byte count")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.breaker = CircuitBreaker(f"file://{self.root}", backoff_s=1.0, max_backoff_s=10.0)
        self._lock = threading.Lock()
        # file stem -> size in bytes, least recently used first.
        self._index: OrderedDict[str, int] = OrderedDict()
        self.total_bytes = 0
        self.num_evicted = 0
        self._scan()

    def _scan(self) -> None:
        """Index the files already there, oldest use first; remove temp files of dead writers."""
        entries = []
        now = time.time()
        for path in self.root.glob("??/*"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            if _TMP_MARK in path.name:
                if now - stat.st_mtime > _STALE_TMP_S:
                    path.unlink(missing_ok=True)
            elif path.suffix == _SUFFIX:
                entries.append((stat.st_mtime, path.stem, stat.st_size))
        for _, stem, size in sorted(entries):
            self._index[stem] = size
            self.total_bytes += size
        self._evict_over_cap()

    def _stem(self, key: str) -> str:
        return blake2b(key.encode(), digest_size=20).hexdigest()

    def _path(self, stem: str) -> Path:
        return self.root / stem[:2] / (stem + _SUFFIX)

    def _forget(self, stem: str) -> None:
        size = self._index.pop(stem, None)
        if size is not None:
            self.total_bytes -= size

    def _remember(self, stem: str, size: int) -> None:
        self._forget(stem)
        self._index[stem] = size
        self.total_bytes += size

    def _evict_over_cap(self) -> None:
        """Delete least recently used files until the total fits max_bytes (lock held)."""
        while self.max_bytes is not None and self.total_bytes > self.max_bytes and self._index:
            stem, size = self._index.popitem(last=False)
            self.total_bytes -= size
            # NOTE: a file that cannot be removed now is forgotten; the next scan finds it again.
            with contextlib.suppress(OSError):
                self._path(stem).unlink(missing_ok=True)
            self.num_evicted += 1

    def get(self, key: str) -> bytes | None:
        self.breaker.before_call()
        stem = self._stem(key)
        path = self._path(stem)
        try:
            with _open_regular(path) as f:
                value = f.read() if f is not None else b""
        except FileNotFoundError:
            with self._lock:
                self._forget(stem)
            return None
        except OSError as error:
            raise self.breaker.record_failure(error) from error
        self.breaker.record_success()
        _touch(path)
        with self._lock:
            self._remember(stem, len(value))
        return value

    def get_many_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int | None]:
        """Read each file straight into its buffer (no bytes object, no second copy)."""
        self.breaker.before_call()
        lengths: list[int | None] = []
        for key, out in zip(keys, outs, strict=True):
            stem = self._stem(key)
            path = self._path(stem)
            try:
                with _open_regular(path) as f:
                    if f is None:
                        size = length = 0
                    else:
                        size = os.fstat(f.fileno()).st_size
                        view = memoryview(out)[:size]
                        length = _read_into(f, view) if size <= len(out) else size
            except FileNotFoundError:
                with self._lock:
                    self._forget(stem)
                lengths.append(None)
                continue
            except OSError as error:
                raise self.breaker.record_failure(error) from error
            _touch(path)
            with self._lock:
                self._remember(stem, size)
            lengths.append(length)
        self.breaker.record_success()
        return lengths

    def put(self, key: str, value: bytes) -> None:
        if self.max_bytes is not None and len(value) > self.max_bytes:
            return
        self.breaker.before_call()
        stem = self._stem(key)
        path = self._path(stem)
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise self.breaker.record_failure(error) from error
        self.breaker.record_success()
        with self._lock:
            self._remember(stem, len(value))
            self._evict_over_cap()

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        self.breaker.before_call()
        out = []
        for key in keys:
            stem = self._stem(key)
            with self._lock:
                known = stem in self._index
            if not known:
                try:
                    size = self._path(stem).stat().st_size
                except FileNotFoundError:
                    out.append(False)
                    continue
                except OSError as error:
                    raise self.breaker.record_failure(error) from error
                # NOTE: another process wrote it; index it so the size cap accounts for it.
                with self._lock:
                    self._remember(stem, size)
                    self._evict_over_cap()
            out.append(True)
        return out

    def delete(self, key: str) -> None:
        stem = self._stem(key)
        with self._lock:
            self._forget(stem)
        path = self._path(stem)
        try:
            path.unlink(missing_ok=True)
        except IsADirectoryError:
            # NOTE: something else sits under the entry's name: remove it if it is empty, and
            # never count it against the store (the entry reads as empty, so it is recomputed).
            with contextlib.suppress(OSError):
                path.rmdir()
        except OSError as error:
            raise self.breaker.record_failure(error) from error

    def __len__(self) -> int:
        return len(self._index)


@contextlib.contextmanager
def _open_regular(path: Path):
    """The entry's file opened for reading, or None if the path is not a regular file.

    NOTE: O_NONBLOCK, so that opening a FIFO (or a device) left under an entry's name returns at
    once instead of blocking the engine's step; the caller reads a non-regular entry as an empty
    value, which fails verification, so the entry is deleted and its blocks recomputed.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        try:
            yield None
        finally:
            os.close(fd)
        return
    with os.fdopen(fd, "rb", buffering=0) as f:
        yield f


def _read_into(f, out: memoryview) -> int:
    """Fill out from f (a raw file may return short reads); the number of bytes read."""
    num_read = 0
    while num_read < len(out):
        n = f.readinto(out[num_read:])
        if not n:
            break
        num_read += n
    return num_read


def _touch(path: Path) -> None:
    """Mark a file used now (its mtime orders the LRU across restarts); gone already is fine."""
    with contextlib.suppress(OSError):
        os.utime(path)
