"""The bounded soak of tests/entrypoints/test_server_soak.py, through the second front door.

`pagedattn serve --data-parallel-size 2` (the Ray Serve ingress in front of two replicas) takes
valid, invalid and disconnecting clients at once. Afterwards every valid request completed in full,
`/health` is 200, both replicas are idle with every KV block free (`/debug/replicas` and the
merged `/metrics` agree), and SIGTERM drains and exits 0. No poisoned client: its engine wrapper
cannot be put inside a Ray replica (tests/serve/test_serve_app.py kills a replica instead).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

pytest.importorskip("ray")

from tests.entrypoints.server_process import (  # noqa: E402
    CLI_SERVE_COMMAND,
    ServerProcess,
    make_model_dir,
    wait_idle,
)
from tests.entrypoints.test_server_soak import (  # noqa: E402
    MODEL,
    _disconnect,
    _invalid,
    _rss_bytes,
    _valid,
)

SOAK_SECONDS = 15.0
NUM_CLIENTS = 64  # as the single server's front-door soak (issue 52: this one ran 8)
NUM_REPLICAS = 2
SETTLE_TIMEOUT_S = 60.0


def _replicas(base_url: str) -> dict[str, dict]:
    r = httpx.get(f"{base_url}/debug/replicas", timeout=10.0)
    r.raise_for_status()
    return r.json()


def _wait_replicas(base_url: str, cond, what: str, server: ServerProcess) -> dict[str, dict]:
    """Poll `/debug/replicas` (routing stats arrive once a second) until `cond(stats)` holds."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    stats: dict[str, dict] = {}
    while time.monotonic() < deadline:
        stats = _replicas(base_url)
        if len(stats) == NUM_REPLICAS and all(cond(s) for s in stats.values()):
            return stats
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}: {stats}\n{server.log_tail()}")


async def _clients(base_url: str, num: int, seconds: float, tally: dict) -> None:
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(_client(base_url, i, deadline, tally) for i in range(num)))


async def _client(base_url: str, seed: int, deadline: float, tally: dict) -> None:
    rng = random.Random(seed)
    kinds = [_valid] * 5 + [_invalid] * 2 + [_disconnect]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        while time.monotonic() < deadline:
            await rng.choice(kinds)(client, rng, tally)


def test_soak_through_the_ray_ingress_leaves_healthy_replicas_and_free_pools(tmp_path):
    model = make_model_dir(tmp_path)
    server = ServerProcess(
        model, tmp_path / "serve.log", "--served-model-name", MODEL, "--data-parallel-size",
        str(NUM_REPLICAS), "--replica-cpus", "0.5", "--num-blocks", "96", "--block-size", "16",
        "--max-model-len", "256", "--shutdown-timeout", "10", "--kv-cache-prefault",
        command=CLI_SERVE_COMMAND,
    )  # fmt: skip
    tally = {"valid": 0, "invalid": 0, "disconnect": 0}
    try:
        # NOTE: a replica is listed before Ray Serve first polls its routing stats (empty until
        # then): wait until both report their pools.
        _wait_replicas(
            server.base_url, lambda s: "num_free_blocks" in s, "2 replicas reporting", server
        )
        # A short warm-up first (every path imported, pools prefaulted): the replicas' RSS is
        # measured from after it.
        warm = {"valid": 0, "invalid": 0, "disconnect": 0}
        asyncio.run(_clients(server.base_url, 4, 2.0, warm))
        wait_idle(server.base_url, timeout=SETTLE_TIMEOUT_S)
        before = _wait_replicas(
            server.base_url, lambda s: s.get("num_requests") == 0, "idle replicas", server
        )
        rss_before = {rid: _rss_bytes(s["pid"]) for rid, s in before.items()}
        deadline = time.monotonic() + SOAK_SECONDS

        async def main() -> None:
            await asyncio.gather(
                *(_client(server.base_url, i, deadline, tally) for i in range(NUM_CLIENTS))
            )

        asyncio.run(main())
        assert httpx.get(f"{server.base_url}/health", timeout=10.0).json() == {"status": "ok"}
        # Disconnected streams are aborted on their replica; then nothing runs, no block is held
        # (prefix-cached blocks with ref_cnt 0 count as free) and the router's prefix index,
        # built from KV events, equals each replica's cache.
        after = _wait_replicas(
            server.base_url,
            lambda s: (
                s["num_requests"] == 0
                and s["num_free_blocks"] == s["num_usable_blocks"]
                and s.get("index_digest") == s["cached_digest"]
            ),
            "idle replicas with every block free and the index equal to their caches",
            server,
        )
        assert set(after) == set(before)  # no replica died and was replaced during the soak
        rss_after = {rid: _rss_bytes(s["pid"]) for rid, s in after.items()}
        print(f"ingress soak: {tally}; RSS per replica {rss_before} -> {rss_after}")
        for rid, rss in rss_after.items():
            assert abs(rss - rss_before[rid]) <= 0.05 * rss_before[rid], (rss_before, rss_after)
        # Every request that reached the ingress was routed to a replica, and both took some.
        assert all(s["num_routed"] > 0 for s in after.values()), after
        assert sum(s["num_routed"] for s in after.values()) >= tally["valid"] + tally["disconnect"]
        # The merged /metrics says the same, per replica and in sum.
        metrics = wait_idle(server.base_url, timeout=SETTLE_TIMEOUT_S)
        assert metrics["pagedattn_kv_cache_usage_perc"] == 0, metrics
        assert metrics["pagedattn_num_requests_running"] == 0, metrics
        assert metrics["pagedattn_num_requests_waiting"] == 0, metrics
        labelled = [k for k in metrics if k.startswith("pagedattn_kv_cache_usage_perc{")]
        assert {rid for rid in after if any(f'replica="{rid}"' in k for k in labelled)} == set(
            after
        ), labelled
        assert metrics["pagedattn_failed_requests_total"] == 0, metrics
    finally:
        code = server.stop(timeout=60.0)
    assert code == 0, server.log_tail()  # SIGTERM: the app is deleted, Ray stopped, exit 0
    assert min(tally.values()) >= 1, tally
    # A client that leaves mid-stream is a disconnect to the app, not an internal error (Ray's
    # proxy raised TaskCancelledError from receive(), logged with a traceback each time).
    log = (tmp_path / "serve.log").read_text()
    assert "TaskCancelledError" not in log and "internal error" not in log
