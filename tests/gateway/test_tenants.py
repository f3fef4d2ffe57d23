"""Tenant isolation: API keys, per-tenant cache_salt, and keys kept out of logs.

End to end over a real gateway and one real sim worker (so both tenants hit the same cache):
identical prompts from two tenants never share blocks, a tenant's repeat still hits its own
cache, and a client-supplied salt equal to another tenant's gives no hit.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from gateway.routing.tenants import AuthError, TenantRegistry, parse_keys
from harness.cluster import Cluster, ClusterSpec
from harness.waits import wait_index_converged
from tests.support.chat import bearer, chat, user

KEY_A = "sk-alice-7f3c9a1e5b2d4c6e8a0b"
KEY_B = "sk-bob-2e4d6f8a0c1b3d5e7f9a"
SECRET = "test-salt-secret"


def test_parse_keys_formats() -> None:
    want = {"k1": "alice", "k2": "bob"}
    assert parse_keys(json.dumps(want)) == want
    assert parse_keys("k1: alice\nk2: bob\n") == want
    assert parse_keys("# comment\nk1 alice\n\nk2 bob  # trailing\n") == want
    with pytest.raises(ValueError, match="line 1"):
        parse_keys("k1 alice extra\n")


def test_registry_auth_salts_and_reload(tmp_path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"{KEY_A} alice\n{KEY_B} bob\n")
    reg = TenantRegistry(path, SECRET)
    assert reg.authenticate(f"Bearer {KEY_A}") == "alice"
    for bad in (None, "", KEY_A, "Basic abc", "Bearer nope"):
        with pytest.raises(AuthError) as info:
            reg.authenticate(bad)
        assert KEY_A not in str(info.value)
    # Salts: per tenant, stable across instances with the same secret, secret-dependent, and a
    # client salt only sub-divides its own tenant's space.
    a, b = reg.salt_for("alice", None), reg.salt_for("bob", None)
    assert a != b and a == TenantRegistry(path, SECRET).salt_for("alice", None)
    assert a != TenantRegistry(path, "other").salt_for("alice", None)
    assert reg.salt_for("bob", a) not in (a, b)
    assert reg.salt_for("alice", "x") != reg.salt_for("alice", "y")
    # Without a secret the file contents are it: two replicas with the same file agree.
    os.environ.pop("KVGATE_TENANT_SALT_SECRET", None)
    assert TenantRegistry(path).salt_for("alice", None) == TenantRegistry(path).salt_for(
        "alice", None
    )
    # Reload on mtime change: the old key stops working, the new one works.
    path.write_text(f"sk-new-key carol\n{KEY_B} bob\n")
    os.utime(path, (time.time() + 5, time.time() + 5))
    reg._checked = 0.0  # skip the once-a-second throttle
    assert reg.authenticate("Bearer sk-new-key") == "carol"
    with pytest.raises(AuthError):
        reg.authenticate(f"Bearer {KEY_A}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("tenants")
    keys = d / "keys.yaml"
    keys.write_text(f"{KEY_A}: alice\n{KEY_B}: bob\n")
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=512,
        gateway_args=(
            "--poll-interval",
            "0.2",
            "--api-keys-file",
            str(keys),
            "--tenant-salt-secret",
            SECRET,
            "--log-level",
            "debug",
        ),
        log_dir=d,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        c.keys_path = keys
        yield c


SYSTEM = "You are a careful assistant for the finance team. " * 25


def _ask(gw: str, key: str | None, text: str, **extra) -> httpx.Response:
    """The finance team's system prompt and `text`, as the tenant of API key `key` (or none)."""
    messages = [{"role": "system", "content": SYSTEM}, *user(text)]
    return chat(gw, messages, bearer(key) if key else {}, temperature=0.0, **extra)


def _cached(r: httpx.Response) -> tuple[int, int]:
    assert r.status_code == 200, r.text
    reported = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return reported, int(r.headers["x-kvgate-predicted-cached-tokens"])


def test_keys_required_but_health_and_metrics_open(cluster) -> None:
    gw = cluster.gateway_url
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY_A}):
        r = httpx.post(f"{gw}/v1/chat/completions", json={"messages": []}, headers=headers)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    assert httpx.get(f"{gw}/v1/models").status_code == 401
    ok = httpx.get(f"{gw}/v1/models", headers=bearer(KEY_A))
    assert ok.status_code == 200
    assert httpx.get(f"{gw}/health").status_code == 200
    assert httpx.get(f"{gw}/metrics").status_code == 200


def test_tenants_never_share_blocks(cluster) -> None:
    gw = cluster.gateway_url
    first = _ask(gw, KEY_A, "What were Q3 revenues?")
    assert _cached(first) == (0, 0)
    wait_index_converged(gw, cluster.worker_urls)  # the worker's events reached the index
    again = _cached(_ask(gw, KEY_A, "What were Q3 revenues?"))
    assert again[0] > 0 and again[0] == again[1]  # a tenant still hits its own cache
    assert _cached(_ask(gw, KEY_B, "What were Q3 revenues?")) == (0, 0)
    # Bob presents the salt the gateway gives alice: it is re-derived under bob, so no hit.
    alice_salt = TenantRegistry(cluster.keys_path, SECRET).salt_for("alice", None)
    r = _ask(gw, KEY_B, "What were Q3 revenues?", cache_salt=alice_salt)
    assert _cached(r) == (0, 0)
    wait_index_converged(gw, cluster.worker_urls)
    # Bob's own repeat hits bob's blocks.
    bob_again = _cached(_ask(gw, KEY_B, "What were Q3 revenues?"))
    assert bob_again[0] > 0 and bob_again[0] == bob_again[1]


def test_keys_never_logged(cluster) -> None:
    gw = cluster.gateway_url
    for key in (KEY_A, KEY_B, "sk-unknown-key-123456"):
        _ask(gw, key, "hello")
    httpx.get(f"{gw}/metrics")
    metrics = httpx.get(f"{gw}/metrics").text
    logs = "".join(p.log_tail(100_000) for p in (*cluster.gateways, *cluster.workers))
    assert "loaded 2 API keys" in logs  # the log is really being written
    for key in (KEY_A, KEY_B, "sk-unknown-key-123456"):
        assert key not in logs
        assert key not in metrics
