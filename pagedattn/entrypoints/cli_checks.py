"""What the `pagedattn` command checks before a model loads: each mistake is one CliError line.

A load takes seconds (minutes for a big model); a wrong option found after it wastes them and,
raised from deep inside, reads as a traceback. Everything here reads only small files, the
option values and the network, and names the option or file and what to pass instead.
"""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

from pagedattn.config import context_error

# How long `--ray-address` may take to accept a TCP connection before the head is called absent.
RAY_CONNECT_TIMEOUT_S = 5.0
_MAX_PORT = 65535


class CliError(ValueError):
    """The command line asks for something that cannot be done; the message says what to pass."""


@dataclass(frozen=True)
class CheckedModel:
    """What the checks learnt about --model: its context length and chat template."""

    name: str
    max_model_len: int | None
    has_chat_template: bool


def check_before_load(args: argparse.Namespace) -> CheckedModel | None:
    """Raise CliError (or ConfigError) for what can be checked before the model loads.

    The option checks come first (they need nothing on disk), then the model's files, then
    the options that depend on the model (--max-model-len) and the LoRA folders.
    """
    from pagedattn.config import EngineConfig

    device = getattr(args, "device", "cpu") or "cpu"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CliError(f"--device {device}: no CUDA GPU is available here; use --device cpu")
    kv_store = getattr(args, "kv_store", None)
    if kv_store:
        from pagedattn.kv_transfer.store import StoreURLError, make_store

        try:
            make_store(kv_store)
        except StoreURLError as exc:
            raise CliError(f"--kv-store: {exc}") from None
    EngineConfig.from_cli(args)  # NOTE: every engine option's range, as LLM(...) checks them
    check_lora_flags(args)
    if args.command == "serve":
        check_serve_args(args)
    checked = check_model(args)
    check_lora_folders(args)
    return checked


def check_model(args: argparse.Namespace) -> CheckedModel:
    """--model's files, and --max-model-len against the model's context length."""
    from pagedattn.model.preflight import CheckpointError, check_checkpoint

    try:
        facts = check_checkpoint(args.model)
    except CheckpointError as exc:
        raise CliError(str(exc)) from None
    wanted = getattr(args, "max_model_len", None)
    if wanted is not None and facts.max_model_len is not None and wanted > facts.max_model_len:
        raise CliError(context_error("--max-model-len", wanted, facts.name, facts.max_model_len))
    return CheckedModel(facts.name, facts.max_model_len, facts.has_chat_template)


def lora_module_pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """--lora-modules' NAME=PATH entries as (name, path); CliError names a malformed one."""
    pairs = []
    for spec in getattr(args, "lora_modules", None) or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CliError(f"--lora-modules {spec!r} is not NAME=PATH: e.g. sql=/models/sql-lora")
        pairs.append((name, path))
    return pairs


def check_lora_flags(args: argparse.Namespace) -> None:
    """--lora-modules needs --enable-lora; its entries are NAME=PATH."""
    pairs = lora_module_pairs(args)
    if pairs and not getattr(args, "enable_lora", False):
        raise CliError("--lora-modules needs --enable-lora: add --enable-lora")


def check_lora_folders(args: argparse.Namespace) -> None:
    """Each --lora-modules folder reads as a PEFT LoRA adapter (adapters are small)."""
    pairs = lora_module_pairs(args)
    if not pairs:
        return
    import torch

    from pagedattn.lora.adapter import load_adapter
    from pagedattn.lora.request import LoRAError

    for int_id, (name, path) in enumerate(pairs, start=1):
        try:
            load_adapter(name, int_id, path, args.max_lora_rank, torch.float32)
        except LoRAError as exc:
            raise CliError(
                f"--lora-modules {name}={path}: {exc} (a PEFT LoRA folder holds "
                "adapter_config.json and adapter_model.safetensors)"
            ) from None


def check_serve_args(args: argparse.Namespace) -> None:
    """Replica options, the `ray` extra, a Ray head that answers and a free port."""
    from pagedattn.serve.args import uses_replicas, validate_distributed_args

    try:
        validate_distributed_args(args)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not 0 <= args.port <= _MAX_PORT:
        raise CliError(f"--port {args.port} is invalid: use a TCP port in 1..{_MAX_PORT}")
    if uses_replicas(args):
        try:
            import ray  # noqa: F401
            from ray import serve  # noqa: F401
        except ImportError:
            raise CliError(
                "--data-parallel-size and --ray-address need Ray Serve: pip install "
                "'pagedattn[ray]' (or run one engine without them)"
            ) from None
        if args.ray_address is not None:
            check_ray_head(args.ray_address)
    with socket.socket() as sock:
        try:
            sock.bind((args.host, args.port))
        except OSError as exc:
            raise CliError(
                f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}): another "
                "process holds the port; pick another with --port"
            ) from None


def check_ray_head(address: str) -> None:
    """A HOST:PORT (or ray://HOST:PORT) Ray address accepts a TCP connection within
    RAY_CONNECT_TIMEOUT_S; ray.init would otherwise retry for minutes with only warnings."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local": Ray finds (or starts) the cluster itself
    try:
        with socket.create_connection((host.strip("[]"), int(port)), RAY_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise CliError(
            f"--ray-address {address}: no Ray head answers there ({exc.strerror or exc}): "
            f"start one with `ray start --head --port {port}` on {host}, or leave --ray-address "
            "out to start a local cluster"
        ) from None
