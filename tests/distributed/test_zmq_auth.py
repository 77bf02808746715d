"""Deployment CURVE keys: derived from the secret alone, and never shown."""

from __future__ import annotations

import pytest
import zmq

from pagedattn.distributed.zmq_auth import CurveKeys, new_deployment_secret


def test_every_holder_of_the_secret_derives_the_same_keys_and_others_differ():
    secret = new_deployment_secret()
    keys = CurveKeys.from_secret(secret)
    assert keys == CurveKeys.from_secret(secret)
    assert keys.server_public == zmq.curve_public(keys.server_secret)
    assert keys.client_public == zmq.curve_public(keys.client_secret)
    assert keys.server_secret != keys.client_secret
    other = CurveKeys.from_secret(new_deployment_secret())
    assert other.server_public != keys.server_public
    assert other.client_public != keys.client_public
    shown = repr(keys) + str(keys)
    assert keys.server_secret.decode() not in shown and keys.client_secret.decode() not in shown


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 32"):
        CurveKeys.from_secret(b"short")
