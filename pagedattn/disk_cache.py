"""Where pagedattn keeps what it measured or converted once (under ~/.cache/pagedattn)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path

from pagedattn import envs


def cache_root() -> Path:
    """$PAGEDATTN_CACHE_DIR, else $XDG_CACHE_HOME/pagedattn, else ~/.cache/pagedattn."""
    return envs.PAGEDATTN_CACHE_DIR


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; {} when it is missing or unreadable (a cache only)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_atomic(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` through a temporary file and a rename; False if it failed.

    Readers never see a half-written file; an unwritable cache only costs time later.
    """
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``path``'s lock file (no lock where it cannot be made)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(f".{path.name}.lock"), "a")  # noqa: SIM115
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def update_json(path: Path, key: str, value: object) -> bool:
    """Set ``key`` in the JSON object stored at ``path`` (read, change, write atomically).

    Read and write happen under a lock file, so processes that update different keys at once
    (tensor-parallel ranks, replicas) keep each other's entries."""
    with _locked(path):
        data = read_json(path)
        data[key] = value
        return write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())
