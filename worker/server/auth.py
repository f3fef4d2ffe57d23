"""The worker token: every endpoint but `/health` answers only a caller that presents it.

A pure ASGI wrapper around the whole app, so a router added later (embeddings, LoRA, peers'
endpoints) is covered without saying so, and a refused request never reaches routing or has
its body read. The comparison is constant-time (cachekey.worker_auth.token_matches); the token
is never logged, and a refusal says which header to send, not what was sent.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from cachekey.openai.errors import INVALID_API_KEY
from cachekey.worker_auth import bearer, token_matches
from worker.server.errors import send_error

_MESSAGE = (
    "this worker answers only its gateways: send `Authorization: Bearer <worker token>` "
    "(--worker-token / KVGATE_WORKER_TOKEN)"
)
_CHALLENGE = ((b"www-authenticate", b'Bearer realm="kvgate-worker"'),)


class WorkerAuth:
    """Refuses (401, an OpenAI error body) any request without the worker token."""

    def __init__(self, app: ASGIApp, token: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._expected = bearer(token).encode()
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "lifespan"
            or scope["path"] in self._open
            or token_matches(_authorization(scope), self._expected)
        ):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        else:
            await send_error(send, 401, _MESSAGE, code=INVALID_API_KEY, headers=_CHALLENGE)


def _authorization(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value
    return None
