"""Tenants: API keys -> tenant, and the per-tenant cache_salt that keeps their caches apart.

Shared prefix-cache blocks are a timing side channel (a fast first token says someone else sent
that prefix), so with API keys configured every request's `cache_salt` is replaced by
HMAC(secret, tenant [, client salt]). A client's own salt only sub-divides its tenant's space;
without the secret no client can produce another tenant's salt. All gateway replicas with the
same secret (or the same key file) agree on the salts, so routing keys stay consistent.

Keys are held only as SHA-256 digests and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from pathlib import Path

import yaml

from cachekey.openai.errors import INVALID_API_KEY, APIError

log = logging.getLogger(__name__)

SECRET_ENV = "KVGATE_TENANT_SALT_SECRET"


class AuthError(APIError):
    """A missing or unknown API key (the message never contains the key): 401."""

    def __init__(self, message: str) -> None:
        super().__init__(401, message, code=INVALID_API_KEY, headers={"www-authenticate": "Bearer"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> dict[str, str]:
    """key -> tenant from JSON, YAML (a mapping), or `key tenant` lines (# comments)."""
    stripped = text.strip()
    if not stripped:
        return {}
    data: object = None
    try:
        data = json.loads(stripped)
    except ValueError:
        try:
            data = yaml.safe_load(stripped)
        except yaml.YAMLError:
            data = None
    if not isinstance(data, dict):
        data = {}
        for n, line in enumerate(stripped.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(f"api keys file line {n}: expected 'KEY TENANT'")
            data[fields[0]] = fields[1]
    out = {}
    for key, tenant in data.items():
        if not isinstance(key, str) or not key or not isinstance(tenant, str | int) or tenant == "":
            raise ValueError("api keys file: every entry must map a non-empty key to a tenant")
        out[key] = str(tenant)
    return out


class TenantRegistry:
    """API key -> tenant from a file, reloaded when its mtime changes (checked once a second)."""

    def __init__(self, path: str | Path, secret: str | None = None) -> None:
        self.path = Path(path)
        self._secret = secret or os.environ.get(SECRET_ENV) or None
        self._lock = threading.Lock()
        self._keys: dict[bytes, str] = {}
        self._salt_key = b""
        self._mtime: float | None = None
        self._checked = 0.0
        self._load()

    def _load(self) -> None:
        raw = self.path.read_bytes()
        keys = parse_keys(raw.decode())
        if not keys:
            raise ValueError(f"api keys file {self.path} holds no keys")
        # Without an explicit secret the file contents are the secret: every replica mounting
        # the same Secret derives the same salts (and a changed file re-salts everything).
        secret = self._secret.encode() if self._secret else b"kvgate-keys-file\0" + raw
        self._keys = {_digest(k): t for k, t in keys.items()}
        self._salt_key = hashlib.sha256(b"kvgate-tenant-salt\0" + secret).digest()
        self._mtime = self.path.stat().st_mtime
        log.info("loaded %d API keys for %d tenants", len(keys), len(set(keys.values())))

    def maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < 1.0:
            return
        with self._lock:
            self._checked = now
            try:
                if self.path.stat().st_mtime != self._mtime:
                    self._load()
            except (OSError, ValueError) as e:  # keep serving with the last good keys
                log.error("api keys file %s not reloaded: %s", self.path, e)

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of an `Authorization: Bearer <key>` header."""
        self.maybe_reload()
        if not authorization:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("malformed Authorization header: expected 'Bearer <key>'")
        tenant = self._keys.get(_digest(key.strip()))
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant

    def salt_for(self, tenant: str, client_salt: str | None) -> str:
        """The cache_salt to forward: the tenant's, sub-divided by the client's own salt."""
        t = tenant.encode()
        msg = len(t).to_bytes(4, "big") + t  # length-prefixed: no tenant/salt split ambiguity
        if client_salt is not None:
            msg += b"\1" + client_salt.encode()
        return "t-" + hmac.new(self._salt_key, msg, hashlib.sha256).hexdigest()[:32]
