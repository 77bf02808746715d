"""What each KV cache group stores: full attention or a sliding window, and its block size."""

from __future__ import annotations

from dataclasses import dataclass


class KVCacheSpecError(ValueError):
    """A KV cache spec or group is invalid; the message names the value and what is allowed."""


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of the per-group cache specs: every group is paged in blocks of block_size tokens."""

    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise KVCacheSpecError(
                f"block_size={self.block_size!r} is invalid: use an integer in [1, 1024]"
            )


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Layers that attend to every previous token: a request keeps all of its blocks."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Layers that attend to the last `sliding_window` tokens (the query's own included)."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise KVCacheSpecError(
                f"sliding_window={self.sliding_window!r} is invalid: use a positive integer"
            )


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table per request (same attention type and window)."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not isinstance(self.spec, FullAttentionSpec | SlidingWindowSpec):
            raise KVCacheSpecError(
                f"spec={self.spec!r} is invalid: use FullAttentionSpec or SlidingWindowSpec"
            )
