"""make_store: the --kv-store URL forms and their error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedattn.kv_transfer.file_store import FileKVStore
from pagedattn.kv_transfer.store import StoreURLError, make_store, parse_size


def test_file_url_with_a_size_cap(tmp_path: Path) -> None:
    store = make_store(f"file://{tmp_path}/kv?max_bytes=512M")
    assert isinstance(store, FileKVStore)
    assert store.root == tmp_path / "kv" and store.max_bytes == 512 << 20
    assert make_store(f"file://{tmp_path}").max_bytes is None


def test_redis_url_parses_host_port_db() -> None:
    pytest.importorskip("redis")
    store = make_store("redis://127.0.0.1:6390/2")  # connects lazily: no server needed here
    assert store.url == "redis://127.0.0.1:6390/2"
    store.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://bucket/kv", "scheme 's3'"),
        ("/tmp/kv", "scheme ''"),
        ("file://relative/dir", "three slashes"),
        ("file:///tmp/kv?max_bytes=lots", "size 'lots'"),
        ("file:///tmp/kv?maxbytes=1G", "unknown option"),
        ("redis://127.0.0.1:notaport", "invalid port"),
        ("redis://:6379", "no host"),
        ("redis://127.0.0.1:6379/zero", "database 'zero'"),
        ("redis://127.0.0.1:6379/0?ttl=5", "takes no options"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(StoreURLError, match=message):
        make_store(url)


def test_parse_size_units() -> None:
    assert parse_size("1024") == 1024
    assert parse_size("4k") == 4096
    assert parse_size("10G") == 10 << 30
    assert parse_size("2GiB") == 2 << 30
