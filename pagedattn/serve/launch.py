"""`pagedattn serve` with replicas: start (or join) Ray, run the Ray Serve application, drain.

The application itself (ingress, replicas, routers) is built by serve_app.build_app, or by
pd_app.build_pd_app for prefill/decode disaggregation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ray import serve

from pagedattn.config import EngineConfig
from pagedattn.entrypoints.serve_config import ServeConfig
from pagedattn.serve.serve_app import APP_NAME, build_app, replica_env

logger = logging.getLogger(__name__)


def run_replicas(engine_config: EngineConfig, serve_config: ServeConfig) -> int:
    """`pagedattn serve --data-parallel-size N`: serve until SIGTERM/SIGINT, drain, return 0.

    Starts a local Ray instance unless `--ray-address` names a cluster; on a signal the app is
    deleted (replicas finish in-flight requests for up to --shutdown-timeout seconds), then Ray
    is stopped if this command started it.
    """
    import os
    import signal
    import threading

    import ray

    from pagedattn.serve.args import check_replica_layout

    cfg = serve_config
    check_replica_layout(cfg, engine_config)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if cfg.ray_address is not None and cfg.kv_transfer_host is None:
        logger.warning(
            "replica sockets (KV events, PD block transfers) bind to 127.0.0.1: replicas on "
            "other nodes than the ingress are routed by load and recompute pulled prompts; "
            "pass --kv-transfer-host node to reach them (still private to this deployment)"
        )
    num_replicas = cfg.num_pd_replicas or cfg.data_parallel_size
    env = replica_env()
    if cfg.ray_address is None:
        ranks = num_replicas * engine_config.tensor_parallel_size
        num_cpus = max(os.cpu_count() or 1, int(ranks * cfg.replica_cpus + 0.999))
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
    else:
        ray.init(address=cfg.ray_address, runtime_env={"env_vars": env})
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        # NOTE: one HTTP proxy, on the head node: the endpoint is --host:--port of the head (a
        # proxy on every node would also collide on the port when two nodes share a machine).
        serve.start(proxy_location="HeadOnly", http_options={"host": cfg.host, "port": cfg.port})
        if cfg.num_pd_replicas:  # prefill/decode disaggregation (pd_app.py)
            from pagedattn.serve.pd_app import build_pd_app

            app = build_pd_app(engine_config, cfg)
        else:
            app = build_app(engine_config, cfg)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        logger.info(
            "serving %d replicas (router %s) on http://%s:%d",
            num_replicas,
            cfg.router,
            cfg.host,
            cfg.port,
        )
        while not stop.wait(1.0):
            pass
        logger.info("signal received: draining in-flight requests, then stopping")
        serve.delete(APP_NAME)
        if cfg.ray_address is None:
            serve.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pagedattn.serve.launch --data-parallel-size N ...` (serve's options)."""
    import argparse
    import os

    from pagedattn.entrypoints.args import add_serve_args

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="pagedattn serve", description=__doc__)
    add_serve_args(parser)
    args = parser.parse_args(argv)
    return run_replicas(EngineConfig.from_cli(args), ServeConfig.from_cli(args))


if __name__ == "__main__":
    raise SystemExit(main())
