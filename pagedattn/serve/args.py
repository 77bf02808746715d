"""Options of `pagedattn serve` for replicas (Ray Serve) and KV cache events."""

from __future__ import annotations

import argparse

from pagedattn.serve.router import DEFAULT_IMBALANCE_THRESHOLD, ROUTERS


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """--data-parallel-size, --ray-address, --router and their tuning.

    `--kv-events-endpoint` is an engine option (CacheConfig.kv_events_endpoint); with replicas,
    replica i publishes on its port + i, with a replay socket (--kv-events-replay-endpoint).
    """
    g = parser.add_argument_group("replicas (Ray Serve) and KV cache events")
    g.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine replicas behind one endpoint, run as a Ray Serve application (N > 1, or "
        "with --ray-address); needs the `ray` extra",
    )
    g.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        metavar="P",
        help="prefill/decode disaggregation: P replicas compute prompts (first token + KV "
        "blocks) for --decode-replicas, which pull the blocks over ZMQ and stream the rest",
    )
    g.add_argument(
        "--decode-replicas",
        type=int,
        default=0,
        metavar="D",
        help="with --prefill-replicas: D replicas that decode (chosen by load)",
    )
    g.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=256,
        metavar="N",
        help="with --prefill-replicas: prompts shorter than N tokens are computed on the decode "
        "replica (0: every prompt goes to a prefill replica)",
    )
    g.add_argument(
        "--pd-decode-step-time",
        type=float,
        default=None,
        metavar="S",
        help="with --prefill-replicas: --target-step-time of the decode replicas only (default: "
        "--target-step-time); a small value chunks the short prompts they compute",
    )
    g.add_argument(
        "--pd-prefill-nice",
        type=int,
        default=5,
        metavar="N",
        help="with --prefill-replicas: the nice value of the prefill replicas' threads (0: "
        "unchanged), so that what shares their node (ingress, proxy, clients) takes CPU time "
        "from prefills before decode steps",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster (`ray start --head` prints it); default: start a local one",
    )
    g.add_argument(
        "--router",
        choices=ROUTERS,
        default="prefix",
        help="how requests pick a replica: longest cached prefix (from KV events), power of "
        "two choices, or round robin",
    )
    g.add_argument(
        "--router-imbalance-threshold",
        type=int,
        default=DEFAULT_IMBALANCE_THRESHOLD,
        metavar="K",
        help="the prefix router ignores cache affinity while replica queues differ by more (and "
        "the longest is also 1.5x the shortest)",
    )
    g.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="Ray CPUs reserved per replica, per rank with --tensor-parallel-size (placement "
        "only; --threads sets torch threads)",
    )
    g.add_argument(
        "--kv-transfer-host",
        default=None,
        metavar="ADDR",
        help="with replicas: the address each replica's internal sockets (the router's KV event "
        "feed and replay, PD block transfers) bind to; default 127.0.0.1 (every replica on the "
        "ingress's node). `node`: the Ray node's address, for replicas on several nodes. Either "
        "way only the deployment's processes can connect (a per-deployment secret; CURVE "
        "encryption off loopback)",
    )
    # NOTE: only if the server's own options (entrypoints/args.py) do not define it already.
    if "--admin-api-key" not in parser._option_string_actions:
        g.add_argument(
            "--admin-api-key",
            action="append",
            default=None,
            metavar="KEY",
            help="an admin key (repeatable; default: PAGEDATTN_ADMIN_API_KEY): an API key that "
            "also reads the internal endpoints (/debug/replicas, /debug/router), which no other "
            "key can",
        )
    g.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="URL",
        help="with --kv-events-endpoint: a ROUTER socket answering replay requests for missed "
        "batches; with replicas, replica i binds the port + i (as --kv-events-endpoint does)",
    )


def uses_replicas(args: argparse.Namespace) -> bool:
    """True when `pagedattn serve` should run the Ray Serve application."""
    num_pd = getattr(args, "prefill_replicas", 0) + getattr(args, "decode_replicas", 0)
    return args.data_parallel_size > 1 or args.ray_address is not None or num_pd > 0


def validate_distributed_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the bad option."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size={args.data_parallel_size} is invalid: use >= 1")
    num_prefill, num_decode = (
        getattr(args, "prefill_replicas", 0),
        getattr(args, "decode_replicas", 0),
    )
    if num_prefill or num_decode:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(
                f"--prefill-replicas={num_prefill} --decode-replicas={num_decode} is invalid: "
                "give both, each >= 1"
            )
        if args.data_parallel_size > 1:
            raise ValueError(
                "--data-parallel-size and --prefill-replicas/--decode-replicas are two layouts: "
                "use one"
            )
        if args.pd_min_prompt_tokens < 0:
            raise ValueError(
                f"--pd-min-prompt-tokens={args.pd_min_prompt_tokens} is invalid: use >= 0"
            )
        step_time = getattr(args, "pd_decode_step_time", None)
        if step_time is not None and not 0 < step_time <= 60:
            raise ValueError(
                f"--pd-decode-step-time={step_time} is invalid: use seconds in (0, 60]"
            )
        nice = getattr(args, "pd_prefill_nice", 5)
        if not 0 <= nice <= 19:
            raise ValueError(f"--pd-prefill-nice={nice} is invalid: use 0..19")
        _check_pd_ignores(args)
    if args.replica_cpus < 0:
        raise ValueError(f"--replica-cpus={args.replica_cpus} is invalid: use >= 0")
    pd = bool(num_prefill or num_decode)
    if (pd or args.data_parallel_size > 1) and (
        getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None)
    ):
        raise ValueError(
            "LoRA adapters (--enable-lora, --lora-modules) are served by one process: Ray Serve "
            "replicas do not load them; drop --data-parallel-size/--prefill-replicas/"
            "--decode-replicas, or the LoRA options"
        )
    if pd and getattr(args, "tensor_parallel_size", 1) > 1:
        raise ValueError(
            "--tensor-parallel-size > 1 with --prefill-replicas/--decode-replicas is not "
            "supported: a transfer would carry rank 0's shard only; use one of the two"
        )
    if pd and getattr(args, "calculate_kv_scales", False):
        raise ValueError(
            "--calculate-kv-scales with --prefill-replicas/--decode-replicas is not supported: "
            "each replica computes its own fp8 scales, and pulled blocks would be read with the "
            "decode replica's; drop --calculate-kv-scales (fixed scales)"
        )
    if pd and getattr(args, "kv_cache_dtype", "auto") == "u8":
        raise ValueError(
            "--kv-cache-dtype u8 with --prefill-replicas/--decode-replicas is not supported yet: "
            "the block transfer is untested with u8 blocks; use fp8 or the model's dtype"
        )
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        value = getattr(args, name, None)
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            option = "--" + name.replace("_", "-")
            raise ValueError(f"{option}={value!r} is invalid: use tcp://HOST:PORT or ipc://PATH")


def _check_pd_ignores(args: argparse.Namespace) -> None:
    """Refuse the options a PD layout cannot honour rather than drop them silently."""
    routing = "prefill replicas route by cached prefix and decode replicas by load"
    events = "prefill/decode replicas publish no KV events outside (the prefix router has its own)"
    for option, default, why in (
        ("router", "prefix", routing),
        ("router_imbalance_threshold", DEFAULT_IMBALANCE_THRESHOLD, routing),
        ("kv_events_endpoint", None, events),
        ("kv_events_replay_endpoint", None, events),
    ):
        value = getattr(args, option, default)
        if value != default:
            flag = "--" + option.replace("_", "-")
            raise ValueError(
                f"{flag}={value!r} does not apply with --prefill-replicas/--decode-replicas "
                f"(the {why}): drop it"
            )
