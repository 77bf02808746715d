"""Issue 52: an API key's cache salt is stable across restarts when the deployment names a
secret (so the KV store hits again), and is never the key itself or guessable from it."""

from __future__ import annotations

import logging

from pagedattn.entrypoints.openai.http import TenantAuth

KEY = "tenant-key-1"
HEADER = f"Bearer {KEY}"


def _salt(monkeypatch, secret: str | None) -> str:
    if secret is None:
        monkeypatch.delenv("PAGEDATTN_TENANT_SALT_SECRET", raising=False)
    else:
        monkeypatch.setenv("PAGEDATTN_TENANT_SALT_SECRET", secret)
    return TenantAuth([KEY]).authenticate(HEADER)


def test_a_named_secret_gives_the_same_salt_after_a_restart(monkeypatch):
    first, restarted = _salt(monkeypatch, "deploy-secret"), _salt(monkeypatch, "deploy-secret")
    assert first == restarted
    assert KEY not in first
    assert _salt(monkeypatch, "another-secret") != first


def test_without_a_secret_each_start_draws_one_and_says_so(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="pagedattn.entrypoints.openai.http"):
        first, restarted = _salt(monkeypatch, None), _salt(monkeypatch, None)
    assert first != restarted
    assert "PAGEDATTN_TENANT_SALT_SECRET" in caplog.text
