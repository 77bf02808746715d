"""How big the paged KV cache is: its dtype and its number of blocks, from config and memory."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedattn.attention.fp8 import FP8_DTYPES, is_fp8
from pagedattn.attention.layout import bytes_per_block
from pagedattn.attention.u8 import U8_NAMES, is_u8
from pagedattn.config import ConfigError

if TYPE_CHECKING:
    from pagedattn.config import CacheConfig, SchedulerConfig

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    **FP8_DTYPES,
    **dict.fromkeys(U8_NAMES, torch.uint8),
}
# Backends that read an fp8 cache (flash_attn does not).
FP8_BACKENDS = ("cpu", "torch", "triton")
# Backends that read a u8 cache (the Triton and flash_attn kernels do not, yet).
U8_BACKENDS = ("cpu", "torch")
# The default pool (no num_blocks, kv_cache_memory or fraction) takes this share of free memory,
# at most DEFAULT_MAX_KV_CACHE_BYTES, or enough for MIN_FULL_LENGTH_SEQS sequences of
# max_model_len where that is more.
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.2
DEFAULT_MAX_KV_CACHE_BYTES = 1 << 30
MIN_FULL_LENGTH_SEQS = 2


class KVCachePlan(NamedTuple):
    """The pool the runner allocates: blocks, their dtype and their cost."""

    num_blocks: int
    dtype: torch.dtype
    bytes_per_block: int  # K and V of one block id across all layers

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def free_memory_bytes(device: torch.device) -> int:
    """Memory the cache could take now: free GPU memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    # MemAvailable counts reclaimable page cache; SC_AVPHYS_PAGES (free pages) does not, and
    # after a large file read it can be a small fraction of what the cache could really use.
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_dtype(cache: CacheConfig, model_dtype: torch.dtype, backend_name: str) -> torch.dtype:
    """The cache's dtype: the model's, bfloat16 beside a float32 model on the cpu backend, or
    fp8 (e4m3 / e5m2) or u8 (torch.uint8) on a backend that reads it."""
    if cache.kv_cache_dtype == "auto":
        return model_dtype
    dtype = DTYPES[cache.kv_cache_dtype]
    if is_u8(dtype):
        if backend_name not in U8_BACKENDS:
            raise ConfigError(
                f"kv_cache_dtype={cache.kv_cache_dtype} needs an attention backend that reads "
                f"the u8 cache ({', '.join(U8_BACKENDS)}), not {backend_name}: the Triton and "
                "flash_attn kernels do not dequantize it; use fp8 on GPU"
            )
        return dtype
    if is_fp8(dtype):
        if backend_name not in FP8_BACKENDS:
            raise ConfigError(
                f"kv_cache_dtype={cache.kv_cache_dtype} needs an attention backend that reads "
                f"fp8 ({', '.join(FP8_BACKENDS)}), not {backend_name}"
            )
        return dtype
    if dtype != model_dtype and backend_name != "cpu":
        raise ConfigError(
            f"kv_cache_dtype={cache.kv_cache_dtype} differs from the model's dtype "
            f"{model_dtype}: only the cpu attention backend supports that, not {backend_name}"
        )
    return dtype


def plan_kv_cache(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    model: torch.nn.Module,
    model_dtype: torch.dtype,
    backend_name: str,
    device: torch.device,
    max_model_len: int,
) -> KVCachePlan:
    """Blocks: explicit num_blocks, else a byte budget, else a share of free memory.

    The share is capped at what max_num_seqs full-length sequences could ever hold; the default
    share (no fraction given) also at DEFAULT_MAX_KV_CACHE_BYTES (or MIN_FULL_LENGTH_SEQS
    full-length sequences, where more).
    """
    dtype = kv_cache_dtype(cache, model_dtype, backend_name)
    per_block = bytes_per_block(
        model.num_layers, cache.block_size, model.num_kv_heads, model.head_size, dtype
    )
    if cache.num_blocks is not None:
        return KVCachePlan(cache.num_blocks, dtype, per_block)
    if cache.kv_cache_memory is not None:
        num_blocks = cache.kv_cache_memory // per_block
        if num_blocks < 2:
            raise ConfigError(
                f"kv_cache_memory={cache.kv_cache_memory} bytes holds {num_blocks} blocks of "
                f"{per_block} bytes: give the KV cache at least {2 * per_block} bytes"
            )
        return KVCachePlan(num_blocks, dtype, per_block)
    per_seq = -(-max_model_len // cache.block_size)  # blocks of one full-length sequence
    fraction = cache.kv_cache_memory_fraction
    if fraction is None:
        # NOTE: a small model's pool would otherwise be gigabytes (a share of a large host).
        cap = max(DEFAULT_MAX_KV_CACHE_BYTES, MIN_FULL_LENGTH_SEQS * per_seq * per_block)
        budget = min(int(free_memory_bytes(device) * DEFAULT_KV_CACHE_MEMORY_FRACTION), cap)
    else:
        budget = int(free_memory_bytes(device) * fraction)
    num_blocks = min(budget // per_block, scheduler.max_num_seqs * per_seq + 1)
    return KVCachePlan(max(2, num_blocks), dtype, per_block)
