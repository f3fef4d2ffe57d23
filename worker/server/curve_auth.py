"""The KV-event sockets as CURVE servers that admit only the gateways (cachekey.worker_auth).

A CURVE server checks each client's long-term key with a ZAP handler in its ZMQ context;
pyzmq's ThreadAuthenticator is that handler, on its own thread. It must run before the sockets
bind: a connection arriving before it would otherwise go unchecked (the sockets also enforce
the ZAP domain, so without a handler they refuse rather than admit).
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from cachekey.worker_auth import ZAP_DOMAIN, CurveKeys, TokenHoldersOnly

logger = logging.getLogger(__name__)


class CurveGuard:
    """Owns the ZAP handler of one context; `secure(sock)` makes a socket a CURVE server."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self._keys = keys
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(
            ZAP_DOMAIN.decode(), TokenHoldersOnly(keys, "kv-events", logger)
        )

    def secure(self, sock: zmq.Socket) -> None:
        self._keys.serve(sock)

    def stop(self) -> None:
        self._auth.stop()
