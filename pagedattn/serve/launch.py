"""`pagedattn serve` with replicas: start (or join) Ray, run the Ray Serve application, drain.

The application itself (ingress, replicas, routers) is built by serve_app.build_app, or by
pd_app.pd_app_builder for prefill/decode disaggregation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ray import serve

from pagedattn.serve.serve_app import APP_NAME, build_app, replica_env

logger = logging.getLogger(__name__)


def run_replicas(args, engine_config) -> int:
    """`pagedattn serve --data-parallel-size N`: serve until SIGTERM/SIGINT, drain, return 0.

    Starts a local Ray instance unless `--ray-address` names a cluster; on a signal the app is
    deleted (replicas finish in-flight requests for up to --shutdown-timeout seconds), then Ray
    is stopped if this command started it.
    """
    import os
    import signal
    import threading

    import ray

    from pagedattn.entrypoints.openai.http import admin_keys_from_env, keys_from_env
    from pagedattn.serve.args import validate_distributed_args

    validate_distributed_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.ray_address is not None and getattr(args, "kv_transfer_host", None) is None:
        logger.warning(
            "replica sockets (KV events, PD block transfers) bind to 127.0.0.1: replicas on "
            "other nodes than the ingress are routed by load and recompute pulled prompts; "
            "pass --kv-transfer-host node to reach them (still private to this deployment)"
        )
    num_pd = getattr(args, "prefill_replicas", 0) + getattr(args, "decode_replicas", 0)
    num_replicas = num_pd or args.data_parallel_size
    env = replica_env()
    if args.ray_address is None:
        ranks = num_replicas * engine_config.tensor_parallel_size
        num_cpus = max(os.cpu_count() or 1, int(ranks * args.replica_cpus + 0.999))
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
    else:
        ray.init(address=args.ray_address, runtime_env={"env_vars": env})
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        # NOTE: one HTTP proxy, on the head node: the endpoint is --host:--port of the head (a
        # proxy on every node would also collide on the port when two nodes share a machine).
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
        build = build_app
        if num_pd:  # prefill/decode disaggregation (pd_app.py)
            from pagedattn.serve.pd_app import pd_app_builder

            build = pd_app_builder(
                args.prefill_replicas,
                args.decode_replicas,
                args.pd_min_prompt_tokens,
                getattr(args, "pd_decode_step_time", None),
                getattr(args, "pd_prefill_nice", 5),
            )
        app = build(
            engine_config,
            num_replicas,
            router=args.router,
            api_keys=list(args.api_key or []) or keys_from_env(),
            admin_keys=list(getattr(args, "admin_api_key", None) or []) or admin_keys_from_env(),
            served_model_name=args.served_model_name,
            imbalance_threshold=args.router_imbalance_threshold,
            events_host=getattr(args, "kv_transfer_host", None),
            replica_num_cpus=args.replica_cpus,
            graceful_shutdown_timeout_s=args.shutdown_timeout,
            kv_events_endpoint=getattr(args, "kv_events_endpoint", None),
            kv_events_replay_endpoint=args.kv_events_replay_endpoint,
            max_request_bytes=args.max_request_bytes,
            max_prompt_chars=args.max_prompt_chars,
            metrics_public=args.metrics_public,
            health_stall_s=args.health_stall_s,
        )
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        logger.info(
            "serving %d replicas (router %s) on http://%s:%d",
            num_replicas,
            args.router,
            args.host,
            args.port,
        )
        while not stop.wait(1.0):
            pass
        logger.info("signal received: draining in-flight requests, then stopping")
        serve.delete(APP_NAME)
        if args.ray_address is None:
            serve.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pagedattn.serve.serve_app --data-parallel-size N ...` (serve's options)."""
    import argparse
    import os

    from pagedattn.config import EngineConfig
    from pagedattn.entrypoints.args import add_serve_args
    from pagedattn.serve.args import add_distributed_args

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="pagedattn serve", description=__doc__)
    add_serve_args(parser)
    if "--data-parallel-size" not in parser._option_string_actions:
        add_distributed_args(parser)
    args = parser.parse_args(argv)
    return run_replicas(args, EngineConfig.from_cli(args))


if __name__ == "__main__":
    raise SystemExit(main())
