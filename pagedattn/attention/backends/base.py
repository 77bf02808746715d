"""The attention backend interface and the by-name / by-device registry."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from pagedattn.attention import ops
from pagedattn.attention.layout import KVCacheLayout, allocate_kv_cache, kv_cache_shapes
from pagedattn.attention.metadata import AttentionMetadata

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate one layer's (key_cache, value_cache) in this backend's layout."""
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
    ) -> None:
        """Write key/value [T, num_kv_heads, head_size] into their slots (PAD_SLOT_ID skipped)."""
        ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

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
    ) -> torch.Tensor:
        """Attention of query [T, Hq, D] over the paged cache -> [T, Hq, D]."""


def default_backend_name(device: torch.device | str) -> str:
    """The backend used when none is named: 'cpu' on CPU, 'triton' on GPU.

    NOTE: 'flash_attn' is only used when named: upstream FA2 needs block sizes that are multiples
    of 256, while the engine defaults to 16.
    """
    return "cpu" if torch.device(device).type == "cpu" else "triton"


def get_attn_backend(name: str | None, device: torch.device | str = "cpu") -> AttentionBackend:
    """Return the backend called ``name`` (or the default for ``device`` when name is None)."""
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
    return getattr(module, class_name)()
