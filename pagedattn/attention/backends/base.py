"""The attention backend interface and the by-name / by-device registry."""

from __future__ import annotations

import importlib
import mmap
from abc import ABC, abstractmethod

import torch

from pagedattn.attention import ops
from pagedattn.attention.layout import (
    KVCacheLayout,
    allocate_kv_cache,
    check_cache_dtype,
    kv_cache_shapes,
)
from pagedattn.attention.metadata import AttentionMetadata

# CPU caches at least this large are mapped lazily (see lazy_zeros); smaller ones use torch.zeros.
LAZY_ZEROS_MIN_BYTES = 1 << 20
HUGE_PAGE_MIN_BYTES = 4 << 20  # mappings this large ask for transparent huge pages
PAGE_BYTES = 4096  # the smallest page the OS maps


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, *, prefault: bool = False
) -> torch.Tensor:
    """A zero CPU tensor on fresh anonymous pages, which the OS maps (and zeroes) on first touch;
    with ``prefault``, every page is touched here instead (--kv-cache-prefault).

    ``torch.zeros`` writes every byte up front (seconds for a GiB-sized KV pool, all of it
    resident); here a block costs memory only once written. Where the OS allows, the mapping
    asks for transparent huge pages: a decode step reads K/V blocks scattered over the pool, and
    with 4 KiB pages nearly every block misses the TLB (SmolLM2's attention over 30 layers of
    bf16 K/V took ~8% less time on 2 MiB pages, on the AMX Xeon). Memory is then committed in
    2 MiB steps as blocks are first written.
    """
    num_bytes = max(1, dtype.itemsize * int(torch.Size(shape).numel()))
    # NOTE: private, not mmap's default shared mapping: shared anonymous memory is shmem, which
    # this kernel never backs with huge pages. The tensor keeps the mapping alive.
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if num_bytes >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # NOTE: a kernel without transparent huge pages: 4 KiB pages
            pass
    if prefault:
        # NOTE: a write (a read maps the shared zero page): one byte per 4 KiB page commits and
        # zeroes each page, or each 2 MiB huge page on its first byte.
        torch.frombuffer(buffer, dtype=torch.uint8)[::PAGE_BYTES] = 0
    return torch.frombuffer(buffer, dtype=dtype, count=num_bytes // dtype.itemsize).view(shape)


# name -> (module, class); imported lazily so that a CPU install never imports triton.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("pagedattn.attention.backends.torch_ref", "TorchRefBackend"),
    "cpu": ("pagedattn.attention.backends.cpu", "CpuBackend"),
    "triton": ("pagedattn.attention.backends.triton", "TritonBackend"),
    "flash_attn": ("pagedattn.attention.backends.flash_attn", "FlashAttnBackend"),
}


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention by walking block tables."""

    name: str = "base"
    layout: KVCacheLayout = KVCacheLayout.FLASH

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of each of key_cache and value_cache (flash layout: the two are equal)."""
        if self.layout is not KVCacheLayout.FLASH:
            raise NotImplementedError(
                f"backend {self.name!r} uses the {self.layout.value} layout whose key and value "
                "shapes differ: call allocate_kv_cache instead"
            )
        return (num_blocks, block_size, num_kv_heads, head_size)

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        prefault: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate one layer's zeroed (key_cache, value_cache) in this backend's layout (a large
        CPU cache on lazily mapped pages, all touched now with ``prefault``)."""
        key_shape, value_shape = self.kv_cache_shapes(
            num_blocks, block_size, num_kv_heads, head_size, dtype
        )
        num_bytes = dtype.itemsize * torch.Size(key_shape).numel()
        if torch.device(device).type == "cpu" and num_bytes >= LAZY_ZEROS_MIN_BYTES:
            check_cache_dtype(dtype, device)
            return (
                lazy_zeros(key_shape, dtype, prefault=prefault),
                lazy_zeros(value_shape, dtype, prefault=prefault),
            )
        return allocate_kv_cache(
            self.layout, num_blocks, block_size, num_kv_heads, head_size, dtype, device
        )

    def kv_cache_shapes(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of (key_cache, value_cache) in this backend's layout."""
        return kv_cache_shapes(self.layout, num_blocks, block_size, num_kv_heads, head_size, dtype)

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write key/value [T, num_kv_heads, head_size] into their slots (PAD_SLOT_ID skipped);
        an fp8 cache stores key / k_scale and value / v_scale."""
        ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Attention of query [T, Hq, D] over the paged cache -> [T, Hq, D]; an fp8 cache's
        keys and values are read as stored * k_scale and * v_scale."""


def default_backend_name(device: torch.device | str) -> str:
    """The backend used when none is named: 'cpu' on CPU, 'triton' on GPU.

    NOTE: 'flash_attn' is only used when named: upstream FA2 needs block sizes that are multiples
    of 256, while the engine defaults to 16.
    """
    return "cpu" if torch.device(device).type == "cpu" else "triton"


def get_attn_backend(
    name: str | None, device: torch.device | str = "cpu", **options
) -> AttentionBackend:
    """Return the backend called ``name`` (or the default for ``device`` when name is None);
    ``options`` go to the cpu backend (its decode kernel and step ops, from the KernelPlan)."""
    name = default_backend_name(device) if name is None else name
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: use one of {sorted(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RuntimeError(
            f"attention backend {name!r} is not available ({exc}); use 'cpu' or 'torch' on CPU"
        ) from exc
    backend_cls = getattr(module, class_name)
    return backend_cls(**options) if name == "cpu" else backend_cls()
