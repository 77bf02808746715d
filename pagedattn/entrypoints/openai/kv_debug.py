"""What every front door's `/debug/kv` and `/dashboard` share: the tenant scoping of a
kv_snapshot() and the dashboard page (the single server and the Ray Serve ingress)."""

from __future__ import annotations

from pathlib import Path

from fastapi.responses import FileResponse, JSONResponse, Response

from pagedattn.entrypoints.openai.protocol import error_body

STATIC_DIR = Path(__file__).parent / "static"
# Per-block arrays of /debug/kv that a tenant sees only for its own blocks.
_BLOCK_ARRAYS = ("ref_cnt", "cached", "state")
# What another tenant's (or an idle) block shows as in a tenant's /debug/kv.
HIDDEN_BLOCK = {"ref_cnt": 0, "cached": False, "state": "hidden"}


def scope_kv_snapshot(snapshot: dict, own_ids: set[str]) -> dict:
    """A /debug/kv snapshot cut to the caller's requests; others only as aggregate counts.

    Engine-internal ids of a request's sibling sequences (`<id>#<n>`) count as the request's.
    """

    def mine(core_id: str) -> bool:
        return core_id in own_ids or core_id.partition("#")[0] in own_ids

    tables = snapshot.get("block_tables", {})
    other_ids = [r for r in tables if not mine(r)]
    other_blocks = {b for r in other_ids for g in tables[r] for b in g}
    scoped = dict(snapshot)
    scoped["owners"] = [[r for r in owners if mine(r)] for owners in snapshot.get("owners", [])]
    scoped["block_tables"] = {r: t for r, t in tables.items() if mine(r)}
    scoped["requests"] = {r: v for r, v in snapshot.get("requests", {}).items() if mine(r)}
    own_blocks = {b for r in scoped["block_tables"] for g in tables[r] for b in g}
    # NOTE: the per-block arrays of the whole pool show when and where other tenants' prompts
    # are cached (an activity side channel): a tenant sees its own blocks, the rest hidden.
    for name in _BLOCK_ARRAYS:
        if name in snapshot:
            values = snapshot[name]
            hidden = HIDDEN_BLOCK[name]
            scoped[name] = [v if i in own_blocks else hidden for i, v in enumerate(values)]
    scoped["other_tenants"] = {
        "num_requests": len({r.partition("#")[0] for r in other_ids}),
        "num_blocks": len(other_blocks),
    }
    return scoped


async def tenant_kv_snapshot(engine, owner: str | None, scoped: bool) -> dict:
    """An AsyncLLMEngine's /debug/kv body for the tenant `owner` (scoped: keys are set).

    NOTE: without keys there is one tenant, whose dashboard shows the whole pool.
    """
    snapshot, own_ids = await engine.kv_snapshot_with_owned(owner)
    return scope_kv_snapshot(snapshot, own_ids) if scoped else snapshot


def dashboard_response() -> Response:
    """The `/dashboard` page (it polls `/debug/kv`), or a 404 error body if not installed."""
    page = STATIC_DIR / "dashboard.html"
    if not page.exists():
        body = error_body("the dashboard page is not installed", "invalid_request_error")
        return JSONResponse(body, status_code=404)
    return FileResponse(page, media_type="text/html")
