"""session: a session header hashes to a replica (rendezvous), falling back down the order.

Requests without the header are ranked by cache_aware.
"""

from __future__ import annotations

import xxhash

from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.routing.policies.base import RouteContext
from gateway.routing.policies.cache_aware import CacheAwarePolicy


class SessionPolicy:
    name = "session"

    def __init__(self, config: GatewayConfig) -> None:
        self.header = config.session_header.lower()
        self._fallback = CacheAwarePolicy(config)

    def rank(self, ctx: RouteContext) -> list[Replica]:
        session = ctx.headers.get(self.header)
        if not session:
            return self._fallback.rank(ctx)
        seed = session.encode()
        # Rendezvous hashing keeps a session on its replica while others come and go.
        return sorted(ctx.candidates, key=lambda r: -xxhash.xxh64_intdigest(seed + r.id.encode()))
