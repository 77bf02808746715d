"""Options of `pagedattn serve` for replicas (Ray Serve): declared in ServeConfig, checked here.

The flags themselves are ServeConfig's fields (entrypoints/serve_config.py); this module adds the
checks that need the engine's options too (LoRA, tensor parallelism, KV scales and events).
"""

from __future__ import annotations

import argparse

from pagedattn.config import ConfigError, EngineConfig
from pagedattn.entrypoints.serve_config import ServeConfig


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """--data-parallel-size, --ray-address, --router and their tuning (ServeConfig's replica
    options), for a parser without the server's options.

    `--kv-events-endpoint` is an engine option (CacheConfig.kv_events_endpoint); with replicas,
    replica i publishes on its port + i, with a replay socket (--kv-events-replay-endpoint).
    """
    ServeConfig.add_cli_args(parser, replicas_only=True)


def uses_replicas(args: argparse.Namespace) -> bool:
    """True when `pagedattn serve` should run the Ray Serve application."""
    return ServeConfig.from_cli(args).uses_replicas


def validate_distributed_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the bad option (parsed flags: ServeConfig's and the engine's)."""
    engine = {
        name: getattr(args, name)
        for name in (
            "enable_lora",
            "tensor_parallel_size",
            "calculate_kv_scales",
            "kv_cache_dtype",
            "kv_events_endpoint",
        )
        if hasattr(args, name)
    }
    check_replica_layout(ServeConfig.from_cli(args), EngineConfig.from_kwargs(**engine))


def check_replica_layout(serve_config: ServeConfig, engine_config: EngineConfig) -> None:
    """Refuse engine options the replica layout cannot honour (ConfigError names them)."""
    pd = serve_config.num_pd_replicas > 0
    cache = engine_config.cache
    if (pd or serve_config.data_parallel_size > 1) and (
        engine_config.lora.enable_lora or serve_config.lora_modules
    ):
        raise ConfigError(
            "LoRA adapters (--enable-lora, --lora-modules) are served by one process: Ray Serve "
            "replicas do not load them; drop --data-parallel-size/--prefill-replicas/"
            "--decode-replicas, or the LoRA options"
        )
    if pd and engine_config.tensor_parallel_size > 1:
        raise ConfigError(
            "--tensor-parallel-size > 1 with --prefill-replicas/--decode-replicas is not "
            "supported: a transfer would carry rank 0's shard only; use one of the two"
        )
    if pd and cache.calculate_kv_scales:
        raise ConfigError(
            "--calculate-kv-scales with --prefill-replicas/--decode-replicas is not supported: "
            "each replica computes its own fp8 scales, and pulled blocks would be read with the "
            "decode replica's; drop --calculate-kv-scales (fixed scales)"
        )
    if pd and cache.kv_cache_dtype == "u8":
        raise ConfigError(
            "--kv-cache-dtype u8 with --prefill-replicas/--decode-replicas is not supported yet: "
            "the block transfer is untested with u8 blocks; use fp8 or the model's dtype"
        )
    endpoint = cache.kv_events_endpoint
    if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(
            f"--kv-events-endpoint={endpoint!r} is invalid: use tcp://HOST:PORT or ipc://PATH"
        )
    if pd and endpoint is not None:
        raise ConfigError(
            f"--kv-events-endpoint={endpoint!r} does not apply with --prefill-replicas/"
            "--decode-replicas (the prefill/decode replicas publish no KV events outside (the "
            "prefix router has its own)): drop it"
        )
