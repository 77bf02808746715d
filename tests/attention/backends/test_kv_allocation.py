"""CPU KV caches start as zeros on lazily mapped pages: no memory is touched until written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedattn.attention.backends.base import get_attn_backend, lazy_zeros


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_lazy_zeros_are_zeros_and_writable():
    x = lazy_zeros((3, 5, 7), torch.bfloat16)
    assert x.shape == (3, 5, 7) and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert torch.count_nonzero(x) == 0
    x[1, 2] = 4.0
    assert x.sum().item() == 28.0


def test_large_cpu_cache_costs_no_memory_until_written():
    backend = get_attn_backend("torch", "cpu")
    before = _rss_kib()
    # 2 x 256 MiB: torch.zeros would make all of it resident at once.
    key, value = backend.allocate_kv_cache(4096, 16, 8, 128, torch.float32, "cpu")
    assert _rss_kib() - before < 64 * 1024
    assert key.shape == (4096, 16, 8, 128) and value.shape == key.shape
    assert key.data_ptr() != value.data_ptr()
    key[7].fill_(1.0)  # one block: 64 KiB
    assert key[7].sum().item() == 16 * 8 * 128 and torch.count_nonzero(key[8]) == 0
    assert _rss_kib() - before < 64 * 1024


def test_a_prefaulted_cache_is_resident_from_the_start():
    backend = get_attn_backend("torch", "cpu")
    before = _rss_kib()
    # 2 x 32 MiB, every page written at allocation (--kv-cache-prefault), still all zeros.
    key, value = backend.allocate_kv_cache(512, 16, 8, 128, torch.float32, "cpu", prefault=True)
    assert _rss_kib() - before >= 60 * 1024
    assert torch.count_nonzero(key) == 0 and torch.count_nonzero(value) == 0
    # An odd size: the last, partial page is touched too.
    x = lazy_zeros((4097 * 1024 + 3,), torch.uint8, prefault=True)
    assert torch.count_nonzero(x) == 0 and x.numel() == 4097 * 1024 + 3


def test_small_caches_keep_torch_zeros():
    backend = get_attn_backend("torch", "cpu")
    key, value = backend.allocate_kv_cache(4, 4, 2, 16, torch.float32, "cpu")
    assert torch.count_nonzero(key) == 0 and torch.count_nonzero(value) == 0


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this kernel")
def test_large_cpu_cache_sits_on_huge_pages_once_written():
    # NOTE: decode attention reads blocks scattered over the pool; 4 KiB pages miss the TLB.
    x = lazy_zeros((64, 1024, 1024), torch.uint8)  # 64 MiB
    x.fill_(1)
    assert _anon_huge_kib(x.data_ptr()) >= 32 * 1024
    small = lazy_zeros((1024, 1024), torch.uint8)  # 1 MiB: below the threshold, 4 KiB pages
    small.fill_(1)
    assert _anon_huge_kib(small.data_ptr()) == 0
