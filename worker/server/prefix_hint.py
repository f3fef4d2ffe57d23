"""The gateway's prefix hint, acted on as soon as a request's headers arrive.

The gateway names (`x-kvgate-prefix`) the last block of the cached chain it predicts a request to
hit. Until the engine sees that request, other requests' admissions evict from the LRU head, which
is where a conversation's blocks wait between its turns. Reading a body, checking its shape and
validating it can take tens of milliseconds on a busy worker, so the chain is refreshed before
any of that (BlockManager.refresh_chain), between the engine's next steps. A hint is never an
error: a malformed one, or one naming a chain the engine does not hold, changes nothing.

Inside the token check (only an authenticated request reaches the engine), outside the body guard.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from cachekey.headers import PREFIX_HEADER
from cachekey.keys import parse_prefix_header
from cachekey.openai.errors import APIError
from worker.server.serving import rank_index

_HINT = PREFIX_HEADER.encode()


class PrefixHint:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            hint = next((v for k, v in scope["headers"] if k == _HINT), None)
            if hint is not None:
                _refresh(scope, hint)
        await self.app(scope, receive, send)


def _refresh(scope: Scope, hint: bytes) -> None:
    key = parse_prefix_header(hint.decode("latin-1"))
    if key is None:
        return
    ranks = scope["app"].state.ranks
    try:
        i = rank_index(Request(scope), len(ranks))  # the rank the route will serve it on
    except APIError:
        return  # the route answers the bad rank with a 400
    if i is None:
        if len(ranks) != 1:
            return  # the route picks the least loaded rank later: which one is not known yet
        i = 0
    ranks[i].engine.refresh_prefix(key)
