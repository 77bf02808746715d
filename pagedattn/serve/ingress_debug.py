"""The Ray Serve ingress's debug endpoints.

- `/debug/replicas`, `/debug/router`: internal (pids, Ray node ids, socket endpoints, routing
  counters over every tenant): the admin key only (`TenantAuth.require_admin`).
- `/debug/kv`: one replica's kv_snapshot(), scoped to the caller's tenant as on the single
  server (entrypoints/openai/kv_debug.py); `?replica=ID` picks the replica (default: the first
  by id), and the body names it (`replica_id`) and the others (`replica_ids`). With PD these are
  the decode replicas (the ingress's backend).
- `/dashboard`: the single server's page; `/dashboard?replica=ID` shows that replica.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedattn.entrypoints.openai.http import tenant_of
from pagedattn.entrypoints.openai.kv_debug import dashboard_response
from pagedattn.entrypoints.openai.protocol import APIError

# The keyword that sends a call to one replica (serve_router.PagedRequestRouter reads it).
TARGET_REPLICA = "target_replica"


def install_debug_routes(api: FastAPI, ingress: Any, routers) -> None:
    """Add the debug routes of `ingress` (an OpenAIIngress); routers() lists its routers."""

    @api.get("/debug/replicas")
    async def replicas(raw: Request) -> Response:
        ingress.auth.require_admin(raw.headers.get("authorization"))
        await ingress.ensure_router()
        out = {}
        for router in routers():
            view = router.index_view()
            for uid, stats in router.replica_stats().items():
                stats.pop("metrics", None)
                stats.update(view.get(uid, {}))
                out[uid] = stats
        return JSONResponse(out)

    @api.get("/debug/router")
    async def router(raw: Request) -> Response:
        ingress.auth.require_admin(raw.headers.get("authorization"))
        await ingress.ensure_router()
        return JSONResponse({"routers": [r.policy_counters() for r in routers()]})

    @api.get("/debug/kv")
    async def debug_kv(raw: Request, replica: str | None = None) -> Response:
        await ingress.ensure_router()
        ids = sorted({uid for r in routers() for uid in r.replica_stats()})
        if not ids:
            raise APIError("no engine replica is running", status_code=503, err_type="server_error")
        if replica is not None and replica not in ids:
            raise APIError(
                f"replica={replica!r} is not a running replica: use one of replica_ids",
                status_code=404,
                param="replica",
            )
        target = replica or ids[0]
        call = ingress.engine.kv_snapshot.remote(
            tenant_of(raw), bool(ingress.auth.api_keys), **{TARGET_REPLICA: target}
        )
        snapshot = await call
        snapshot["replica_ids"] = ids
        return JSONResponse(snapshot)

    @api.get("/dashboard")
    async def dashboard() -> Response:
        return dashboard_response()
