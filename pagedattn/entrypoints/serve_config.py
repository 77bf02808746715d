"""`pagedattn serve`'s options: one frozen ServeConfig, declared with config.option().

Every server option is written once, here (its default, help text and flag), as EngineConfig's
are in pagedattn/config.py. The CLI builds one ServeConfig from the parsed flags
(`ServeConfig.from_cli`) and hands it to `run_server` or, with replicas, `run_replicas`; both
apps' `build_app` (and `build_pd_app`) take it. The replica options live here too, so that the
single server and the replicas read one object; their meaning is in pagedattn/serve/.

This module imports no web stack: parsing a command line must not load FastAPI or Ray.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, fields

from pagedattn.config import ConfigError, option
from pagedattn.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedattn.entrypoints.openai.tool_parsers import TOOL_PARSERS

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
# /health answers 503 "degraded" once a step or a front-end job has run this long.
DEFAULT_HEALTH_STALL_S = 30.0
MAX_PORT = 65535
# How requests pick a replica (serve/router.py implements them).
ROUTERS = ("prefix", "pow2", "round_robin")
# Queue-length spread (max - min) past which the prefix router ignores cache affinity ...
# NOTE: a replica's queue length is its ongoing requests, and up to max_num_seqs of them run in
# one batch, not waiting; with 8, bursts of a few tenants spilled prefixes (a benchmark run:
# 32 of 150 requests, the prefix computed on both replicas). SGLang's default is 64, Ray Serve
# LLM's prefix router never spills.
DEFAULT_IMBALANCE_THRESHOLD = 32
# The first option of the replicas' group in --help; those declared before it are the server's.
_FIRST_REPLICA_OPTION = "data_parallel_size"
_SERVER_GROUP = "server options"
_REPLICA_GROUP = "replicas (Ray Serve) and KV cache events"
_KEYS = {"action": "extend", "nargs": "+"}


@dataclass(frozen=True)
class ServeConfig:
    """Everything `pagedattn serve` needs besides the EngineConfig; validated on construction."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: tuple[str, ...] | None = option(
        None,
        "accepted API keys (repeatable); each key gets its own prefix-cache namespace "
        "(default: PAGEDATTN_API_KEY's comma-separated keys, else no key needed)",
        cli=_KEYS,
    )
    served_model_name: str | None = option(
        None, "model id clients must send (default: the model's name)"
    )
    shutdown_timeout: float = option(
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        "seconds in-flight requests may finish after SIGTERM/SIGINT before being aborted",
    )
    log_level: str = option("info", "logging", choices=("debug", "info", "warning", "error"))
    metrics_public: bool = option(
        False,
        "serve /metrics without an API key even when keys are set (default: it needs one)",
        cli={"action": "store_true"},
    )
    health_stall_s: float = option(
        DEFAULT_HEALTH_STALL_S,
        "/health answers 503 degraded when an engine step or a tokenise job has "
        "run longer than this",
    )
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES, "largest request body accepted (413 above it)"
    )
    max_prompt_chars: int | None = option(
        None,
        "longest prompt text accepted before tokenising (default: max_model_len x 8 "
        "characters, or x the longest token if shorter; a prompt of more characters is refused "
        "before any tokenisation)",
    )
    lora_modules: tuple[str, ...] | None = option(
        None,
        "LoRA adapters (PEFT folders) to serve, selected by the `model` field; needs --enable-lora",
        cli={**_KEYS, "metavar": "NAME=PATH"},
    )
    enable_lora_runtime_updates: bool = option(
        False,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING; behind the API key when keys are set)",
        cli={"action": "store_true"},
    )
    lora_root: str | None = option(
        None,
        "the folder runtime adapter loads read under (a lora_path is relative to it; "
        "nothing outside it, symlinks and `..` resolved); needed for runtime loads",
        cli={"metavar": "DIR"},
    )
    # Tool calling and reasoning (vLLM's names); docs/agent-api.md explains them.
    tool_call_parser: str | None = option(
        None,
        "how the model writes tool calls (hermes: Qwen/Hermes <tool_call>; llama3_json; "
        "mistral [TOOL_CALLS]; pythonic); default: hermes for a chat template without tool "
        "support (it gets the generic tool prompt), else none",
        choices=tuple(sorted(TOOL_PARSERS)),
    )
    enable_auto_tool_choice: bool = option(
        False,
        'allow tool_choice "auto" (the model decides; its calls are parsed); "required" '
        "and named choices work without it",
        cli={"action": "store_true"},
    )
    reasoning_parser: str | None = option(
        None,
        "split the model's <think> block into reasoning_content (deepseek_r1, qwen3)",
        choices=tuple(sorted(REASONING_PARSERS)),
    )
    # Replicas (Ray Serve, pagedattn/serve/). `--kv-events-endpoint` is an engine option
    # (CacheConfig.kv_events_endpoint); with replicas, replica i publishes on its port + i.
    data_parallel_size: int = option(
        1,
        "engine replicas behind one endpoint, run as a Ray Serve application (N > 1, or "
        "with --ray-address); needs the `ray` extra",
        cli={"metavar": "N"},
    )
    prefill_replicas: int = option(
        0,
        "prefill/decode disaggregation: P replicas compute prompts (first token + KV "
        "blocks) for --decode-replicas, which pull the blocks over ZMQ and stream the rest",
        cli={"metavar": "P"},
    )
    decode_replicas: int = option(
        0,
        "with --prefill-replicas: D replicas that decode (chosen by load)",
        cli={"metavar": "D"},
    )
    pd_min_prompt_tokens: int = option(
        256,
        "with --prefill-replicas: prompts shorter than N tokens are computed on the decode "
        "replica (0: every prompt goes to a prefill replica)",
        cli={"metavar": "N"},
    )
    pd_decode_step_time: float | None = option(
        None,
        "with --prefill-replicas: --target-step-time of the decode replicas only (default: "
        "--target-step-time); a small value chunks the short prompts they compute",
        cli={"metavar": "S"},
    )
    pd_prefill_nice: int = option(
        5,
        "with --prefill-replicas: the nice value of the prefill replicas' threads (0: "
        "unchanged), so that what shares their node (ingress, proxy, clients) takes CPU time "
        "from prefills before decode steps",
        cli={"metavar": "N"},
    )
    ray_address: str | None = option(
        None,
        "join this Ray cluster (`ray start --head` prints it); default: start a local one",
        cli={"metavar": "ADDR"},
    )
    router: str = option(
        "prefix",
        "how requests pick a replica: longest cached prefix (from KV events), power of "
        "two choices, or round robin",
        choices=ROUTERS,
    )
    router_imbalance_threshold: int = option(
        DEFAULT_IMBALANCE_THRESHOLD,
        "the prefix router ignores cache affinity while replica queues differ by more (and "
        "the longest is also 1.5x the shortest)",
        cli={"metavar": "K"},
    )
    replica_cpus: float = option(
        1.0,
        "Ray CPUs reserved per replica, per rank with --tensor-parallel-size (placement "
        "only; --threads sets torch threads)",
    )
    kv_transfer_host: str | None = option(
        None,
        "with replicas: the address each replica's internal sockets (the router's KV event "
        "feed and replay, PD block transfers) bind to; default 127.0.0.1 (every replica on the "
        "ingress's node). `node`: the Ray node's address, for replicas on several nodes. Either "
        "way only the deployment's processes can connect (a per-deployment secret; CURVE "
        "encryption off loopback)",
        cli={"metavar": "ADDR"},
    )
    admin_api_key: tuple[str, ...] | None = option(
        None,
        "an admin key (repeatable; default: PAGEDATTN_ADMIN_API_KEY): an API key that "
        "also reads the internal endpoints (/debug/replicas, /debug/router), which no other "
        "key can",
        cli={"action": "append", "metavar": "KEY"},
    )
    kv_events_replay_endpoint: str | None = option(
        None,
        "with --kv-events-endpoint: a ROUTER socket answering replay requests for missed "
        "batches; with replicas, replica i binds the port + i (as --kv-events-endpoint does)",
        cli={"metavar": "URL"},
    )

    def __post_init__(self) -> None:
        for name in ("api_key", "lora_modules", "admin_api_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                if isinstance(value, str):
                    raise ConfigError(f"{_flag(name)}={value!r} is invalid: give a list of strings")
                object.__setattr__(self, name, tuple(value))
        for f in fields(self):
            choices = f.metadata["choices"]
            value = getattr(self, f.name)
            if (
                choices is not None
                and value not in choices
                and not (value is None and f.default is None)
            ):
                allowed = ", ".join(map(str, choices))
                raise ConfigError(f"{_flag(f.name)}={value!r} is invalid: use one of {allowed}")
        if not 0 <= self.port <= MAX_PORT:
            raise ConfigError(
                f"--port {self.port} is invalid: use a TCP port in 1..{MAX_PORT} (0: any free one)"
            )
        _check(self.shutdown_timeout >= 0, "shutdown_timeout", self.shutdown_timeout, "use >= 0")
        _check(self.health_stall_s > 0, "health_stall_s", self.health_stall_s, "use seconds > 0")
        _check(self.max_request_bytes >= 1, "max_request_bytes", self.max_request_bytes, "use >= 1")
        _check(
            self.max_prompt_chars is None or self.max_prompt_chars >= 1,
            "max_prompt_chars",
            self.max_prompt_chars,
            "use >= 1, or leave it out for the default",
        )
        self._check_replicas()

    def _check_replicas(self) -> None:
        _check(
            self.data_parallel_size >= 1, "data_parallel_size", self.data_parallel_size, "use >= 1"
        )
        _check(self.replica_cpus >= 0, "replica_cpus", self.replica_cpus, "use >= 0")
        endpoint = self.kv_events_replay_endpoint
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"--kv-events-replay-endpoint={endpoint!r} is invalid: use tcp://HOST:PORT or "
                "ipc://PATH"
            )
        num_prefill, num_decode = self.prefill_replicas, self.decode_replicas
        if not (num_prefill or num_decode):
            return
        if num_prefill < 1 or num_decode < 1:
            raise ConfigError(
                f"--prefill-replicas={num_prefill} --decode-replicas={num_decode} is invalid: "
                "give both, each >= 1"
            )
        if self.data_parallel_size > 1:
            raise ConfigError(
                "--data-parallel-size and --prefill-replicas/--decode-replicas are two layouts: "
                "use one"
            )
        _check(
            self.pd_min_prompt_tokens >= 0,
            "pd_min_prompt_tokens",
            self.pd_min_prompt_tokens,
            "use >= 0",
        )
        step_time = self.pd_decode_step_time
        _check(
            step_time is None or 0 < step_time <= 60,
            "pd_decode_step_time",
            step_time,
            "use seconds in (0, 60]",
        )
        _check(
            0 <= self.pd_prefill_nice <= 19, "pd_prefill_nice", self.pd_prefill_nice, "use 0..19"
        )
        # NOTE: refuse the options a PD layout cannot honour rather than drop them silently.
        routing = "prefill replicas route by cached prefix and decode replicas by load"
        events = (
            "prefill/decode replicas publish no KV events outside (the prefix router has its own)"
        )
        for name, why in (
            ("router", routing),
            ("router_imbalance_threshold", routing),
            ("kv_events_replay_endpoint", events),
        ):
            value = getattr(self, name)
            if value != _FIELDS[name].default:
                raise ConfigError(
                    f"{_flag(name)}={value!r} does not apply with --prefill-replicas/"
                    f"--decode-replicas (the {why}): drop it"
                )

    @property
    def num_pd_replicas(self) -> int:
        """Prefill plus decode replicas (0: no prefill/decode disaggregation)."""
        return self.prefill_replicas + self.decode_replicas

    @property
    def uses_replicas(self) -> bool:
        """True when `pagedattn serve` runs the Ray Serve application, not one engine."""
        return (
            self.data_parallel_size > 1 or self.ray_address is not None or self.num_pd_replicas > 0
        )

    def api_keys(self) -> list[str]:
        """The accepted keys: --api-key, else PAGEDATTN_API_KEY's (empty: no key needed)."""
        from pagedattn import envs

        return list(self.api_key or ()) or [k for k in envs.PAGEDATTN_API_KEY.split(",") if k]

    def admin_keys(self) -> list[str]:
        """The admin keys: --admin-api-key, else PAGEDATTN_ADMIN_API_KEY's."""
        from pagedattn import envs

        keys = self.admin_api_key or ()
        return list(keys) or [k for k in envs.PAGEDATTN_ADMIN_API_KEY.split(",") if k]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, replicas_only: bool = False) -> None:
        """One flag per option (dest = the field's name), in two groups: the server's and the
        replicas'; ``replicas_only`` adds the replicas' only (serve/args.py's parser)."""
        hints = typing.get_type_hints(cls)
        group = None if replicas_only else parser.add_argument_group(_SERVER_GROUP)
        for f in fields(cls):
            if f.name == _FIRST_REPLICA_OPTION:
                group = parser.add_argument_group(_REPLICA_GROUP)
            if group is None:
                continue
            meta = f.metadata
            kwargs = dict(meta["cli"] or {})
            if "action" not in kwargs:
                kwargs["type"] = meta["parse"] or _value_type(hints[f.name])
            if meta["choices"] is not None:
                kwargs["choices"] = list(meta["choices"])
            flags = meta["flags"] or (f"--{f.name.replace('_', '-')}",)
            group.add_argument(*flags, dest=f.name, default=f.default, help=meta["help"], **kwargs)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> ServeConfig:
        """A config from parsed flags; options not on the parser keep their defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


_FIELDS = {f.name: f for f in fields(ServeConfig)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check(ok: bool, name: str, value, allowed: str) -> None:
    """Raise ConfigError naming the option's flag, its value and what is allowed."""
    if not ok:
        raise ConfigError(f"{_flag(name)}={value!r} is invalid: {allowed}")


def _value_type(hint) -> type:
    """``int | None`` -> int: the type a CLI string converts to."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
