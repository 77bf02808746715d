"""`pagedattn serve --prefill-replicas P --decode-replicas D`: PD disaggregation on Ray Serve.

Layout: the `OpenAIIngress` (the hardened front door of `--data-parallel-size`) sends each request
to a `DecodeReplica` chosen by load (pow2). Its `DisaggregatedEngine` sends the prompt to a
`PrefillReplica` chosen by the prefix router (from the prefill replicas' KV events), which
computes the prompt's KV and the first token with ``max_tokens=1`` and returns that token with the
``KVTransferParams`` of its blocks; the decode replica streams the token to the client at once,
pulls the blocks its prefix cache lacks from the prefill replica's BlockServer (ZMQ) and decodes
the rest. A prefill replica never holds a request past its first token, so long prompts never
stall the decode replicas' streams.

Every replica's sockets (the prefill replicas' KV event feeds and BlockServers) bind to
loopback unless `--kv-transfer-host` says otherwise, and only holders of the deployment secret
(made by `build_pd_app`, handed to every replica) can connect: see replica.py.
"""

# NOTE: no postponed annotations (see serve_app.py): replicas may be pickled by value.

import logging
from typing import Any

from ray import serve

from pagedattn.distributed.zmq_auth import new_deployment_secret
from pagedattn.entrypoints.serve_config import ServeConfig
from pagedattn.serve.replica import EngineReplica
from pagedattn.serve.serve_app import bind_ingress, make_router_config, replica_cpu_bind

logger = logging.getLogger(__name__)

# Prompts shorter than this are computed on the decode replica (--pd-min-prompt-tokens).
DEFAULT_PD_MIN_PROMPT_TOKENS = 256
# The nice value of the prefill replicas' threads (--pd-prefill-nice): where replicas share a node
# with the ingress, the proxy and clients, those take their CPU time from the prefill replicas
# (throughput work) before the decode replicas' streams.
DEFAULT_PD_PREFILL_NICE = 5
# --target-step-time of the decode replicas (--pd-decode-step-time); None: --target-step-time.
# NOTE: 0.1 s (chunking the short prompts they compute) measured no lower ITL p99 and 33% less
# throughput than the default in bf16 (docs/scaling.md, "bench pd"), so it is not the default.
DEFAULT_PD_DECODE_STEP_TIME_S = None


def _split_store(engine_config):
    """(engine config without kv_store, the shared store or None): PD owns the connector.

    NOTE: --kv-events-endpoint is dropped too: prefill and decode replicas of the same rank
    would bind the same port (the router's own event feeds are unaffected).
    """
    import dataclasses

    from pagedattn.kv_transfer.store import make_store

    url = engine_config.cache.kv_store
    cache = dataclasses.replace(engine_config.cache, kv_store=None, kv_events_endpoint=None)
    config = dataclasses.replace(engine_config, cache=cache)
    return config, None if url is None else make_store(url)


def _kv_usage(replica: EngineReplica) -> dict[str, Any]:
    manager = replica.kv_cache_manager
    return {
        "replica_id": replica.replica_id,
        "num_free_blocks": manager.num_free_blocks,
        "num_usable_blocks": manager.num_usable_blocks,
        "num_requests": len(replica.llm_engine.requests),
        "cpus": replica.cpus,
        "step_seconds": list(replica.engine.step_seconds),
        "itl_seconds": list(replica.engine.itl_seconds),
    }


class PrefillReplica(EngineReplica):
    """An engine replica that computes prompts: their first token, and blocks to pull."""

    def __init__(
        self,
        engine_config,
        serve_config=None,
        events_host=None,
        cpu_bind=None,
        nice=DEFAULT_PD_PREFILL_NICE,
        deployment_secret=None,
    ) -> None:
        from pagedattn.distributed.cpu_bind import renice_process
        from pagedattn.kv_transfer.pd import PrefillRole

        engine_config, shared = _split_store(engine_config)
        super().__init__(
            engine_config,
            serve_config,
            events_host,
            cpu_bind=cpu_bind,
            deployment_secret=deployment_secret,
        )
        # NOTE: attached before any request: the engine loop is idle.
        self.role = PrefillRole(
            self.llm_engine,
            endpoint=f"tcp://{self.bind_host}:*",
            fallback=shared,
            curve=self.curve,
            advertised_host=self.advertised_host,
        )
        # NOTE: last, so every thread started above (the engine loop's, ZMQ's, Ray's) has it.
        self.nice = renice_process(nice) if nice else None

    async def prefill(
        self, request_id, prompt, params, cache_salt=None, priority=0, routing_hashes=None
    ):
        """(the first output, KVTransferParams or None when the first token ended the request)."""
        from pagedattn.serve.pd_engine import run_prefill

        return await run_prefill(
            self.engine, self.role, request_id, prompt, params, cache_salt, priority
        )

    async def kv_usage(self) -> dict[str, Any]:
        """Blocks free and held now (no request in flight: all usable blocks free), and where
        this replica's BlockServer listens."""
        server = self.role.server
        return {
            **_kv_usage(self),
            "nice": self.nice,
            "transfer_endpoint": self.role.endpoint,
            "num_transfer_requests": server.num_requests,
            "num_malformed_transfer_requests": server.num_malformed,
        }


class DecodeReplica(EngineReplica):
    """An engine replica that continues prefilled requests from their pulled blocks."""

    def __init__(
        self,
        engine_config,
        prefill,
        serve_config=None,
        events_host=None,
        min_prompt_tokens=DEFAULT_PD_MIN_PROMPT_TOKENS,
        cpu_bind=None,
        cpu_slot_base=0,
        step_time_s=DEFAULT_PD_DECODE_STEP_TIME_S,
        deployment_secret=None,
    ) -> None:
        import dataclasses

        from pagedattn.kv_transfer.pd import DecodeRole
        from pagedattn.serve import serve_router
        from pagedattn.serve.pd_engine import DisaggregatedEngine

        engine_config, shared = _split_store(engine_config)
        if step_time_s is not None:
            scheduler = dataclasses.replace(engine_config.scheduler, target_step_time=step_time_s)
            engine_config = dataclasses.replace(engine_config, scheduler=scheduler)
        super().__init__(
            engine_config,
            serve_config,
            events_host,
            cpu_bind=cpu_bind,
            cpu_slot_base=cpu_slot_base,
            # NOTE: decode replicas are routed by load: nobody reads their KV events, and a
            # drainer thread waking every 5 ms would take the GIL from the engine loop.
            publish_kv_events=False,
            deployment_secret=deployment_secret,
        )
        # NOTE: before the first call on `prefill`: its router (in this process) subscribes to
        # the prefill replicas' event feeds with these keys.
        if deployment_secret is not None:
            serve_router.use_deployment_secret(deployment_secret)
        self.role = DecodeRole(self.llm_engine, fallback=shared, curve=self.curve)
        cache = engine_config.cache
        self.pd_engine = DisaggregatedEngine(
            self.engine, self.role, prefill, cache.block_size, cache.hash_seed, min_prompt_tokens
        )
        self.serving.engine = self.pd_engine  # NOTE: the OpenAI layer's only engine seam

    async def kv_usage(self) -> dict[str, Any]:
        """Blocks free and held now, and the transfers this replica pulled."""
        out = _kv_usage(self)
        pd = self.pd_engine
        out.update(
            num_disaggregated=pd.num_disaggregated,
            num_local=pd.num_local,
            num_prefill_retries=pd.num_prefill_retries,
            num_inbox_entries=len(self.role.inbox),
            transfers=list(pd.transfers),
            load_time_s=self.role.connector.stats.load_time_s,
        )
        return out


def build_pd_app(
    engine_config,
    serve_config: ServeConfig,
    *,
    secret: bytes | None = None,
    max_ongoing_requests: int = 256,
    routing_stats_period_s: float = 1.0,
    health_check_period_s: float = 2.0,
    seed: int | None = None,
    cpu_bind: str | None = None,
    ingress_on_prefill: bool = True,
    deployment_secret: bytes | None = None,
):
    """The PD application: `serve.run(build_pd_app(engine_config, serve_config))`.

    ``serve_config``: `pagedattn serve`'s options (its prefill_replicas, decode_replicas and
    pd_* options; keys, limits). The routers are fixed (prefill: prefix, decode: pow2).
    CPU slots (``cpu_bind``, see serve_app.build_app): the prefill replicas take slots 0..P-1,
    the decode replicas P..P+D-1; with ``ingress_on_prefill`` the ingress runs on the prefill
    slots' CPUs. ``deployment_secret`` (default: a fresh one) authenticates the replicas' sockets.
    """
    num_prefill, num_decode = serve_config.prefill_replicas, serve_config.decode_replicas
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(
            f"--prefill-replicas={num_prefill} --decode-replicas={num_decode} is invalid: "
            "use at least one of each"
        )
    bind = replica_cpu_bind(cpu_bind)
    deployment_secret = deployment_secret or new_deployment_secret()
    common = dict(
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": serve_config.replica_cpus},
        graceful_shutdown_timeout_s=serve_config.shutdown_timeout,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=30.0,
    )
    events_host = serve_config.kv_transfer_host
    prefill = serve.deployment(
        PrefillReplica,
        name="PrefillReplica",
        num_replicas=num_prefill,
        request_router_config=make_router_config(
            routing_stats_period_s, policy="prefix", seed=seed
        ),
        **common,
    ).bind(
        engine_config,
        serve_config,
        events_host,
        bind,
        serve_config.pd_prefill_nice,
        deployment_secret=deployment_secret,
    )
    decode = serve.deployment(
        DecodeReplica,
        name="DecodeReplica",
        num_replicas=num_decode,
        request_router_config=make_router_config(routing_stats_period_s, policy="pow2", seed=seed),
        **common,
    ).bind(
        engine_config,
        prefill,
        serve_config,
        events_host,
        serve_config.pd_min_prompt_tokens,
        bind,
        num_prefill,
        serve_config.pd_decode_step_time,
        deployment_secret=deployment_secret,
    )
    # NOTE: the ingress forwards every streamed token; on the prefill replicas' cores (where
    # prefills run at --pd-prefill-nice) it takes CPU time from prefills, not from decode steps.
    cpu_slots = (bind, list(range(num_prefill)), engine_config.num_threads)
    return bind_ingress(
        decode,
        engine_config,
        serve_config,
        secret,
        max_ongoing_requests,
        cpu_slots=cpu_slots if ingress_on_prefill else None,
    )
