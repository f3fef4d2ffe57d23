"""How a gateway proves itself to a worker: one shared worker token (docs/security.md).

Over HTTP the gateway sends `Authorization: Bearer <token>` on every worker call (vLLM's
`--api-key` checks the same header), and the worker compares it in constant time. On the KV
events, ZMQ CURVE keys derived from the token: the worker's PUB and ROUTER are CURVE servers that
admit only the client key derived from the same token, so whoever lacks the token cannot
complete the handshake and receives nothing. Deriving the keys means there is one secret to
distribute, not four. The token is a secret: nothing here logs or repr()s it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass

WORKER_TOKEN_ENV = "KVGATE_WORKER_TOKEN"
MIN_TOKEN_CHARS = 16
ZAP_DOMAIN = b"kvgate-kv-events"


def resolve_token(flag_value: str | None) -> str | None:
    """The token from its flag, else from env KVGATE_WORKER_TOKEN; None when neither is set.

    Raises ValueError (without the token in the message) for a short or unprintable token.
    """
    token = flag_value or os.environ.get(WORKER_TOKEN_ENV) or None
    if token is None:
        return None
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the worker token must be at least {MIN_TOKEN_CHARS} characters "
            "(e.g. `openssl rand -hex 32`)"
        )
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ValueError("the worker token must be printable ASCII without spaces")
    return token


def bearer(token: str) -> str:
    """The `Authorization` header value that carries `token`."""
    return f"Bearer {token}"


def token_matches(header: bytes | None, expected: bytes) -> bool:
    """Whether an `Authorization` header value is `expected` (the whole `Bearer ...` value).

    Constant time in the header's content: a wrong token takes as long however much of it is
    right.
    """
    return header is not None and hmac.compare_digest(header, expected)


def _derived(token: str, role: bytes) -> bytes:
    return hmac.new(token.encode(), b"kvgate kv-events curve key\0" + role, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True, repr=False)
class CurveKeys:
    """The CURVE key pairs of the KV-event sockets, Z85-encoded as ZMQ takes them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_token(cls, token: str) -> CurveKeys:
        import zmq  # not needed by cachekey's other users
        from zmq.utils import z85

        server_secret = z85.encode(_derived(token, b"server"))
        client_secret = z85.encode(_derived(token, b"client"))
        return cls(
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
        )

    def serve(self, sock) -> None:
        """Make `sock` (PUB or ROUTER, before it binds) a CURVE server under kvgate's ZAP domain."""
        import zmq

        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit

    def connect(self, sock) -> None:
        """Make `sock` (SUB or DEALER, before it connects) a CURVE client of the worker."""
        import zmq

        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

    def admits(self, client_public: bytes) -> bool:
        """The ZAP check: only the client key derived from the same token."""
        return hmac.compare_digest(client_public, self.client_public)


class TokenHoldersOnly:
    """The ZAP credentials check a CURVE server's authenticator calls (pyzmq's
    `configure_curve_callback`): it admits the client key derived from the same token, nothing
    else. The first refusal is logged, once: a scanner would otherwise fill the log."""

    def __init__(self, keys: CurveKeys, sockets: str, log: logging.Logger) -> None:
        self._keys, self._sockets, self._log = keys, sockets, log
        self._refused = False

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = self._keys.admits(client_key)
        if not ok and not self._refused:
            self._refused = True
            self._log.warning(
                "%s: refused a client without the worker token's CURVE key", self._sockets
            )
        return ok
