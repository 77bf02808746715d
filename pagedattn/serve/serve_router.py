"""PagedRequestRouter: Ray Serve's request-router extension point, driven by our policies.

Runs inside the caller of the engine deployment's handle (the ingress). Each replica's
`record_routing_stats` names its KV event endpoints; the router subscribes to each, keeps a
PrefixIndex from the events, and ranks replicas with the configured policy (`prefix`, `pow2`,
`round_robin`) for the block hashes the ingress put in the call's `routing_hashes` keyword.
The replicas' event sockets admit only the deployment's clients: the router subscribes with the
keys of the deployment secret that the handle's owner (the ingress; a PD decode replica) gave
this process (`use_deployment_secret`) before its first call.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedattn.distributed.kv_events import ZmqEventSubscriber
from pagedattn.distributed.zmq_auth import CurveKeys
from pagedattn.serve.prefix_index import DEFAULT_ROUTED_TTL_S, PrefixIndex, hashes_digest
from pagedattn.serve.router import (
    DEFAULT_IMBALANCE_RATIO,
    DEFAULT_IMBALANCE_THRESHOLD,
    make_policy,
)

logger = logging.getLogger(__name__)

# Routers alive in this process (the ingress reads replica stats and router counters from them).
ACTIVE_ROUTERS: weakref.WeakSet[PagedRequestRouter] = weakref.WeakSet()
# The deployment's keys in this process (use_deployment_secret); routers subscribe with them.
_DEPLOYMENT_KEYS: list[CurveKeys] = []


def use_deployment_secret(secret: bytes) -> None:
    """The deployment secret this process's routers subscribe to replica event feeds with."""
    _DEPLOYMENT_KEYS[:] = [CurveKeys.from_secret(secret)]


def deployment_keys() -> CurveKeys | None:
    """The keys use_deployment_secret set in this process (None: none set)."""
    return _DEPLOYMENT_KEYS[0] if _DEPLOYMENT_KEYS else None


class PagedRequestRouter(RequestRouter):
    """Routes each call to the replica its policy ranks first (then second, ... if full)."""

    def initialize_state(
        self,
        policy: str = "prefix",
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
        routed_ttl_s: float = DEFAULT_ROUTED_TTL_S,
        seed: int | None = None,
        imbalance_ratio: float = DEFAULT_IMBALANCE_RATIO,
    ) -> None:
        self.index = PrefixIndex(routed_ttl_s)
        self.policy = make_policy(policy, self.index, imbalance_threshold, seed, imbalance_ratio)
        self._subscribers: dict[ReplicaID, ZmqEventSubscriber] = {}
        self.num_routed: dict[str, int] = {}
        # NOTE: the ingress reads the index from its own thread; ZMQ sockets are not thread-safe.
        self.lock = threading.Lock()
        # NOTE: Ray Serve ships the router class to the caller pickled, possibly by value with a
        # copy of this module's globals; the import finds the one registry the ingress reads.
        from pagedattn.serve import serve_router

        serve_router.ACTIVE_ROUTERS.add(self)

    # ---- KV events -------------------------------------------------------------------------

    def _sync_subscriptions(self) -> None:
        # NOTE: the module by name, as ACTIVE_ROUTERS above: this class may be a by-value copy.
        from pagedattn.serve import serve_router

        curve = serve_router.deployment_keys()
        for replica in self._replicas.values():
            rid = replica.replica_id
            if rid in self._subscribers:
                continue
            stats = replica.routing_stats or {}
            endpoint = stats.get("kv_events_endpoint")
            if endpoint is None:
                continue
            if curve is None:
                logger.warning(
                    "no deployment secret in this process: the KV events of replica %s cannot "
                    "be read (prefix routing falls back to load)",
                    rid.unique_id,
                )
            self._subscribers[rid] = ZmqEventSubscriber(
                endpoint,
                topic=stats.get("kv_events_topic", ""),
                replay_endpoint=stats.get("kv_events_replay_endpoint"),
                curve=curve,
            )
            self.index.add_replica(rid.unique_id)

    def drain_events(self) -> int:
        """Apply every event batch that arrived; returns how many."""
        with self.lock:
            self._sync_subscriptions()
            n = 0
            for rid, sub in self._subscribers.items():
                batches = sub.poll(0)
                # NOTE: the replica's stats (polled every period) name its last sent batch: a
                # loss of the last batches shows no gap until the next one, so fetch them now.
                replica = self._replicas.get(rid)
                stats = (replica.routing_stats or {}) if replica is not None else {}
                newest = stats.get("kv_events_last_seq")
                if newest is not None and newest > sub.last_seq:
                    batches += sub.catch_up(newest)
                for batch in batches:
                    self.index.apply(rid.unique_id, batch)
                    n += 1
            return n

    def _forget(self, replica_id: ReplicaID) -> None:
        with self.lock:
            sub = self._subscribers.pop(replica_id, None)
            if sub is not None:
                sub.close()
            self.index.remove_replica(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        old = set(self._replicas)
        super().update_replicas(replicas)
        for rid in old - set(self._replicas):
            self._forget(rid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    # ---- routing ---------------------------------------------------------------------------

    def _queue_len(self, replica: RunningReplica) -> int:
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        if cached is not None:
            return cached
        return int((replica.routing_stats or {}).get("num_requests", 0))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self.drain_events()
        hashes: Any = ()
        target = None
        if pending_request is not None:
            hashes = pending_request.kwargs.get("routing_hashes") or ()
            target = pending_request.kwargs.get("target_replica")
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if target in by_id:  # NOTE: a call for one replica (the ingress's /debug/kv)
            return [[by_id[target]]]
        loads = {uid: self._queue_len(r) for uid, r in by_id.items()}
        with self.lock:
            ranked = self.policy.rank(list(by_id), loads, hashes)
        return [[by_id[uid]] for uid in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        uid = replica_id.unique_id
        self.num_routed[uid] = self.num_routed.get(uid, 0) + 1
        hashes = pending_request.kwargs.get("routing_hashes") if pending_request else None
        if hashes:
            with self.lock:
                self.policy.on_routed(uid, hashes)

    # ---- for the ingress -------------------------------------------------------------------

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Latest routing stats per live replica id."""
        return {
            r.replica_id.unique_id: dict(r.routing_stats or {}) for r in self._replicas.values()
        }

    def policy_counters(self) -> dict[str, Any]:
        """The policy's name and decision counters (prefix: hits, misses, imbalanced), and how
        many cached blocks more than one replica holds now (from the events)."""
        self.drain_events()
        policy = self.policy
        with self.lock:
            num_shared = self.index.num_shared_blocks()
        out: dict[str, Any] = {
            "policy": policy.name,
            "num_routed": sum(self.num_routed.values()),
            "num_shared_blocks": num_shared,
        }
        for name in ("num_hits", "num_misses", "num_imbalanced"):
            if hasattr(policy, name):
                out[name] = getattr(policy, name)
        return out

    def index_view(self) -> dict[str, dict[str, Any]]:
        """Per replica: what the router believes it caches (after draining the events)."""
        self.drain_events()
        with self.lock:
            out = {}
            for uid in self.index.replica_ids:
                cached = self.index.cached_hashes(uid)
                out[uid] = {
                    "num_routed": self.num_routed.get(uid, 0),
                    "index_num_cached_blocks": len(cached),
                    "index_digest": hashes_digest(cached),
                }
            return out
