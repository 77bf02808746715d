"""The Ray ingress's debug routes on a stand-in ingress (no Ray instance): the admin key guards
/debug/replicas and /debug/router, /debug/kv asks the chosen replica for the caller's view."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from pagedattn.entrypoints.openai.http import TenantAuth, make_app
from pagedattn.entrypoints.openai.protocol import APIError
from pagedattn.serve.ingress_debug import TARGET_REPLICA, install_debug_routes

KEYS, ADMIN = ["key-a", "key-b"], "key-admin"
STATS = {"r1": {"pid": 31337, "kv_events_endpoint": "tcp://10.0.0.7:5000", "metrics": "m"},
         "r2": {"pid": 31338, "kv_events_endpoint": "tcp://10.0.0.7:5001"}}  # fmt: skip


class Router:
    def replica_stats(self):
        return {uid: dict(s) for uid, s in STATS.items()}

    def index_view(self):
        return {"r1": {"num_routed": 3}}

    def policy_counters(self):
        return {"policy": "prefix", "num_routed": 3}


class Method:
    """`handle.kv_snapshot`: records each call; `.remote(...)` is awaitable."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def remote(self, owner, scoped, **kwargs):
        self.calls.append((owner, scoped, kwargs))

        async def answer():
            return {"replica_id": kwargs[TARGET_REPLICA], "requests": {}, "owner": owner}

        return answer()


def client(api_keys, admin_keys=()) -> tuple[TestClient, Method]:
    auth = TenantAuth(api_keys, secret=b"s", admin_keys=admin_keys)
    snapshot = Method()

    async def ensure_router():
        return None

    ingress = SimpleNamespace(
        auth=auth, ensure_router=ensure_router, engine=SimpleNamespace(kv_snapshot=snapshot)
    )
    api = make_app("test", auth, max_request_bytes=None)
    install_debug_routes(api, ingress, lambda: [Router()])
    return TestClient(api), snapshot


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_internal_endpoints_refuse_tenant_keys_and_serve_the_admin_key():
    app, _ = client(KEYS, [ADMIN])
    for path in ("/debug/replicas", "/debug/router"):
        assert app.get(path).status_code == 401
        for key in KEYS:
            r = app.get(path, headers=bearer(key))
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
            assert "10.0.0.7" not in r.text and "31337" not in r.text
    r = app.get("/debug/replicas", headers=bearer(ADMIN))
    assert r.status_code == 200
    assert r.json()["r1"]["pid"] == 31337 and r.json()["r1"]["num_routed"] == 3
    assert "metrics" not in r.json()["r1"]
    assert app.get("/debug/router", headers=bearer(ADMIN)).json()["routers"][0]["num_routed"] == 3
    # Keys without an admin key: nobody reads them.
    app, _ = client(KEYS)
    assert app.get("/debug/replicas", headers=bearer(KEYS[0])).status_code == 403


def test_an_open_server_serves_them_and_an_admin_key_alone_closes_the_server():
    app, _ = client(None)
    assert app.get("/debug/replicas").status_code == 200
    auth = TenantAuth(None, secret=b"s", admin_keys=[ADMIN])
    assert auth.api_keys == [ADMIN]
    with pytest.raises(APIError):
        auth.authenticate(None)
    assert auth.authenticate(f"Bearer {ADMIN}") is not None
    auth.require_admin(f"Bearer {ADMIN}")


def test_debug_kv_asks_the_chosen_replica_for_the_callers_view():
    app, snapshot = client(KEYS, [ADMIN])
    assert app.get("/debug/kv").status_code == 401
    r = app.get("/debug/kv", headers=bearer(KEYS[0]))
    assert r.status_code == 200
    assert r.json()["replica_id"] == "r1" and r.json()["replica_ids"] == ["r1", "r2"]
    r = app.get("/debug/kv", params={"replica": "r2"}, headers=bearer(KEYS[1]))
    assert r.json()["replica_id"] == "r2"
    (owner_a, scoped_a, _), (owner_b, scoped_b, kwargs) = snapshot.calls
    # Each caller is asked for as its own tenant, scoped (keys are set).
    assert owner_a and owner_b and owner_a != owner_b and scoped_a and scoped_b
    assert kwargs == {TARGET_REPLICA: "r2"}
    r = app.get("/debug/kv", params={"replica": "r9"}, headers=bearer(KEYS[0]))
    assert r.status_code == 404 and r.json()["error"]["param"] == "replica"
    page = app.get("/dashboard")
    assert page.status_code == 200 and "/debug/kv" in page.text
